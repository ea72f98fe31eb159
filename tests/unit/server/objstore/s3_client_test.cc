// S3Client against a real S3 server on loopback (moto, signatures checked), directly and
// through a fault-injecting proxy (s3_test_server.h). Skips, saying why, where moto is missing.
#include "server/objstore/s3_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/server/objstore/s3_test_server.h"

namespace gpufeed::objstore {
namespace {

S3ListOptions ListOptions(int page_size, const std::string& delimiter, size_t max_keys) {
  S3ListOptions o;
  o.page_size = page_size;
  o.delimiter = delimiter;
  o.max_keys = max_keys;
  return o;
}

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kBucket[] = "data";

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(random());
  return out;
}

std::string AsString(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// Fast retries: the tests count attempts, they need not wait out real backoff.
S3Config TestConfig(const std::string& endpoint) {
  S3Config config;
  config.endpoint = endpoint;
  config.connect_timeout = absl::Seconds(2);
  config.request_timeout = absl::Seconds(20);
  config.backoff_base = absl::Milliseconds(1);
  config.backoff_max = absl::Milliseconds(20);
  config.max_connections = 4;
  return config;
}

std::unique_ptr<S3Client> MakeClient(const S3Config& config) {
  absl::StatusOr<std::unique_ptr<S3Client>> client = S3Client::Create(config);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

class S3ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::MotoUnavailable();
    if (!why.empty()) GTEST_SKIP() << "no S3 server to test against: " << why;
    absl::StatusOr<std::unique_ptr<testing::MotoServer>> moto = testing::MotoServer::Start();
    ASSERT_TRUE(moto.ok()) << moto.status();
    moto_ = *std::move(moto);
    ASSERT_TRUE(moto_->CreateBucket(kBucket).ok());
    credentials_ = {moto_->access_key(), moto_->secret(), ""};
  }

  // A client talking to moto through a proxy that injects `faults`.
  std::unique_ptr<S3Client> ClientThroughProxy(const testing::FaultSpec& faults, S3Config config) {
    absl::StatusOr<std::unique_ptr<testing::FaultProxy>> proxy =
        testing::FaultProxy::Start(moto_->port(), faults);
    EXPECT_TRUE(proxy.ok()) << proxy.status();
    if (!proxy.ok()) return nullptr;
    proxy_ = *std::move(proxy);
    config.endpoint = proxy_->endpoint();
    return MakeClient(config);
  }

  std::unique_ptr<testing::MotoServer> moto_;
  std::unique_ptr<testing::FaultProxy> proxy_;
  S3Credentials credentials_;
};

TEST_F(S3ClientTest, HeadAndRangesReturnTheObjectExactly) {
  const std::string object = RandomBytes(300'000, 1);
  ASSERT_TRUE(moto_->Put(kBucket, "shards/train-000.tar", object).ok());
  auto client = MakeClient(TestConfig(moto_->endpoint()));

  absl::StatusOr<S3ObjectInfo> info = client->Head(credentials_, kBucket, "shards/train-000.tar");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->size, object.size());
  EXPECT_THAT(info->etag, ::testing::StartsWith("\""));
  EXPECT_LT(absl::AbsDuration(info->last_modified - absl::Now()), absl::Minutes(5));

  for (const auto& [offset, length] : std::vector<std::pair<uint64_t, size_t>>{
           {0, 1}, {0, object.size()}, {12'345, 100'000}, {object.size() - 1, 1}}) {
    std::vector<std::byte> out(length);
    absl::Status s = client->GetRange(credentials_, kBucket, "shards/train-000.tar", offset,
                                      std::span(out), info->etag);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(AsString(out), object.substr(offset, length)) << offset << "+" << length;
  }
  const S3Counters& counters = client->counters();
  EXPECT_EQ(counters.requests.load(), 5u);
  EXPECT_EQ(counters.retries.load(), 0u);
  EXPECT_GE(counters.bytes_received.load(), 1u + object.size() + 100'000 + 1);
  uint64_t observed = 0;
  for (uint64_t n : counters.get_latency.Counts()) observed += n;
  EXPECT_EQ(observed, 4u);
}

TEST_F(S3ClientTest, AMissingKeyFailsAtOnceNamingIt) {
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  std::vector<std::byte> out(10);
  absl::Status s = client->GetRange(credentials_, kBucket, "no/such.tar", 0, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://data/no/such.tar"), HasSubstr("404 NoSuchKey"),
                                 HasSubstr("after 1 attempt")));
  absl::StatusOr<S3ObjectInfo> head = client->Head(credentials_, kBucket, "no/such.tar");
  EXPECT_EQ(head.status().code(), absl::StatusCode::kNotFound) << head.status();
  EXPECT_THAT(head.status().message(), AllOf(HasSubstr("s3://data/no/such.tar"), HasSubstr("404")));
  absl::StatusOr<std::vector<S3ListEntry>> list = client->List(credentials_, "nobucket", "");
  EXPECT_EQ(list.status().code(), absl::StatusCode::kNotFound) << list.status();
  EXPECT_THAT(list.status().message(), HasSubstr("NoSuchBucket"));
  EXPECT_EQ(client->counters().requests.load(), 3u);
  EXPECT_EQ(client->counters().retries.load(), 0u);
  EXPECT_EQ(client->counters().errors(S3ErrorKind::kClient), 3u);
}

TEST_F(S3ClientTest, AWrongSecretOrKeyIsPermissionDenied) {
  ASSERT_TRUE(moto_->Put(kBucket, "k", "bytes").ok());
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  std::vector<std::byte> out(5);
  // The right key signed with the right secret works ...
  ASSERT_TRUE(client->GetRange(credentials_, kBucket, "k", 0, std::span(out)).ok());
  // ... a wrong secret does not, and is not retried.
  S3Credentials wrong = credentials_;
  wrong.secret_access_key = "not-the-secret";
  absl::Status s = client->GetRange(wrong, kBucket, "k", 0, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://data/k"), HasSubstr("403 SignatureDoesNotMatch"),
                                 HasSubstr("after 1 attempt")));
  EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("not-the-secret")));
  absl::StatusOr<std::vector<S3ListEntry>> list = client->List(wrong, kBucket, "");
  EXPECT_EQ(list.status().code(), absl::StatusCode::kPermissionDenied) << list.status();
  // An unknown key id.
  S3Credentials unknown{"AKIAUNKNOWNKEY000000", credentials_.secret_access_key, ""};
  s = client->GetRange(unknown, kBucket, "k", 0, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(client->counters().retries.load(), 0u);
}

