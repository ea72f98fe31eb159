// Attach's first step: the spec's rules (server/session/attach_spec.h), checked directly and
// through the manager, and the rules against the opened feed (start step, fingerprint).
#include "server/session/attach_spec.h"

#include <fstream>
#include <functional>
#include <string>

#include "tests/testing/fake_device_backend.h"
#include "tests/unit/server/session/session_manager_fixture.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Eventually;
using ::testing::HasSubstr;

void ExpectInvalidField(const AttachSpec& spec, const std::string& field) {
  const absl::Status s = ValidateAttachSpec(spec, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field << ": " << s;
  EXPECT_THAT(s.message(), HasSubstr(field));
}

TEST_F(SessionManagerTest, ValidateAcceptsAGoodSpec) {
  EXPECT_TRUE(ValidateAttachSpec(Spec(), 64).ok());
  AttachSpec spec = Spec();
  spec.ring_slots = 0;  // the default
  EXPECT_TRUE(ValidateAttachSpec(spec, 64).ok());
  spec.rank = 1;
  spec.ring_slots = 64;
  spec.start = {3, 2};
  spec.stop_epoch = 4;
  EXPECT_TRUE(ValidateAttachSpec(spec, 64).ok());
}

TEST_F(SessionManagerTest, ValidateRejectsEachBadField) {
  struct Case {
    const char* field;
    std::function<void(AttachSpec&)> apply;
  };
  const Case cases[] = {
      {"job", [](AttachSpec& s) { s.job = ""; }},
      {"job", [](AttachSpec& s) { s.job = std::string(129, 'j'); }},
      {"world_size", [](AttachSpec& s) { s.feed.world_size = 0; }},
      {"rank", [](AttachSpec& s) { s.rank = 2; }},  // == world_size
      {"rank", [](AttachSpec& s) { s.rank = 7; }},
      {"rank", [](AttachSpec& s) { s.rank = -1; }},
      {"batch_size", [](AttachSpec& s) { s.feed.batch_size = 0; }},
      {"batch_size", [](AttachSpec& s) { s.feed.batch_size = (int64_t{1} << 24) + 1; }},
      {"ring_slots", [](AttachSpec& s) { s.ring_slots = 65; }},
      {"ring_slots", [](AttachSpec& s) { s.ring_slots = -1; }},
      {"start", [](AttachSpec& s) { s.start = {-1, 0}; }},
      {"start", [](AttachSpec& s) { s.start = {0, -3}; }},
      {"stop_epoch",
       [](AttachSpec& s) {
         s.start = {2, 0};
         s.stop_epoch = 2;  // == start.epoch
       }},
      {"stop_epoch",
       [](AttachSpec& s) {
         s.start = {2, 0};
         s.stop_epoch = 1;  // < start.epoch
       }},
      {"stop_epoch", [](AttachSpec& s) { s.stop_epoch = -1; }},
      // An unknown dataset.kind is the conversion's to refuse (convert_test).
      {"dataset.path", [](AttachSpec& s) { s.feed.dataset.path = "data/tokens.bin"; }},
      {"dataset.path", [](AttachSpec& s) { s.feed.dataset.path = ""; }},
  };
  for (const Case& c : cases) {
    AttachSpec s = Spec();
    c.apply(s);
    ExpectInvalidField(s, c.field);
  }
}

TEST_F(SessionManagerTest, JobNamesAreBoundedPrintableNames) {
  for (const std::string& good :
       {std::string("a"), std::string("train-v2.1_run:3@node+x=y/z"), std::string(128, 'j')}) {
    AttachSpec spec = Spec();
    spec.job = good;
    EXPECT_TRUE(ValidateAttachSpec(spec, 64).ok()) << good;
  }
  const std::string charset = "; a job name is 1 to 128 bytes of [A-Za-z0-9._:@+=/-]";
  struct Case {
    std::string job;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"", "job: must be 1 to 128 bytes, got 0"},
           {std::string(129, 'j'), "job: must be 1 to 128 bytes, got 129"},
           {"a b", "job: byte 1 is 0x20 (' ')" + charset},
           {"x\nINFO forged", "job: byte 1 is 0x0a ('\\n')" + charset},
           {"\x1b[31m", "job: byte 0 is 0x1b ('\\x1b')" + charset},
           {"caf\xc3\xa9", "job: byte 3 is 0xc3 ('\\xc3')" + charset},
           {"a;b", "job: byte 1 is 0x3b (';')" + charset},
           {"a\\b", "job: byte 1 is 0x5c ('\\\\')" + charset},
       }) {
    AttachSpec spec = Spec();
    spec.job = c.job;
    const absl::Status s = ValidateAttachSpec(spec, 64);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(s.message(), c.message);
  }
}

