#include "server/objstore/s3_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/objstore/curl_pool.h"
#include "server/objstore/s3_uri.h"
#include "spdlog/spdlog.h"

namespace gpufeed::objstore {
namespace {

// SHA-256 of the empty payload: the x-amz-content-sha256 of every GET and HEAD.
constexpr char kEmptyPayloadSha256[] =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
// What of a body is kept as text: an error's XML, a listing page (1,000 keys of up to 1 KiB,
// each up to three times that URL-encoded), STS's answer.
constexpr size_t kMaxErrorBody = 64 << 10;
constexpr size_t kMaxListBody = 16 << 20;

// One HTTP exchange to make.
struct Request {
  const char* method = "GET";  // GET, HEAD or POST
  std::string url;
  std::vector<std::string> headers;
  const S3Credentials* credentials = nullptr;  // nullptr or anonymous: unsigned
  std::string post_body;
  // A 2xx body goes here (a ranged GET), else into Response::text.
  bool body_to_sink = false;
  std::span<std::byte> sink;
  uint64_t range_start = 0;  // the first byte a ranged GET asks for
  // A ranged GET's If-Match: a 2xx response of another ETag is refused before a byte lands.
  std::string expect_etag;
  size_t max_text = kMaxErrorBody;
};

// "bytes FIRST-LAST/TOTAL" (TOTAL may be "*"): FIRST and LAST, or nullopt.
std::optional<std::pair<uint64_t, uint64_t>> RangeOfContentRange(absl::string_view v) {
  if (!absl::ConsumePrefix(&v, "bytes ")) return std::nullopt;
  const size_t dash = v.find('-'), slash = v.find('/');
  if (dash == absl::string_view::npos || slash == absl::string_view::npos || slash < dash) {
    return std::nullopt;
  }
  uint64_t first = 0, last = 0;
  if (!absl::SimpleAtoi(v.substr(0, dash), &first) ||
      !absl::SimpleAtoi(v.substr(dash + 1, slash - dash - 1), &last) || last < first) {
    return std::nullopt;
  }
  return std::make_pair(first, last);
}

// What came back.
struct Response {
  CURLcode curl = CURLE_OK;
  std::string curl_detail;
  long status = 0;
  std::string text;
  size_t sink_bytes = 0;
  std::string abort_reason;  // set where our write callback stopped the transfer
  std::string etag;
  std::string content_range;
  curl_off_t content_length = -1;
  curl_off_t last_modified = -1;
};

// The write and header callbacks' view of a transfer.
struct Transfer {
  const Request* request;
  Response* response;
  CURL* handle;
  S3Counters* counters;
  bool status_known = false;
  bool to_sink = false;
};

size_t WriteBody(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  t->counters->bytes_received.fetch_add(n, std::memory_order_relaxed);
  Response& r = *t->response;
  if (!t->status_known) {
    curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &r.status);
    t->status_known = true;
    t->to_sink = t->request->body_to_sink && r.status / 100 == 2;
    // A store that ignores Range answers 200 with the whole object: right only from byte 0,
    // and then only if the object is exactly as long as asked (checked as it arrives).
    if (t->to_sink && r.status == 200 && t->request->range_start != 0) {
      r.abort_reason = absl::StrCat("the store ignored the Range header (200 for bytes from ",
                                    t->request->range_start, ")");
      return 0;
    }
    // Exactly the range and the version asked for: bytes of another request's response (a
    // connection out of step) or of another version must never land in the caller's buffer,
    // from where the node's cache would serve them to every reader.
    if (t->to_sink && r.status == 206) {
      const auto range = RangeOfContentRange(r.content_range);
      if (!range.has_value() || range->first != t->request->range_start ||
          range->second - range->first >= t->request->sink.size()) {
        r.abort_reason =
            absl::StrCat("a 206 for bytes '", EscapeForLog(r.content_range, 64), "', not from ",
                         t->request->range_start, " for at most ", t->request->sink.size());
        return 0;
      }
    }
    if (t->to_sink && !t->request->expect_etag.empty() && r.etag != t->request->expect_etag) {
      r.abort_reason = absl::StrCat("a response of ETag ", EscapeForLog(r.etag, 80),
                                    " to If-Match ", EscapeForLog(t->request->expect_etag, 80));
      return 0;
    }
  }
  if (t->to_sink) {
    if (n > t->request->sink.size() - r.sink_bytes) {
      r.abort_reason = absl::StrCat("the store sent more than the ", t->request->sink.size(),
                                    " bytes asked for");
      return 0;
    }
    std::memcpy(t->request->sink.data() + r.sink_bytes, data, n);
    r.sink_bytes += n;
    return n;
  }
  if (n > t->request->max_text - r.text.size()) {
    r.abort_reason = absl::StrCat("response body over ", t->request->max_text, " bytes");
    return 0;
  }
  r.text.append(data, n);
  return n;
}

size_t ReadHeader(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  const absl::string_view line(data, n);
  if (absl::StartsWith(line, "HTTP/")) {
    // A new response (after a 100 Continue): forget the headers of the last.
    t->response->etag.clear();
    t->response->content_range.clear();
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == absl::string_view::npos) return n;
  const absl::string_view name = line.substr(0, colon);
  const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
  if (absl::EqualsIgnoreCase(name, "etag")) {
    t->response->etag = std::string(value);
  } else if (absl::EqualsIgnoreCase(name, "content-range")) {
    t->response->content_range = std::string(value);
  }
  return n;
}

class HeaderList {
 public:
  explicit HeaderList(const std::vector<std::string>& headers) {
    for (const std::string& h : headers) {
      curl_slist* next = curl_slist_append(list_, h.c_str());
      if (next == nullptr) {
        ok_ = false;
        return;
      }
      list_ = next;
    }
  }
  ~HeaderList() { curl_slist_free_all(list_); }
  HeaderList(const HeaderList&) = delete;
  HeaderList& operator=(const HeaderList&) = delete;
  curl_slist* get() const { return list_; }
  bool ok() const { return ok_; }

