#include "server/objstore/s3_uri.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace gpufeed::objstore {
namespace {

bool Unreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         c == '-' || c == '.' || c == '_' || c == '~';
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string UriEncode(absl::string_view text, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size() * 3);
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (Unreserved(c) || (keep_slash && c == '/')) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xf]);
    }
  }
  return out;
}

absl::StatusOr<std::string> UrlDecode(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '+') {
      out.push_back(' ');
    } else if (text[i] != '%') {
      out.push_back(text[i]);
    } else {
      const int hi = i + 2 < text.size() ? HexValue(text[i + 1]) : -1;
      const int lo = i + 2 < text.size() ? HexValue(text[i + 2]) : -1;
      if (hi < 0 || lo < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad percent-encoding at byte ", i, " of \"", text, "\""));
      }
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    }
  }
  return out;
}

std::string CanonicalQuery(std::vector<std::pair<std::string, std::string>> parameters) {
  // SigV4 sorts by encoded name (then value); our names are unreserved already, so encoded or
  // not sorts the same.
  std::sort(parameters.begin(), parameters.end());
  std::string out;
  for (const auto& [name, value] : parameters) {
    if (!out.empty()) out.push_back('&');
    absl::StrAppend(&out, UriEncode(name, false), "=", UriEncode(value, false));
  }
  return out;
}

std::string S3Url(absl::string_view bucket, absl::string_view key) {
  // Escaped: a key is the caller's, and this name goes into statuses that reach log lines.
  return absl::StrCat("s3://", EscapeForLog(bucket, 256), "/", EscapeForLog(key, 1024));
}

}  // namespace gpufeed::objstore
