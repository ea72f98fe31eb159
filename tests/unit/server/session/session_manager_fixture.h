// The session manager's test fixture, shared by the tests of Attach's steps through the
// manager (attach_spec, admission, job_registry, ring_planner) and of the manager itself:
// a token file of 100 samples, a 4 MiB staging pool, a manager started per test.
#pragma once

#include "server/session/session_manager.h"


#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/reader/npy.h"
#include "server/sampler/sampler.h"
#include "server/staging/staging_pool.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/fake_file_system.h"
#include "tests/testing/npy_builder.h"
#include "tests/testing/printers.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {


inline constexpr int64_t kSeqLen = 10;
inline constexpr uint64_t kTokenBytes = 2;                          // uint16
inline constexpr uint64_t kRowBytes = (kSeqLen + 1) * kTokenBytes;  // 22
inline constexpr absl::Duration kEventTimeout = absl::Seconds(5);

// `count` uint16 tokens, token t = t * 40503 + 11 (mod 2^16): neighbours differ, so a window
// read at the wrong offset cannot match.
inline std::string TokenFile(uint64_t count) {
  std::string out;
  for (uint64_t t = 0; t < count; ++t) {
    const uint16_t v = static_cast<uint16_t>(t * 40503u + 11u);
    out += static_cast<char>(v & 0xff);
    out += static_cast<char>(v >> 8);
  }
  return out;
}

// Calls from the session's notify land here; a test waits for "something new". The callback
// shares the probe's state, so a session notifying after the probe went away (as Shutdown
// in the manager's destructor does) touches live memory.
class StreamProbe {
 public:
  std::function<void()> Callback() {
    return [state = state_] {
      absl::MutexLock lock(&state->mu);
      ++state->notified;
      state->cv.SignalAll();
    };
  }
  int notified() const {
    absl::MutexLock lock(&state_->mu);
    return state_->notified;
  }
  // The next event other than kNothing, waiting on notifications up to `timeout`; kNothing
  // when none came in time.
  StreamEvent Next(Session& session, absl::Duration timeout = kEventTimeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int seen;
      {
        absl::MutexLock lock(&state_->mu);
        seen = state_->notified;
      }
      StreamEvent event = session.NextEvent();
      if (event.kind != StreamEvent::kNothing) return event;
      if (absl::Now() >= deadline) return event;
      // Wake on a notification (or re-poll after a short while, as a safety net).
      absl::MutexLock lock(&state_->mu);
      if (state_->notified == seen) {
        state_->cv.WaitWithDeadline(&state_->mu,
                                    std::min(deadline, absl::Now() + absl::Milliseconds(20)));
      }
    }
  }

 private:
  struct State {
    absl::Mutex mu;
    absl::CondVar cv;
    int notified ABSL_GUARDED_BY(mu) = 0;
  };
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

inline Caller AsUid(uint32_t uid, bool admin = false) {
  Caller c;
  c.cred.uid = uid;
  c.cred.gid = uid;
  c.admin = admin;
  return c;
}

class SessionManagerTest : public ::testing::Test {
 protected:
  // `spec` as uid `uid` attaches it: an admin by path, anyone else through a dataset handle
  // (the descriptor the client library passes on the memory socket; docs/SECURITY.md 2).
  AttachSpec SpecOf(AttachSpec spec, uint32_t uid, bool admin = false) const {
    spec.caller = AsUid(uid, admin);
    if (!admin) {
      UniqueFd fd(::open(spec.feed.dataset.path.c_str(), O_RDONLY | O_CLOEXEC));
      absl::StatusOr<std::string> handle =
          manager_->AddDatasetHandle(std::move(fd), spec.caller.cred);
      EXPECT_TRUE(handle.ok()) << handle.status();
      if (handle.ok()) spec.feed.dataset.handle = *handle;
    }
    return spec;
  }