 private:
  curl_slist* list_ = nullptr;
  bool ok_ = true;
};

long Millis(absl::Duration d) { return static_cast<long>(absl::ToInt64Milliseconds(d)); }

// One attempt of `request`. The status is not OK only where no request could be made.
absl::StatusOr<Response> Perform(CurlHandlePool& pool, const S3Config& config,
                                 const Request& request, S3Counters& counters) {
  GPUFEED_ASSIGN_OR_RETURN(CurlHandlePool::Lease lease, pool.Acquire());
  CURL* h = lease.get();
  std::vector<std::string> headers = request.headers;
  const bool signed_request = request.credentials != nullptr && !request.credentials->anonymous();
  if (signed_request) {
    headers.push_back(absl::StrCat("x-amz-content-sha256: ", kEmptyPayloadSha256));
    if (!request.credentials->session_token.empty()) {
      headers.push_back(
          absl::StrCat("x-amz-security-token: ", request.credentials->session_token));
    }
  }
  HeaderList header_list(headers);
  if (!header_list.ok()) return absl::ResourceExhaustedError("curl_slist_append: out of memory");

  Response response;
  Transfer transfer{&request, &response, h, &counters};
  char error_buffer[CURL_ERROR_SIZE] = {};
  curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
  // Threads of our own, no signal handlers: libcurl must not use SIGALRM for its timeouts.
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  // A key's "." and ".." segments are names, not directions: sent (and signed) as they are.
  curl_easy_setopt(h, CURLOPT_PATH_AS_IS, 1L);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, Millis(config.connect_timeout));
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, Millis(config.request_timeout));
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  // Bodies of megabytes: 512 KiB reads and write callbacks instead of curl's 16 KiB cut the
  // receive path's CPU (measured with tests/bench/s3_bench.py).
  curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 512L << 10);
  curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, config.verify_tls ? 1L : 0L);
  curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, config.verify_tls ? 2L : 0L);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &WriteBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &transfer);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &ReadHeader);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &transfer);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, header_list.get());
  if (std::strcmp(request.method, "HEAD") == 0) {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    curl_easy_setopt(h, CURLOPT_FILETIME, 1L);
  } else if (std::strcmp(request.method, "POST") == 0) {
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE,
                     static_cast<curl_off_t>(request.post_body.size()));
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, request.post_body.c_str());
  }
  std::string sigv4;
  if (signed_request) {
    sigv4 = absl::StrCat("aws:amz:", config.region, ":s3");
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, request.credentials->access_key_id.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, request.credentials->secret_access_key.c_str());
  }
  counters.requests.fetch_add(1, std::memory_order_relaxed);
  response.curl = curl_easy_perform(h);
  if (response.curl != CURLE_OK) {
    response.curl_detail = error_buffer[0] != '\0' ? std::string(error_buffer)
                                                   : curl_easy_strerror(response.curl);
  }
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &response.status);
  curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &response.content_length);
  curl_easy_getinfo(h, CURLINFO_FILETIME_T, &response.last_modified);
  // The handle goes back to the pool: nothing of this request may stay set on it.
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
  return response;
}

