// URLs of S3 requests, written in their SigV4 canonical form. libcurl signs the path and the
// query exactly as they stand in the URL it is given (7.88 neither encodes nor sorts them;
// later versions sort the query and leave a canonical one as it is), while the store signs
// the canonical form of what it receives: so each URL is built canonical from the start —
// every byte but A-Z a-z 0-9 - . _ ~ percent-encoded with upper-case hex (a key's "/" kept),
// query parameters sorted by name, each with its "=".
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gpufeed::objstore {

// SigV4's UriEncode: unreserved bytes as they are, "/" as it is when keep_slash (an object
// key in a path), every other byte as %XX.
std::string UriEncode(absl::string_view text, bool keep_slash);

// The inverse of the URL encoding of a ListObjectsV2 page (encoding-type=url): %XX to its
// byte and "+" to a space (S3 writes a space as "+", a "+" as %2B). INVALID_ARGUMENT for a
// "%" not followed by two hex digits.
absl::StatusOr<std::string> UrlDecode(absl::string_view text);

// A canonical query string: the parameters sorted by name, names and values UriEncoded,
// "name=value" joined by "&".
std::string CanonicalQuery(std::vector<std::pair<std::string, std::string>> parameters);

// "s3://bucket/key": how errors and logs name an object, with bytes a log line must not carry
// escaped (common/logging.h, EscapeForLog).
std::string S3Url(absl::string_view bucket, absl::string_view key);

}  // namespace gpufeed::objstore