TEST_F(SessionManagerTest, AttachValidatesTheSpec) {
  StartManager();
  AttachSpec spec = Spec();
  spec.ring_slots = 65;
  const absl::Status s = manager_->Attach(spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ring_slots"));
  EXPECT_EQ(manager_->num_sessions(), 0);
}

TEST_F(SessionManagerTest, AttachRefusesDeviceDelivery) {
  StartManager();
  AttachSpec spec = Spec();
  spec.delivery = DeliveryKind::kDevice;
  const absl::Status s = manager_->Attach(spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("delivery"));
  EXPECT_EQ(pool_->free_bytes(), pool_->total_bytes());
}

TEST_F(SessionManagerTest, AttachRefusesStartStepPastTheEpoch) {
  StartManager();
  AttachSpec spec = Spec();
  spec.start = {0, 12};  // 100 samples / (4 x 2) = 12 steps: 0..11
  const absl::Status s = manager_->Attach(spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("start.step"));
  EXPECT_THAT(s.message(), HasSubstr("12"));
  EXPECT_EQ(pool_->free_bytes(), pool_->total_bytes());
  // The refusal released the (job, rank): the last step is accepted.
  spec.start = {0, 11};
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->steps_per_epoch, 12);
  EXPECT_EQ(a->start, (Position{0, 11}));
}

// A position resumes only the feed it came from. The fingerprint of a
// feed names the dataset's identity and every setting that shapes its batches; a different
// one is refused, naming each field that differs.
TEST_F(SessionManagerTest, APositionResumesOnlyTheFeedItCameFrom) {
  StartManager();
  AttachSpec saved = Spec();
  saved.job = "saved";
  saved.feed.dataset.seq_len = 32;
  saved.feed.world_size = 1;
  absl::StatusOr<Attachment> a = manager_->Attach(saved);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string fingerprint = a->fingerprint;
  EXPECT_THAT(fingerprint, HasSubstr("kind=tokens;path=" + path_ + ";bytes=2002;mtime_ns="));
  EXPECT_THAT(fingerprint, HasSubstr(";samples=31;tensors=tokens:uint16[33];seq_len=32;"));
  EXPECT_THAT(fingerprint, HasSubstr(";batch_size=4;world_size=1;seed=1234;shuffle=true;"));
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());

  // The same feed resumes.
  saved.start = {1, 3};
  saved.start_fingerprint = fingerprint;
  absl::StatusOr<Attachment> same = manager_->Attach(saved);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->fingerprint, fingerprint);
  ASSERT_TRUE(manager_->Detach(same->session_id, same->token).ok());

  // seq_len 16 (and so the sample count and row shape) differs: refused, naming them.
  AttachSpec shorter = saved;
  shorter.feed.dataset.seq_len = 16;
  absl::StatusOr<Attachment> refused = manager_->Attach(shorter);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr("start.fingerprint: the position was saved from another feed: "));
  EXPECT_THAT(refused.status().message(), HasSubstr("seq_len was 32, is 16"));
  EXPECT_THAT(refused.status().message(), HasSubstr("samples was 31, is 62"));
  EXPECT_THAT(refused.status().message(), HasSubstr("tensors was tokens:uint16[33], is tokens:uint16[17]"));

  // Each setting that shapes the order or the samples, one at a time. (batch_size and
  // world_size are the layout, which an elastic resume changes: elastic_test.cc.)
  struct Change {
    const char* want;
    std::function<void(AttachSpec&)> apply;
  };
  const Change changes[] = {
      {"seed was 1234, is 99", [](AttachSpec& s) { s.feed.seed = 99; }},
      {"shuffle was true, is false", [](AttachSpec& s) { s.feed.shuffle = false; }},
      {"drop_last was true, is false", [](AttachSpec& s) { s.feed.drop_last = false; }},
      {"vocab_size was 0, is 65536", [](AttachSpec& s) { s.feed.dataset.vocab_size = 65536; }},
  };
  for (const Change& c : changes) {
    AttachSpec other = saved;
    c.apply(other);
    absl::StatusOr<Attachment> r = manager_->Attach(other);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << c.want;
    EXPECT_THAT(r.status().message(), HasSubstr(c.want));
  }

  // The dataset rewritten with other bytes: its size and mtime differ. (Once the detached
  // session's fills have let go of the feed: a live feed keeps what it opened.)
  ASSERT_TRUE(Eventually([&] { return manager_->ListFeeds().empty(); }));
  const std::string longer = TokenFile(1201);
  std::ofstream(path_, std::ios::binary | std::ios::trunc).write(longer.data(), static_cast<std::streamsize>(longer.size()));
  absl::StatusOr<Attachment> rewritten = manager_->Attach(saved);
  ASSERT_EQ(rewritten.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(rewritten.status().message(), HasSubstr("bytes was 2002, is 2402"));
  EXPECT_THAT(rewritten.status().message(), HasSubstr("mtime_ns was "));
  // Without a saved fingerprint nothing is checked (a position typed by hand).
  saved.start_fingerprint.clear();
  EXPECT_TRUE(manager_->Attach(saved).ok());
}