// Why an attempt failed, and whether another may succeed.
struct AttemptError {
  absl::StatusCode code;
  std::string detail;
  bool retryable;
  S3ErrorKind kind;
};

const char* ReasonPhrase(long status) {
  switch (status) {
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 412: return "Precondition Failed";
    case 416: return "Range Not Satisfiable";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "";
  }
}

AttemptError FromCurl(const Response& r) {
  std::string detail = absl::StrCat("curl error ", static_cast<int>(r.curl), " (", r.curl_detail, ")");
  switch (r.curl) {
    case CURLE_OPERATION_TIMEDOUT:
      return {absl::StatusCode::kDeadlineExceeded, std::move(detail), true, S3ErrorKind::kTimeout};
    case CURLE_PARTIAL_FILE:
      return {absl::StatusCode::kUnavailable,
              absl::StrCat("body ended early, ", std::move(detail)), true,
              S3ErrorKind::kTruncated};
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_WEIRD_SERVER_REPLY:
      return {absl::StatusCode::kUnavailable, std::move(detail), true, S3ErrorKind::kConnect};
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT:
      return {absl::StatusCode::kFailedPrecondition, std::move(detail), false,
              S3ErrorKind::kConnect};
    default:
      return {absl::StatusCode::kUnknown, std::move(detail), false, S3ErrorKind::kOther};
  }
}

AttemptError FromHttp(const Response& r) {
  const S3ErrorBody body = ParseS3Error(r.text);
  std::string detail = absl::StrCat(r.status);
  if (!body.code.empty()) {
    absl::StrAppend(&detail, " ", body.code);
    if (!body.message.empty()) absl::StrAppend(&detail, " (", body.message, ")");
  } else if (*ReasonPhrase(r.status) != '\0') {
    absl::StrAppend(&detail, " ", ReasonPhrase(r.status));
  }
  const long s = r.status;
  if (s == 429 || s == 503) {
    return {absl::StatusCode::kUnavailable, std::move(detail), true, S3ErrorKind::kThrottled};
  }
  if (s >= 500) {
    return {absl::StatusCode::kUnavailable, std::move(detail), true, S3ErrorKind::kServer};
  }
  switch (s) {
    case 400:
      // S3's "your connection was idle too long": the request itself was fine.
      if (body.code == "RequestTimeout") {
        return {absl::StatusCode::kUnavailable, std::move(detail), true, S3ErrorKind::kTimeout};
      }
      return {absl::StatusCode::kInvalidArgument, std::move(detail), false, S3ErrorKind::kClient};
    case 401:
      return {absl::StatusCode::kUnauthenticated, std::move(detail), false, S3ErrorKind::kClient};
    case 403:
      return {absl::StatusCode::kPermissionDenied, std::move(detail), false, S3ErrorKind::kClient};
    case 404:
      return {absl::StatusCode::kNotFound, std::move(detail), false, S3ErrorKind::kClient};
    case 412:
      return {absl::StatusCode::kFailedPrecondition, std::move(detail), false,
              S3ErrorKind::kClient};
    case 416:
      return {absl::StatusCode::kOutOfRange, std::move(detail), false, S3ErrorKind::kClient};
    default:
      break;
  }
  // A redirect: the bucket is in another region or behind another endpoint (S3's
  // PermanentRedirect names it in the message).
  if (s >= 300 && s < 400) {
    return {absl::StatusCode::kFailedPrecondition, std::move(detail), false, S3ErrorKind::kOther};
  }
  return {absl::StatusCode::kUnknown, std::move(detail), false,
          s >= 400 ? S3ErrorKind::kClient : S3ErrorKind::kOther};
}

