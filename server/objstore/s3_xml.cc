#include "server/objstore/s3_xml.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/objstore/s3_uri.h"

namespace gpufeed::objstore {
namespace {

void AppendUtf8(uint32_t code_point, std::string* out) {
  if (code_point < 0x80) {
    out->push_back(static_cast<char>(code_point));
  } else if (code_point < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out->push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else if (code_point < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (code_point >> 12)));
    out->push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (code_point >> 18)));
    out->push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
}

// The code point of a character reference's digits ("#38", "#x26"), or nullopt.
std::optional<uint32_t> CharacterReference(absl::string_view ref) {
  if (ref.size() < 2 || ref[0] != '#') return std::nullopt;
  const bool hex = ref[1] == 'x' || ref[1] == 'X';
  const absl::string_view digits = ref.substr(hex ? 2 : 1);
  if (digits.empty() || digits.size() > 8) return std::nullopt;
  uint32_t value = 0;
  for (const char c : digits) {
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    else if (hex && c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    else if (hex && c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (digit < 0) return std::nullopt;
    value = value * (hex ? 16 : 10) + static_cast<uint32_t>(digit);
  }
  // Surrogates and values beyond Unicode are no characters.
  if (value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) return std::nullopt;
  return value;
}

// The entity-decoded text of the first <name> in `xml` that the caller requires.
absl::StatusOr<std::string> RequiredText(absl::string_view xml, absl::string_view name,
                                         absl::string_view document) {
  GPUFEED_ASSIGN_OR_RETURN(std::optional<std::string> text, XmlFirstText(xml, name));
  if (!text.has_value()) {
    return absl::InternalError(absl::StrCat(document, " without <", name, ">"));
  }
  return *std::move(text);
}

}  // namespace

absl::StatusOr<std::string> DecodeXmlText(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const size_t amp = text.find('&', i);
    if (amp == absl::string_view::npos) {
      absl::StrAppend(&out, text.substr(i));
      break;
    }
    absl::StrAppend(&out, text.substr(i, amp - i));
    const size_t semi = text.find(';', amp);
    // The longest reference is "&#x10FFFF;" or "&#1114111;".
    if (semi == absl::string_view::npos || semi - amp > 12) {
      return absl::InvalidArgumentError(
          absl::StrCat("unterminated XML reference at byte ", amp));
    }
    const absl::string_view ref = text.substr(amp + 1, semi - amp - 1);
    if (ref == "amp") out.push_back('&');
    else if (ref == "lt") out.push_back('<');
    else if (ref == "gt") out.push_back('>');
    else if (ref == "quot") out.push_back('"');
    else if (ref == "apos") out.push_back('\'');
    else if (std::optional<uint32_t> code_point = CharacterReference(ref)) {
      AppendUtf8(*code_point, &out);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown XML reference &", ref, ";"));
    }
    i = semi + 1;
  }
  return out;
}

std::vector<absl::string_view> XmlElements(absl::string_view xml, absl::string_view name) {
  std::vector<absl::string_view> out;
  const std::string open = absl::StrCat("<", name);
  const std::string close = absl::StrCat("</", name, ">");
  size_t pos = 0;
  while ((pos = xml.find(open, pos)) != absl::string_view::npos) {
    const size_t after_name = pos + open.size();
    // "<Key>" or "<Key attr=...>" or "<Key/>", not "<KeyCount>".
    if (after_name >= xml.size()) break;
    const char next = xml[after_name];
    if (next != '>' && next != '/' && !absl::ascii_isspace(static_cast<unsigned char>(next))) {
      pos = after_name;
      continue;
    }
    const size_t tag_end = xml.find('>', after_name);
    if (tag_end == absl::string_view::npos) break;
    if (xml[tag_end - 1] == '/') {  // <Key/>
      out.push_back(xml.substr(tag_end + 1, 0));
      pos = tag_end + 1;
      continue;
    }
    const size_t end = xml.find(close, tag_end + 1);
    if (end == absl::string_view::npos) break;
    out.push_back(xml.substr(tag_end + 1, end - tag_end - 1));
    pos = end + close.size();
  }
  return out;
}

