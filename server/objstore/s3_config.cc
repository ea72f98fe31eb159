#include "server/objstore/s3_config.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace gpufeed::objstore {

absl::Status ValidateS3Config(const S3Config& config) {
  if (!config.endpoint.empty()) {
    const bool http = absl::StartsWith(config.endpoint, "http://");
    const bool https = absl::StartsWith(config.endpoint, "https://");
    if (!http && !https) {
      return absl::InvalidArgumentError(absl::StrCat(
          "s3.endpoint \"", config.endpoint, "\": want http://HOST[:PORT] or https://HOST[:PORT]"));
    }
    const absl::string_view rest =
        absl::string_view(config.endpoint).substr(http ? 7 : 8);
    const size_t slash = rest.find('/');
    // A path would have to be signed as part of every key's; no S3-compatible store needs one.
    if (rest.empty() || slash == 0 ||
        (slash != absl::string_view::npos && slash + 1 != rest.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "s3.endpoint \"", config.endpoint, "\": want a scheme, a host and a port, no path"));
    }
    for (const char c : rest) {
      if (absl::ascii_iscntrl(static_cast<unsigned char>(c)) || c == ' ' || c == '?' ||
          c == '#' || c == '@') {
        return absl::InvalidArgumentError(
            absl::StrCat("s3.endpoint \"", config.endpoint, "\": a byte no host may hold"));
      }
    }
  }
  // The region is part of the signing scope and of AWS's host name.
  if (config.region.empty() || config.region.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("s3.region \"", config.region, "\": want 1 to 64 characters"));
  }
  for (const char c : config.region) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          "s3.region \"", config.region, "\": want letters, digits and '-' (us-east-1)"));
    }
  }
  if (config.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("s3.connect_timeout: want a positive duration");
  }
  if (config.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("s3.request_timeout: want a positive duration");
  }
  if (config.max_connections < 1 || config.max_connections > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("s3.max_connections ", config.max_connections, ": want 1 to 1024"));
  }
  if (config.max_attempts < 1 || config.max_attempts > 20) {
    return absl::InvalidArgumentError(
        absl::StrCat("s3.max_attempts ", config.max_attempts, ": want 1 to 20"));
  }
  if (config.backoff_base < absl::ZeroDuration() || config.backoff_max < config.backoff_base) {
    return absl::InvalidArgumentError(
        "s3.backoff_base, s3.backoff_max: want 0 <= backoff_base <= backoff_max");
  }
  return absl::OkStatus();
}

std::string S3Credentials::DebugString() const {
  return absl::StrCat("S3Credentials{access_key_id=", access_key_id.empty() ? "(anonymous)" : access_key_id,
                      " secret_access_key=", secret_access_key.empty() ? "(none)" : "(redacted)",
                      " session_token=", session_token.empty() ? "(none)" : "(redacted)", "}");
}

}  // namespace gpufeed::objstore