// nullopt for a complete 2xx exchange.
std::optional<AttemptError> Classify(const Response& r) {
  if (!r.abort_reason.empty()) {
    return AttemptError{absl::StatusCode::kInternal, r.abort_reason, false, S3ErrorKind::kOther};
  }
  if (r.curl != CURLE_OK) return FromCurl(r);
  if (r.status / 100 != 2) return FromHttp(r);
  return std::nullopt;
}

// Attempt n's wait before it (n from 2): full jitter over an exponential bound.
absl::Duration Backoff(const S3Config& config, int attempt) {
  thread_local std::mt19937_64 random{std::random_device{}()};
  absl::Duration bound = config.backoff_base;
  for (int i = 2; i < attempt && bound < config.backoff_max; ++i) bound *= 2;
  bound = std::min(bound, config.backoff_max);
  std::uniform_int_distribution<int64_t> pick(0, absl::ToInt64Microseconds(bound));
  return absl::Microseconds(pick(random));
}

absl::Status CheckBucket(absl::string_view bucket) {
  // S3's rules are narrower (3 to 63 of a-z 0-9 . -); S3-compatible stores admit more, but
  // never a byte that would change the URL's meaning.
  if (bucket.empty() || bucket.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket \"", EscapeForLog(bucket, 64), "\": want 1 to 255 characters"));
  }
  for (const char c : bucket) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' &&
        c != '_') {
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket \"", EscapeForLog(bucket), "\": want letters, digits, '.', '-' and '_'"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckObject(absl::string_view bucket, absl::string_view key) {
  GPUFEED_RETURN_IF_ERROR(CheckBucket(bucket));
  if (key.empty() || key.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(S3Url(bucket, key), ": want a key of 1 to 1024 bytes"));
  }
  return absl::OkStatus();
}

// "bytes 0-99/1234": the object's total size, or nullopt.
std::optional<uint64_t> TotalOfContentRange(absl::string_view content_range) {
  const size_t slash = content_range.rfind('/');
  uint64_t total = 0;
  if (slash == absl::string_view::npos ||
      !absl::SimpleAtoi(content_range.substr(slash + 1), &total)) {
    return std::nullopt;
  }
  return total;
}

std::string Attempts(int n) { return absl::StrCat(n, n == 1 ? " attempt" : " attempts"); }

// The URLs of one config. Path-style where there is an endpoint (or a dotted bucket on AWS).
class S3Urls {
 public:
  explicit S3Urls(const S3Config& config) : config_(config) {}

  std::string Bucket(absl::string_view bucket) const {
    if (PathStyle(bucket)) return absl::StrCat(Base(), "/", UriEncode(bucket, false));
    return absl::StrCat("https://", bucket, ".s3.", config_.region, ".amazonaws.com");
  }
  std::string Object(absl::string_view bucket, absl::string_view key) const {
    return absl::StrCat(Bucket(bucket), "/", UriEncode(key, true));
  }