  // 1001 tokens, seq_len 10: 100 samples.
  void SetUp() override {
    tokens_ = TokenFile(1001);
    path_ = dir_.WriteFile("tokens.bin", tokens_);
    absl::StatusOr<std::unique_ptr<StagingPool>> pool =
        StagingPool::Create(4 << 20, 4 << 20);  // 4 MiB, one slab
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  void StartManager(SessionManagerOptions options = {}, FileSystem* fs = PosixFileSystem()) {
    options.threads = 2;
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), fs);
  }

  void TearDown() override {
    manager_.reset();  // before the pool: rings go back to it
  }

  // A valid spec: job "train", rank 0 of 2, batch 4, seed 1234, 2 slots.
  AttachSpec Spec() const {
    AttachSpec spec;
    spec.caller.admin = true;  // attach by path, as an admin (docs/SECURITY.md 2)
    spec.job = "train";
    spec.rank = 0;
    spec.feed.dataset.kind = DatasetKind::kTokens;
    spec.feed.dataset.path = path_;
    spec.feed.dataset.token_dtype = DType::kUInt16;
    spec.feed.dataset.seq_len = kSeqLen;
    spec.feed.batch_size = 4;
    spec.feed.world_size = 2;
    spec.feed.seed = 1234;
    spec.feed.shuffle = true;
    spec.feed.drop_last = true;
    spec.ring_slots = 2;
    return spec;
  }

  // An independent sampler for `spec` over `num_samples`.
  static std::unique_ptr<Sampler> ReferenceSampler(const AttachSpec& spec, uint64_t num_samples) {
    SamplerConfig c{num_samples,    spec.feed.batch_size, spec.feed.world_size,
                    spec.feed.seed, spec.feed.shuffle,    spec.feed.drop_last};
    absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(c);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  static std::vector<int64_t> Ids(const Sampler& s, Position p, int32_t rank) {
    std::vector<int64_t> ids(static_cast<size_t>(s.config().batch_size));
    s.RankSlice(p, rank, std::span<int64_t>(ids));
    return ids;
  }

  std::shared_ptr<Session> MustFind(const Attachment& a) {
    absl::StatusOr<std::shared_ptr<Session>> s = manager_->Find(a.session_id, a.token);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }

  // Streams session `a` and waits (5 s at most) for its first batch, step 0 of epoch 0.
  void ExpectFirstBatch(const Attachment& a) {
    std::shared_ptr<Session> session = MustFind(a);
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(session->BindStream([] {}).ok());
    StreamEvent e;
    ASSERT_TRUE(::gpufeed::testing::Eventually(
        [&] { return (e = session->NextEvent()).kind == StreamEvent::kBatch; }, absl::Seconds(5)));
    EXPECT_EQ(e.batch.position.epoch, 0);
    EXPECT_EQ(e.batch.position.step, 0);
  }

  // Checks that `batch`'s slot holds, row by row, the token windows of its sample ids, as a
  // consumer would see them through its own mapping of the ring's memfd.
  void ExpectSlotBytes(const Session& session, const Attachment& a, const ReadyBatch& batch) {
    ASSERT_EQ(a.layout.tensors.size(), 1u);
    const TensorLayout& t = a.layout.tensors[0];
    absl::StatusOr<UniqueFd> fd = session.ShareRingFd();
    ASSERT_TRUE(fd.ok()) << fd.status();
    absl::StatusOr<Mapping> m = Mapping::Map(fd->get(), 0, session.ring_bytes(), false);
    ASSERT_TRUE(m.ok()) << m.status();
    const char* slot = reinterpret_cast<const char*>(m->data()) +
                       static_cast<uint64_t>(batch.slot) * a.layout.stride_bytes;
    for (size_t i = 0; i < batch.ids.size(); ++i) {
      const std::string got(slot + t.byte_offset + i * t.row_bytes, t.row_bytes);
      const std::string want =
          tokens_.substr(static_cast<uint64_t>(batch.ids[i]) * kSeqLen * kTokenBytes, kRowBytes);
      ASSERT_EQ(got, want) << "slot " << batch.slot << " row " << i << " (sample " << batch.ids[i]
                           << ")";
    }
  }

  // Options whose lease decisions read clock_, checked every millisecond of real time.
  SessionManagerOptions FakeClockOptions() const {
    SessionManagerOptions options;
    options.clock = clock_.AsClock();
    options.reap_interval = absl::Milliseconds(1);
    return options;
  }
  // Waits until the reaper has completed `n` whole rounds after this call: every round but
  // the first saw the clock as it is now.
  void WaitReapRounds(int n = 2) {
    const int64_t start = manager_->reap_rounds();
    ASSERT_TRUE(::gpufeed::testing::Eventually([&] { return manager_->reap_rounds() >= start + n; }));
  }

  ::gpufeed::testing::TempDir dir_;
  std::string tokens_;
  std::string path_;
  ::gpufeed::testing::FakeClock clock_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<SessionManager> manager_;
};

}  // namespace gpufeed::server
