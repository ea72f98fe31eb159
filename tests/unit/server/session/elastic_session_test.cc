// An elastic resume through the session manager: the attachment says what it serves, the
// batches carry the position after them, and the ranks of the new layout read the rest of
// the epoch exactly once (session/elastic.h; docs/sampling.md, "Elastic resume").
#include <map>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/session/session_manager.h"
#include "tests/unit/server/session/session_manager_fixture.h"

namespace gpufeed::server {
namespace {

struct Saved {
  Position at;
  uint64_t samples = 0;
  std::string fingerprint;
};

class ElasticSessionTest : public SessionManagerTest {
 protected:
  // Every rank of `spec`'s job attaches at its start and reads `steps` batches (all when
  // `steps` < 0: to the end of `spec.stop_epoch`), each rank's valid ids appended to
  // `seen[epoch]`; returns rank 0's position after its last batch, as a client makes it.
  Saved RunJob(AttachSpec spec, int64_t steps, std::map<int64_t, std::vector<int64_t>>& seen,
               int64_t* batch_size = nullptr) {
    Saved after;
    for (int32_t rank = 0; rank < spec.feed.world_size; ++rank) {
      spec.rank = rank;
      absl::StatusOr<Attachment> a = manager_->Attach(spec);
      EXPECT_TRUE(a.ok()) << a.status();
      if (!a.ok()) return after;
      if (batch_size != nullptr) *batch_size = a->batch_size;
      EXPECT_EQ(a->layout.tensors[0].shape[0], a->batch_size);
      std::shared_ptr<Session> session = MustFind(*a);
      StreamProbe probe;
      EXPECT_TRUE(session->BindStream(probe.Callback()).ok());
      Saved mine{a->start, a->start_samples, a->fingerprint};
      for (int64_t n = 0; steps < 0 || n < steps; ++n) {
        StreamEvent ev = probe.Next(*session);
        if (ev.kind == StreamEvent::kEnd) break;
        EXPECT_EQ(ev.kind, StreamEvent::kBatch) << ev.status;
        if (ev.kind != StreamEvent::kBatch) break;
        const ReadyBatch& b = ev.batch;
        EXPECT_EQ(b.position, mine.at);
        seen[b.position.epoch].insert(seen[b.position.epoch].end(), b.ids.begin(),
                                      b.ids.begin() + b.valid);
        mine.at = b.end_of_epoch ? Position{b.position.epoch + 1, 0}
                                 : Position{b.position.epoch, b.position.step + 1};
        mine.samples = b.samples_after;
        EXPECT_TRUE(session->Release(b.slot, b.generation).ok());
      }
      EXPECT_EQ(session->delivered(), mine.at);
      EXPECT_EQ(session->Snapshot().delivered_samples, mine.samples);
      EXPECT_TRUE(manager_->Detach(a->session_id, a->token).ok());
      if (rank == 0) after = mine;
    }
    return after;
  }
};

TEST_F(ElasticSessionTest, TwoRanksResumeAtThreeKeepingTheRankBatchAndReadTheRestOnce) {
  StartManager();
  AttachSpec spec = Spec();  // 100 samples, 4 x 2 ranks
  spec.feed.drop_last = false;
  spec.stop_epoch = 1;
  std::map<int64_t, std::vector<int64_t>> seen;
  const Saved saved = RunJob(spec, 3, seen);
  EXPECT_EQ(saved.at, (Position{0, 3}));
  EXPECT_EQ(saved.samples, 24u);

  // At 3 ranks of 5: global batch 15, so the epoch goes on from base 24 mod 15 = 9, step 1.
  AttachSpec resumed = spec;
  resumed.feed.world_size = 3;
  resumed.feed.batch_size = 5;
  resumed.start = saved.at;
  resumed.start_samples = static_cast<int64_t>(saved.samples);
  resumed.start_fingerprint = saved.fingerprint;
  resumed.elastic = ElasticMode::kKeepRankBatch;
  int64_t batch = 0;
  const Saved end = RunJob(resumed, -1, seen, &batch);
  EXPECT_EQ(batch, 5);
  EXPECT_EQ(end.at, (Position{1, 0}));
  std::vector<int64_t> ids = seen[0];
  std::sort(ids.begin(), ids.end());
  std::vector<int64_t> all(100);
  for (int64_t i = 0; i < 100; ++i) all[static_cast<size_t>(i)] = i;
  EXPECT_EQ(ids, all);
}

TEST_F(ElasticSessionTest, TwoRanksResumeAtOneKeepingTheGlobalBatch) {
  StartManager();
  AttachSpec spec = Spec();  // 4 x 2 ranks, drop_last: 12 steps an epoch
  spec.stop_epoch = 1;
  std::map<int64_t, std::vector<int64_t>> seen;
  const Saved saved = RunJob(spec, 5, seen);
  AttachSpec resumed = spec;
  resumed.feed.world_size = 1;  // batch_size stays the script's 4: served as 8
  resumed.start = saved.at;
  resumed.start_samples = static_cast<int64_t>(saved.samples);
  resumed.start_fingerprint = saved.fingerprint;
  int64_t batch = 0;
  std::map<int64_t, std::vector<int64_t>> rest;
  RunJob(resumed, -1, rest, &batch);
  EXPECT_EQ(batch, 8);
  // The uninterrupted run's global batches 5..11, rank-major, are the one rank's rows.
  std::unique_ptr<Sampler> reference = ReferenceSampler(spec, 100);
  std::vector<int64_t> want;
  for (int64_t step = 5; step < 12; ++step) {
    for (int32_t r = 0; r < 2; ++r) {
      const std::vector<int64_t> ids = Ids(*reference, {0, step}, r);
      want.insert(want.end(), ids.begin(), ids.end());
    }
  }
  EXPECT_EQ(rest[0], want);
}

}  // namespace
}  // namespace gpufeed::server