 private:
  bool PathStyle(absl::string_view bucket) const {
    return !config_.endpoint.empty() || config_.path_style || absl::StrContains(bucket, '.');
  }
  std::string Base() const {
    if (config_.endpoint.empty()) return absl::StrCat("https://s3.", config_.region, ".amazonaws.com");
    return std::string(absl::StripSuffix(config_.endpoint, "/"));
  }
  const S3Config& config_;
};

// Runs `attempt` (int n -> std::optional<AttemptError>, nullopt on success) until it succeeds,
// fails for good, or max_attempts are spent; names `what` in the final error.
template <typename AttemptFn>
absl::Status WithRetries(const S3Config& config, S3Counters& counters, const std::string& what,
                         AttemptFn attempt) {
  for (int n = 1;; ++n) {
    if (n > 1) {
      counters.retries.fetch_add(1, std::memory_order_relaxed);
      absl::SleepFor(Backoff(config, n));
    }
    absl::StatusOr<std::optional<AttemptError>> outcome = attempt(n);
    if (!outcome.ok()) {
      counters.failed_calls.fetch_add(1, std::memory_order_relaxed);
      return Annotate(outcome.status(), what);
    }
    if (!outcome->has_value()) return absl::OkStatus();
    AttemptError& error = **outcome;
    counters.errors(error.kind).fetch_add(1, std::memory_order_relaxed);
    if (!error.retryable || n >= config.max_attempts) {
      counters.failed_calls.fetch_add(1, std::memory_order_relaxed);
      return absl::Status(error.code,
                          absl::StrCat(what, ": ", error.detail, " after ", Attempts(n)));
    }
    spdlog::debug("{}: attempt {} of {} failed: {}; retrying", what, n, config.max_attempts,
                  error.detail);
  }
}

// One attempt of a request whose 2xx body is a document `parse` reads into *out. A body that
// does not parse is not retried: the store answered, and would answer the same.
template <typename T>
absl::StatusOr<std::optional<AttemptError>> PerformAndParse(
    CurlHandlePool& pool, const S3Config& config, const Request& request, S3Counters& counters,
    absl::StatusOr<T> (*parse)(absl::string_view), T* out) {
  GPUFEED_ASSIGN_OR_RETURN(Response response, Perform(pool, config, request, counters));
  std::optional<AttemptError> error = Classify(response);
  if (error.has_value()) return error;
  absl::StatusOr<T> parsed = parse(response.text);
  if (!parsed.ok()) {
    return AttemptError{parsed.status().code(), std::string(parsed.status().message()), false,
                        S3ErrorKind::kOther};
  }
  *out = *std::move(parsed);
  return std::optional<AttemptError>();
}

}  // namespace

absl::StatusOr<std::unique_ptr<S3Client>> S3Client::Create(S3Config config) {
  GPUFEED_RETURN_IF_ERROR(ValidateS3Config(config));
  GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<CurlHandlePool> pool,
                           CurlHandlePool::Create(config.max_connections));
  return std::unique_ptr<S3Client>(new S3Client(std::move(config), std::move(pool)));
}

S3Client::S3Client(S3Config config, std::unique_ptr<CurlHandlePool> pool)
    : config_(std::move(config)), pool_(std::move(pool)) {}

S3Client::~S3Client() = default;

absl::StatusOr<S3ObjectInfo> S3Client::Head(const S3Credentials& credentials,
                                            absl::string_view bucket, absl::string_view key) {
  GPUFEED_RETURN_IF_ERROR(CheckObject(bucket, key));
  Request request;
  request.method = "HEAD";
  request.url = S3Urls(config_).Object(bucket, key);
  request.credentials = &credentials;
  S3ObjectInfo info;
  GPUFEED_RETURN_IF_ERROR(WithRetries(
      config_, counters_, S3Url(bucket, key),
      [&](int) -> absl::StatusOr<std::optional<AttemptError>> {
        GPUFEED_ASSIGN_OR_RETURN(Response response,
                                 Perform(*pool_, config_, request, counters_));
        std::optional<AttemptError> error = Classify(response);
        if (error.has_value()) return error;
        if (response.content_length < 0) {
          return AttemptError{absl::StatusCode::kInternal, "HEAD without a Content-Length",
                              false, S3ErrorKind::kOther};
        }
        info.size = static_cast<uint64_t>(response.content_length);
        info.etag = std::move(response.etag);
        if (response.last_modified >= 0) {
          info.last_modified = absl::FromTimeT(static_cast<time_t>(response.last_modified));
        }
        return std::nullopt;
      }));
  return info;
}