TEST_F(S3ClientTest, AChangedObjectIsAFailedPrecondition) {
  ASSERT_TRUE(moto_->Put(kBucket, "shard.bin", RandomBytes(1000, 1)).ok());
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  absl::StatusOr<S3ObjectInfo> before = client->Head(credentials_, kBucket, "shard.bin");
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE(moto_->Put(kBucket, "shard.bin", RandomBytes(1000, 2)).ok());
  std::vector<std::byte> out(100);
  absl::Status s =
      client->GetRange(credentials_, kBucket, "shard.bin", 0, std::span(out), before->etag);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://data/shard.bin"),
                                 HasSubstr("no longer ETag " + before->etag), HasSubstr("412")));
  EXPECT_EQ(client->counters().retries.load(), 0u);
}

TEST_F(S3ClientTest, ARangePastTheEndIsOutOfRange) {
  ASSERT_TRUE(moto_->Put(kBucket, "small", std::string(100, 'x')).ok());
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  std::vector<std::byte> out(20);
  absl::Status s = client->GetRange(credentials_, kBucket, "small", 90, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://data/small"), HasSubstr("[90, 110)")));
  s = client->GetRange(credentials_, kBucket, "small", 200, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_EQ(client->counters().retries.load(), 0u);
}

TEST_F(S3ClientTest, KeysWithSpecialCharactersRoundTrip) {
  // Each needs its own encoding to be signed right: a space, "+", "=", "&" (an XML entity in
  // a listing), "%", "~", "#" and "?" (URL syntax), non-ASCII, a control character.
  const std::vector<std::string> keys = {"special/with space.tar",
                                         "special/plus+sign",
                                         "special/eq=ual&amp",
                                         "special/100%.bin",
                                         "special/tilde~x",
                                         "special/hash#q?x=1",
                                         "special/caf\xC3\xA9/\xE6\x97\xA5\xE6\x9C\xAC",
                                         "special/lt<gt>\"quote'",
                                         "special/tab\there",
                                         "special/a//double/./dot"};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(moto_->Put(kBucket, keys[i], "object " + std::to_string(i)).ok()) << keys[i];
  }
  ASSERT_TRUE(moto_->Put(kBucket, "specialist", "not under special/").ok());
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string want = "object " + std::to_string(i);
    absl::StatusOr<S3ObjectInfo> info = client->Head(credentials_, kBucket, keys[i]);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->size, want.size()) << keys[i];
    std::vector<std::byte> out(want.size());
    absl::Status s = client->GetRange(credentials_, kBucket, keys[i], 0, std::span(out));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(AsString(out), want) << keys[i];
  }
  absl::StatusOr<std::vector<S3ListEntry>> list = client->List(credentials_, kBucket, "special/");
  ASSERT_TRUE(list.ok()) << list.status();
  std::vector<std::string> listed;
  for (const S3ListEntry& e : *list) listed.push_back(e.key);
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(listed, sorted);
}

