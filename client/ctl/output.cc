#include "client/ctl/output.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {

int Fail(const absl::Status& status) {
  // No daemon at the socket tried: say how to name another.
  const bool no_daemon =
      absl::IsUnavailable(status) && absl::StartsWith(status.message(), client::kNoDaemonListening);
  std::fprintf(
      stderr, "error: %s: %s%s\n", absl::StatusCodeToString(status.code()).c_str(),
      std::string(status.message()).c_str(),
      no_daemon ? "; give gpufeedctl its socket with --socket PATH (or GPUFEED_SOCKET)" : "");
  return 1;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  auto line = [&](const std::vector<std::string>& row) {
    std::string out;
    for (size_t c = 0; c < row.size(); ++c) {
      out += row[c];
      if (c + 1 < row.size()) out += std::string(width[c] - row[c].size() + 2, ' ');
    }
    std::printf("%s\n", out.c_str());
  };
  line(header);
  for (const auto& row : rows) line(row);
}

}  // namespace gpufeed::ctl