absl::Status S3Client::GetRange(const S3Credentials& credentials, absl::string_view bucket,
                                absl::string_view key, uint64_t offset,
                                std::span<std::byte> out, const std::string& if_match_etag) {
  GPUFEED_RETURN_IF_ERROR(CheckObject(bucket, key));
  const uint64_t length = out.size();
  if (length == 0) return absl::OkStatus();
  if (offset > UINT64_MAX - length) {
    return absl::InvalidArgumentError(absl::StrCat(S3Url(bucket, key), ": range at ", offset,
                                                   " of ", length, " bytes overflows"));
  }
  const std::string url = S3Urls(config_).Object(bucket, key);
  // The ETag every attempt after the first insists on: the caller's, or else the first
  // response's, so that a resumed read never joins two versions of the object.
  std::string etag = if_match_etag;
  uint64_t received = 0;
  return WithRetries(
      config_, counters_, S3Url(bucket, key),
      [&](int) -> absl::StatusOr<std::optional<AttemptError>> {
        Request request;
        request.url = url;
        request.credentials = &credentials;
        request.range_start = offset + received;
        request.headers.push_back(
            absl::StrCat("Range: bytes=", offset + received, "-", offset + length - 1));
        if (!etag.empty()) request.headers.push_back(absl::StrCat("If-Match: ", etag));
        request.expect_etag = etag;
        request.body_to_sink = true;
        request.sink = out.subspan(received);
        const auto start = std::chrono::steady_clock::now();
        GPUFEED_ASSIGN_OR_RETURN(Response response,
                                 Perform(*pool_, config_, request, counters_));
        if (response.status / 100 == 2) {
          if (etag.empty()) etag = response.etag;
          received += response.sink_bytes;
        }
        std::optional<AttemptError> error = Classify(response);
        if (error.has_value()) {
          if (response.status == 412) {
            error->detail = if_match_etag.empty()
                                ? absl::StrCat("changed while it was read (first as ETag ", etag,
                                               "): ", error->detail)
                                : absl::StrCat("no longer ETag ", etag, ": ", error->detail);
          }
          return error;
        }
        if (received < length) {
          const std::optional<uint64_t> total = TotalOfContentRange(response.content_range);
          if (total.has_value() && *total < offset + length) {
            return AttemptError{absl::StatusCode::kOutOfRange,
                                absl::StrCat("bytes [", offset, ", ", offset + length,
                                             ") run past the object's end at ", *total),
                                false, S3ErrorKind::kClient};
          }
          return AttemptError{absl::StatusCode::kUnavailable,
                              absl::StrCat("body ended early: ", received, " of ", length,
                                           " bytes"),
                              true, S3ErrorKind::kTruncated};
        }
        counters_.get_latency.Observe(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        return std::nullopt;
      });
}

absl::StatusOr<std::vector<S3ListEntry>> S3Client::List(const S3Credentials& credentials,
                                                        absl::string_view bucket,
                                                        absl::string_view prefix,
                                                        const S3ListOptions& options) {
  GPUFEED_RETURN_IF_ERROR(CheckBucket(bucket));
  if (options.page_size < 1 || options.page_size > 1000) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size ", options.page_size, ": want 1 to 1000"));
  }
  const std::string bucket_url = S3Urls(config_).Bucket(bucket);
  const std::string what = absl::StrCat(S3Url(bucket, prefix), " (listing)");
  std::vector<S3ListEntry> entries;
  std::string token;
  const size_t max_pages =
      options.max_keys == 0 ? SIZE_MAX : options.max_keys / options.page_size + 2;
  for (size_t pages = 0;; ++pages) {
    if (pages >= max_pages) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": more than ", max_pages, " pages of keys and common prefixes"));
    }
    if (options.poll) GPUFEED_RETURN_IF_ERROR(options.poll());
    std::vector<std::pair<std::string, std::string>> query = {
        {"list-type", "2"},
        {"prefix", std::string(prefix)},
        {"max-keys", absl::StrCat(options.page_size)},
        // Keys in the page URL-encoded: XML 1.0 cannot carry every byte a key may hold.
        {"encoding-type", "url"}};
    if (!token.empty()) query.emplace_back("continuation-token", token);
    if (!options.delimiter.empty()) query.emplace_back("delimiter", options.delimiter);
    Request request;
    request.url = absl::StrCat(bucket_url, "/?", CanonicalQuery(std::move(query)));
    request.credentials = &credentials;
    request.max_text = kMaxListBody;
    S3ListPage page;
    GPUFEED_RETURN_IF_ERROR(WithRetries(
        config_, counters_, what,
        [&](int) {
          return PerformAndParse(*pool_, config_, request, counters_, &ParseListObjectsV2, &page);
        }));
    for (S3ListEntry& entry : page.entries) entries.push_back(std::move(entry));
    if (options.max_keys != 0 && entries.size() > options.max_keys) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": more than ", options.max_keys, " objects"));
    }
    if (!page.truncated) return entries;
    // A store that hands back the token it was given would page forever.
    if (page.next_continuation_token == token) {
      return absl::InternalError(absl::StrCat(what, ": the store repeated continuation token \"",
                                              EscapeForLog(token, 64), "\""));
    }
    token = std::move(page.next_continuation_token);
  }
}

