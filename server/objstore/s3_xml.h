// The few XML documents an S3 client reads: an error body, a ListObjectsV2 page and STS's
// credentials. S3 writes flat, namespace-free, attribute-free elements whose text is escaped
// with the five predefined entities and character references (a key holding "&" arrives as
// "&amp;", an ETag's quotes often as "&quot;", a control character as "&#13;"), so a scanner
// for <Name>text</Name> plus entity decoding reads them exactly; no XML library needed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gpufeed::objstore {

// Text with its entity and character references replaced (&amp; &lt; &gt; &quot; &apos;
// &#N; &#xH;, the latter as UTF-8). INVALID_ARGUMENT for an unknown or unterminated
// reference or a code point outside Unicode.
absl::StatusOr<std::string> DecodeXmlText(absl::string_view text);

// The raw (undecoded) contents of each <name>...</name> element in `xml`, in order, at any
// depth; an empty element (<name/>) gives "". Elements of one name do not nest in S3's
// documents, so the first closing tag ends each.
std::vector<absl::string_view> XmlElements(absl::string_view xml, absl::string_view name);

// The decoded text of the first <name> element, or nullopt where there is none.
absl::StatusOr<std::optional<std::string>> XmlFirstText(absl::string_view xml,
                                                        absl::string_view name);

// S3's <Error><Code>NoSuchKey</Code><Message>...</Message></Error>; both empty where the
// body is not such a document (a HEAD has no body, a proxy may answer in HTML).
struct S3ErrorBody {
  std::string code;
  std::string message;
};
S3ErrorBody ParseS3Error(absl::string_view body);

struct S3ListEntry {
  std::string key;
  uint64_t size = 0;
  std::string etag;  // as the store writes it, quotes included
};
struct S3ListPage {
  std::vector<S3ListEntry> entries;
  bool truncated = false;
  std::string next_continuation_token;  // when truncated
};
// A ListObjectsV2 response. Keys are URL-decoded when the store says it URL-encoded them
// (<EncodingType>url</EncodingType>, which we ask for: XML 1.0 cannot carry every byte a key
// may hold). INTERNAL, naming the element, for a page that is not one.
absl::StatusOr<S3ListPage> ParseListObjectsV2(absl::string_view xml);

struct StsCredentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  std::string expiration;  // ISO 8601, as STS writes it
};
// An AssumeRoleWithWebIdentity response's <Credentials>.
absl::StatusOr<StsCredentials> ParseStsCredentials(absl::string_view xml);

}  // namespace gpufeed::objstore