TEST_F(S3ClientTest, ListPagesThroughContinuationTokens) {
  // Pages of a few keys (max-keys) rather than S3's 1,000: moto stores ~150 objects a second,
  // and paging is the same at any size.
  std::vector<std::pair<std::string, std::string>> objects;
  for (int i = 0; i < 40; ++i) {
    objects.emplace_back(absl::StrCat("many/", 100 + i, ".bin"), std::string(i % 7, 'a'));
  }
  ASSERT_TRUE(moto_->PutMany(kBucket, objects).ok());
  ASSERT_TRUE(moto_->Put(kBucket, "other/x", "x").ok());
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  absl::StatusOr<std::vector<S3ListEntry>> one_page = client->List(credentials_, kBucket, "many/");
  ASSERT_TRUE(one_page.ok()) << one_page.status();
  EXPECT_EQ(client->counters().requests.load(), 1u);
  absl::StatusOr<std::vector<S3ListEntry>> paged =
      client->List(credentials_, kBucket, "many/", ListOptions(7, "", 0));
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ(client->counters().requests.load(), 1u + 6u);
  for (const auto* list : {&*one_page, &*paged}) {
    ASSERT_EQ(list->size(), objects.size());
    for (size_t i = 0; i < objects.size(); ++i) {
      EXPECT_EQ((*list)[i].key, objects[i].first);
      EXPECT_EQ((*list)[i].size, objects[i].second.size());
      EXPECT_THAT((*list)[i].etag, ::testing::StartsWith("\""));
    }
  }
  // A prefix that is no folder, a page size that divides the count.
  absl::StatusOr<std::vector<S3ListEntry>> tens =
      client->List(credentials_, kBucket, "many/11", ListOptions(5, "", 0));
  ASSERT_TRUE(tens.ok()) << tens.status();
  ASSERT_EQ(tens->size(), 10u);
  EXPECT_EQ(tens->front().key, "many/110.bin");
  EXPECT_EQ(tens->back().key, "many/119.bin");
  // The ETag of a listing is the ETag of a HEAD.
  absl::StatusOr<S3ObjectInfo> head = client->Head(credentials_, kBucket, (*paged)[3].key);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->etag, (*paged)[3].etag);
  // A delimiter keeps only a directory's own entries; a bound refuses a larger listing.
  ASSERT_TRUE(moto_->Put(kBucket, "many/deeper/y.bin", "y").ok());
  absl::StatusOr<std::vector<S3ListEntry>> direct =
      client->List(credentials_, kBucket, "many/", ListOptions(1000, "/", 0));
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(direct->size(), objects.size());
  absl::StatusOr<std::vector<S3ListEntry>> bounded =
      client->List(credentials_, kBucket, "many/", ListOptions(7, "/", 20));
  EXPECT_EQ(bounded.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(bounded.status().message(), ::testing::HasSubstr("more than 20 objects"));
}