TEST(FingerprintTest, ValuesWithSeparatorsRoundTripAndCompareByField) {
  EXPECT_TRUE(CompareFingerprints("a=1;b=x%3By", "a=1;b=x%3By").ok());
  absl::Status s = CompareFingerprints("a=1;b=x%3By;gone=1", "a=2;b=x%3By;new=3");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("a was 1, is 2; new (not in the saved position); "
                                     "gone (no longer part of the feed)"));
}

// The dataset's fields that belong to one kind, refused on another (they came from the
// conversion once; each is stated in attach_spec.cc now).
TEST_F(SessionManagerTest, FieldsOfOneKindAreRefusedOnAnother) {
  struct Case {
    std::function<void(AttachSpec&)> apply;
    std::string message;
  };
  const std::string tokens_only =
      "dataset.token_dtype, dataset.seq_len, dataset.vocab_size: only for kind tokens";
  const Case cases[] = {
      {[](AttachSpec& s) {
         s.feed.dataset.kind = DatasetKind::kRecords;
         s.feed.dataset.token_dtype = DType::kUnspecified;
       },
       tokens_only},
      {[](AttachSpec& s) {
         s.feed.dataset.kind = DatasetKind::kRecords;
         s.feed.dataset.token_dtype = DType::kUnspecified;
         s.feed.dataset.seq_len = 0;
         s.feed.dataset.vocab_size = 7;
       },
       tokens_only},
      {[](AttachSpec& s) { s.feed.dataset.arrays.push_back({"x", "x.npy"}); },
       "dataset.arrays: only for kind records (several .npy arrays, one tensor each)"},
      {[](AttachSpec& s) {
         s.feed.dataset.kind = DatasetKind::kRecords;
         s.feed.dataset.token_dtype = DType::kUnspecified;
         s.feed.dataset.seq_len = 0;
         for (int i = 0; i < 33; ++i) {
           s.feed.dataset.arrays.push_back({absl::StrCat("a", i), absl::StrCat("a", i, ".npy")});
         }
       },
       "dataset.arrays: 33 arrays, at most 32"},
      {[](AttachSpec& s) {
         s.feed.dataset.kind = DatasetKind::kRecords;
         s.feed.dataset.token_dtype = DType::kUnspecified;
         s.feed.dataset.seq_len = 0;
         s.feed.dataset.paths = {s.feed.dataset.path + "/x.npy"};
       },
       "dataset.paths: only for kind tokens and webdataset (an explicit list of shard files)"},
  };
  for (const Case& c : cases) {
    AttachSpec spec = Spec();
    c.apply(spec);
    const absl::Status s = ValidateAttachSpec(spec, 64);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(s.message(), c.message);
  }
  // Each in its own kind passes.
  AttachSpec records = Spec();
  records.feed.dataset.kind = DatasetKind::kRecords;
  records.feed.dataset.token_dtype = DType::kUnspecified;
  records.feed.dataset.seq_len = 0;
  records.feed.dataset.arrays = {{"x", "x.npy"}, {"y", "y.npy"}};
  EXPECT_TRUE(ValidateAttachSpec(records, 64).ok()) << ValidateAttachSpec(records, 64);
  AttachSpec listed = Spec();
  listed.feed.dataset.path = "/data";
  listed.feed.dataset.paths = {"/data/1.bin", "/data/0.bin"};
  EXPECT_TRUE(ValidateAttachSpec(listed, 64).ok()) << ValidateAttachSpec(listed, 64);
}

TEST_F(SessionManagerTest, DeviceDeliveryNeedsAGpuAndNamesTheConsumers) {
  AttachSpec spec = Spec();
  EXPECT_TRUE(CheckDeviceDelivery(spec, nullptr).ok());  // host delivery: no GPU needed
  spec.delivery = DeliveryKind::kDevice;
  absl::Status s = CheckDeviceDelivery(spec, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "delivery: no CUDA device visible to gpufeedd; attach with host delivery");
  gpufeed::testing::FakeDeviceBackend devices(uint64_t{1} << 30);
  s = CheckDeviceDelivery(spec, &devices);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "delivery.gpu_uuid: device delivery names the consumer's GPU by UUID");
  spec.gpu_uuid = "GPU-fake";
  EXPECT_TRUE(CheckDeviceDelivery(spec, &devices).ok());
}

}  // namespace
}  // namespace gpufeed::server