absl::StatusOr<std::optional<std::string>> XmlFirstText(absl::string_view xml,
                                                        absl::string_view name) {
  const std::vector<absl::string_view> elements = XmlElements(xml, name);
  if (elements.empty()) return std::optional<std::string>();
  absl::StatusOr<std::string> text = DecodeXmlText(elements.front());
  if (!text.ok()) return Annotate(text.status(), absl::StrCat("<", name, ">"));
  return std::optional<std::string>(*std::move(text));
}

S3ErrorBody ParseS3Error(absl::string_view body) {
  S3ErrorBody error;
  const std::vector<absl::string_view> errors = XmlElements(body, "Error");
  if (errors.empty()) return error;
  // A malformed field is left empty: the HTTP status still tells what happened.
  if (auto code = XmlFirstText(errors.front(), "Code"); code.ok() && code->has_value()) {
    error.code = **code;
  }
  if (auto message = XmlFirstText(errors.front(), "Message");
      message.ok() && message->has_value()) {
    error.message = **message;
  }
  return error;
}

absl::StatusOr<S3ListPage> ParseListObjectsV2(absl::string_view xml) {
  constexpr absl::string_view kDocument = "ListObjectsV2 response";
  if (XmlElements(xml, "ListBucketResult").empty()) {
    return absl::InternalError(absl::StrCat(kDocument, " without <ListBucketResult>"));
  }
  GPUFEED_ASSIGN_OR_RETURN(std::optional<std::string> encoding,
                           XmlFirstText(xml, "EncodingType"));
  const bool url_encoded = encoding.has_value() && *encoding == "url";
  S3ListPage page;
  for (const absl::string_view contents : XmlElements(xml, "Contents")) {
    S3ListEntry entry;
    GPUFEED_ASSIGN_OR_RETURN(entry.key, RequiredText(contents, "Key", kDocument));
    if (url_encoded) {
      absl::StatusOr<std::string> key = UrlDecode(entry.key);
      if (!key.ok()) return Annotate(key.status(), absl::StrCat(kDocument, ": <Key>"));
      entry.key = *std::move(key);
    }
    absl::StatusOr<std::string> size = RequiredText(contents, "Size", kDocument);
    if (!size.ok()) return size.status();
    if (!absl::SimpleAtoi(*size, &entry.size)) {
      return absl::InternalError(
          absl::StrCat(kDocument, ": <Size> \"", *size, "\" is no byte count"));
    }
    // Some stores leave the ETag out of a listing; a HEAD gives it then.
    GPUFEED_ASSIGN_OR_RETURN(std::optional<std::string> etag, XmlFirstText(contents, "ETag"));
    if (etag.has_value()) entry.etag = *std::move(etag);
    page.entries.push_back(std::move(entry));
  }
  absl::StatusOr<std::string> truncated = RequiredText(xml, "IsTruncated", kDocument);
  if (!truncated.ok()) return truncated.status();
  page.truncated = *truncated == "true";
  if (page.truncated) {
    GPUFEED_ASSIGN_OR_RETURN(page.next_continuation_token,
                             RequiredText(xml, "NextContinuationToken", kDocument));
    if (page.next_continuation_token.empty()) {
      return absl::InternalError(
          absl::StrCat(kDocument, ": truncated with an empty <NextContinuationToken>"));
    }
  }
  return page;
}

absl::StatusOr<StsCredentials> ParseStsCredentials(absl::string_view xml) {
  constexpr absl::string_view kDocument = "AssumeRoleWithWebIdentity response";
  const std::vector<absl::string_view> credentials = XmlElements(xml, "Credentials");
  if (credentials.empty()) {
    return absl::InternalError(absl::StrCat(kDocument, " without <Credentials>"));
  }
  StsCredentials out;
  GPUFEED_ASSIGN_OR_RETURN(out.access_key_id,
                           RequiredText(credentials.front(), "AccessKeyId", kDocument));
  GPUFEED_ASSIGN_OR_RETURN(out.secret_access_key,
                           RequiredText(credentials.front(), "SecretAccessKey", kDocument));
  GPUFEED_ASSIGN_OR_RETURN(out.session_token,
                           RequiredText(credentials.front(), "SessionToken", kDocument));
  GPUFEED_ASSIGN_OR_RETURN(out.expiration,
                           RequiredText(credentials.front(), "Expiration", kDocument));
  return out;
}

}  // namespace gpufeed::objstore