TEST_F(S3ClientTest, InjectedFaultsAreRetriedToExactBytes) {
  const std::string object = RandomBytes(1 << 20, 3);
  ASSERT_TRUE(moto_->Put(kBucket, "faulty/shard.tar", object).ok());
  S3Config config = TestConfig("");
  config.max_attempts = 8;  // 20 % faults: 8 in a row fail once in 390,000 reads
  auto client = ClientThroughProxy({.seed = 7, .error_rate = 0.12, .truncate_rate = 0.08}, config);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<S3ObjectInfo> info = client->Head(credentials_, kBucket, "faulty/shard.tar");
  ASSERT_TRUE(info.ok()) << info.status();
  // 4 threads x 15 reads of random ranges, over at most 4 connections.
  std::vector<std::thread> threads;
  std::atomic<int> exact{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(t);
      for (int i = 0; i < 15; ++i) {
        const size_t length = 1 + random() % 200'000;
        const size_t offset = random() % (object.size() - length + 1);
        std::vector<std::byte> out(length);
        absl::Status s = client->GetRange(credentials_, kBucket, "faulty/shard.tar", offset,
                                          std::span(out), info->etag);
        EXPECT_TRUE(s.ok()) << s;
        if (s.ok() && AsString(out) == object.substr(offset, length)) ++exact;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(exact.load(), 60);
  const S3Counters& counters = client->counters();
  EXPECT_GT(counters.retries.load(), 0u);
  EXPECT_GT(counters.errors(S3ErrorKind::kThrottled) + counters.errors(S3ErrorKind::kServer), 0u);
  EXPECT_GT(counters.errors(S3ErrorKind::kTruncated), 0u);
  EXPECT_EQ(counters.failed_calls.load(), 0u);
}

TEST_F(S3ClientTest, OnlyFaultsFailWithinTheRetryBoundNamingTheObject) {
  ASSERT_TRUE(moto_->Put(kBucket, "doomed.tar", "bytes").ok());
  S3Config config = TestConfig("");
  config.max_attempts = 4;
  auto client = ClientThroughProxy({.seed = 1, .error_rate = 1.0}, config);
  ASSERT_NE(client, nullptr);
  std::vector<std::byte> out(5);
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = client->GetRange(credentials_, kBucket, "doomed.tar", 0, std::span(out));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://data/doomed.tar"), HasSubstr("after 4 attempts")));
  EXPECT_THAT(s.message(),
              ::testing::AnyOf(HasSubstr("503 SlowDown"), HasSubstr("500 InternalError")));
  EXPECT_EQ(client->counters().requests.load(), 4u);
  EXPECT_EQ(client->counters().retries.load(), 3u);
  EXPECT_EQ(client->counters().failed_calls.load(), 1u);
}

TEST_F(S3ClientTest, ATruncatedBodyResumesWhereItStopped) {
  const std::string object = RandomBytes(100'000, 4);
  ASSERT_TRUE(moto_->Put(kBucket, "cut.bin", object).ok());
  // Every body cut in half (but a one-byte body, which cannot be): each attempt gets half of
  // what is left, so 18 attempts read all 100,000 bytes. They suffice only because each
  // resumes where the last stopped; starting over would never finish.
  S3Config config = TestConfig("");
  config.max_attempts = 20;
  auto client = ClientThroughProxy({.seed = 1, .truncate_rate = 1.0}, config);
  ASSERT_NE(client, nullptr);
  std::vector<std::byte> out(object.size());
  absl::Status s = client->GetRange(credentials_, kBucket, "cut.bin", 0, std::span(out));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(AsString(out), object);
  EXPECT_GT(client->counters().errors(S3ErrorKind::kTruncated), 10u);
}

TEST_F(S3ClientTest, ASlowStoreTimesOut) {
  ASSERT_TRUE(moto_->Put(kBucket, "slow", "bytes").ok());
  S3Config config = TestConfig("");
  config.request_timeout = absl::Milliseconds(200);
  config.max_attempts = 2;
  auto client = ClientThroughProxy({.latency_ms = 1000}, config);
  ASSERT_NE(client, nullptr);
  std::vector<std::byte> out(5);
  absl::Status s = client->GetRange(credentials_, kBucket, "slow", 0, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://data/slow"), HasSubstr("after 2 attempts")));
  EXPECT_EQ(client->counters().errors(S3ErrorKind::kTimeout), 2u);
}

TEST_F(S3ClientTest, TemporaryCredentialsSendTheirSessionToken) {
  ASSERT_TRUE(moto_->Put(kBucket, "k", "bytes").ok());
  absl::StatusOr<testing::MotoServer::TemporaryCredentials> temporary = moto_->AssumeRole();
  ASSERT_TRUE(temporary.ok()) << temporary.status();
  auto client = MakeClient(TestConfig(moto_->endpoint()));
  const S3Credentials credentials{temporary->access_key, temporary->secret, temporary->token};
  std::vector<std::byte> out(5);
  absl::Status s = client->GetRange(credentials, kBucket, "k", 0, std::span(out));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(AsString(out), "bytes");
  absl::StatusOr<std::vector<S3ListEntry>> list = client->List(credentials, kBucket, "");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->size(), 1u);
}

TEST(S3ClientStsTest, AssumeRoleWithWebIdentityReturnsCredentials) {
  const std::string why = testing::MotoUnavailable();
  if (!why.empty()) GTEST_SKIP() << "no STS server to test against: " << why;
  absl::StatusOr<std::unique_ptr<testing::MotoServer>> moto =
      testing::MotoServer::Start(/*no_auth=*/true);
  ASSERT_TRUE(moto.ok()) << moto.status();
  auto client = MakeClient(TestConfig((*moto)->endpoint()));
  absl::StatusOr<StsCredentials> credentials = client->AssumeRoleWithWebIdentity(
      (*moto)->endpoint(), "arn:aws:iam::123456789012:role/reader", "eyJhbGciOiJSUzI1NiJ9.e30.sig",
      "gpufeed-test", absl::Hours(1));
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_THAT(credentials->access_key_id, ::testing::StartsWith("ASIA"));
  EXPECT_FALSE(credentials->secret_access_key.empty());
  EXPECT_FALSE(credentials->session_token.empty());
  EXPECT_FALSE(credentials->expiration.empty());
  // STS's bounds on the duration, before any request.
  EXPECT_EQ(client
                ->AssumeRoleWithWebIdentity((*moto)->endpoint(), "arn:aws:iam::1:role/r", "t", "s",
                                            absl::Minutes(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// No server needed: nothing listens.
TEST(S3ClientNoServerTest, ARefusedConnectionIsUnavailableAfterTheRetries) {
  // Port 1 (tcpmux) on loopback: nothing listens there.
  S3Config config = TestConfig("http://127.0.0.1:1");
  config.max_attempts = 3;
  auto client = MakeClient(config);
  std::vector<std::byte> out(1);
  absl::Status s =
      client->GetRange(S3Credentials{"AKIA", "secret", ""}, "b", "k", 0, std::span(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("s3://b/k"), HasSubstr("curl error 7"),
                                 HasSubstr("after 3 attempts")));
  EXPECT_EQ(client->counters().errors(S3ErrorKind::kConnect), 3u);
}

TEST(S3ClientNoServerTest, RefusesBadNamesBeforeAnyRequest) {
  auto client = MakeClient(TestConfig("http://127.0.0.1:1"));
  std::vector<std::byte> out(1);
  const S3Credentials credentials{"AKIA", "secret", ""};
  EXPECT_EQ(client->GetRange(credentials, "b/x", "k", 0, std::span(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->GetRange(credentials, "b", "", 0, std::span(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->GetRange(credentials, "b", "k", UINT64_MAX, std::span(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->List(credentials, "b", "", ListOptions(0, "", 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  S3Config no_region;
  no_region.region = "";
  EXPECT_EQ(S3Client::Create(no_region).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->counters().requests.load(), 0u);
}

}  // namespace
}  // namespace gpufeed::objstore