absl::StatusOr<StsCredentials> S3Client::AssumeRoleWithWebIdentity(
    absl::string_view sts_endpoint, absl::string_view role_arn,
    absl::string_view web_identity_token, absl::string_view session_name,
    absl::Duration duration) {
  if (!absl::StartsWith(sts_endpoint, "https://") && !absl::StartsWith(sts_endpoint, "http://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sts endpoint \"", EscapeForLog(sts_endpoint), "\": want http:// or https://"));
  }
  if (role_arn.empty() || web_identity_token.empty() || session_name.empty()) {
    return absl::InvalidArgumentError(
        "AssumeRoleWithWebIdentity: want a role ARN, a web-identity token and a session name");
  }
  // STS's own bounds: 15 minutes to 12 hours.
  const int64_t seconds = absl::ToInt64Seconds(duration);
  if (seconds < 900 || seconds > 43200) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AssumeRoleWithWebIdentity duration ", seconds, " s: want 900 to 43200"));
  }
  Request request;
  request.method = "POST";
  request.url = absl::StrCat(absl::StripSuffix(sts_endpoint, "/"), "/");
  request.headers.push_back("Content-Type: application/x-www-form-urlencoded");
  // The token is the credential here: the request is unsigned, as STS wants it.
  request.post_body = CanonicalQuery({{"Action", "AssumeRoleWithWebIdentity"},
                                      {"Version", "2011-06-15"},
                                      {"RoleArn", std::string(role_arn)},
                                      {"RoleSessionName", std::string(session_name)},
                                      {"WebIdentityToken", std::string(web_identity_token)},
                                      {"DurationSeconds", absl::StrCat(seconds)}});
  StsCredentials credentials;
  GPUFEED_RETURN_IF_ERROR(WithRetries(
      config_, counters_, absl::StrCat("AssumeRoleWithWebIdentity of ", EscapeForLog(role_arn)),
      [&](int) {
        return PerformAndParse(*pool_, config_, request, counters_, &ParseStsCredentials,
                               &credentials);
      }));
  return credentials;
}

}  // namespace gpufeed::objstore
