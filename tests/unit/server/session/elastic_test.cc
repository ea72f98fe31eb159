// The elastic resume's rules (session/elastic.h) and, through the sampler, what a job sees
// across world-size changes: every sample once per epoch (keep the per-rank batch), the
// uninterrupted run's global batches (keep the global batch), and the refusals' exact words.
#include "server/session/elastic.h"

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/sampler/sampler.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

// A saved position as a client holds it.
struct Saved {
  Position at;
  int64_t samples = 0;
  int64_t batch_size = 0;
  int32_t world_size = 0;
  std::string fingerprint() const {
    return absl::StrCat("kind=tokens;samples=1;batch_size=", batch_size,
                        ";world_size=", world_size, ";seed=7;sampler=feistel1");
  }
};

AttachSpec SpecFor(const Saved& saved, int64_t batch, int32_t world, ElasticMode mode) {
  AttachSpec spec;
  spec.feed.batch_size = batch;
  spec.feed.world_size = world;
  spec.start = saved.at;
  spec.start_samples = saved.samples;
  spec.start_fingerprint = saved.fingerprint();
  spec.elastic = mode;
  return spec;
}

// A job of the resolved spec over `n` samples (seed 7, shuffled, no drop_last unless asked).
struct Job {
  std::unique_ptr<Sampler> sampler;
  Position at;
};

Job Start(AttachSpec& spec, uint64_t n, bool drop_last = false) {
  absl::StatusOr<std::string> note = ResolveElastic(spec);
  EXPECT_TRUE(note.ok()) << note.status();
  SamplerConfig c;
  c.num_samples = n;
  c.batch_size = spec.feed.batch_size;
  c.world_size = spec.feed.world_size;
  c.seed = 7;
  c.drop_last = drop_last;
  c.resume_epoch = spec.feed.resume_epoch;
  c.resume_base = spec.feed.resume_base;
  absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(c);
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(SettleElasticStart(spec, **s).ok());
  return {std::move(*s), spec.start};
}

// Runs `steps` global batches from the job's start, appending each epoch's valid ids to
// `seen[epoch]` and each global batch (every rank's rows, rank order) to `batches`; returns
// the position after them as a client computes it from the batches' (samples, end_of_epoch).
Saved RunSteps(Job& job, int64_t steps, std::map<int64_t, std::vector<int64_t>>& seen,
          std::vector<std::vector<int64_t>>* batches = nullptr) {
  const Sampler& s = *job.sampler;
  Saved after{job.at, static_cast<int64_t>(s.Cursor(job.at)), s.config().batch_size,
              s.config().world_size};
  Position p = job.at;
  for (int64_t i = 0; i < steps; ++i) {
    std::vector<int64_t> global;
    for (int32_t r = 0; r < s.config().world_size; ++r) {
      std::vector<int64_t> ids(static_cast<size_t>(s.config().batch_size));
      const int64_t valid = s.RankSlice(p, r, ids);
      seen[p.epoch].insert(seen[p.epoch].end(), ids.begin(), ids.begin() + valid);
      global.insert(global.end(), ids.begin(), ids.end());
    }
    if (batches != nullptr) batches->push_back(std::move(global));
    if (s.EndsEpoch(p)) {
      after.at = {p.epoch + 1, 0};
      after.samples = 0;
    } else {
      after.samples = static_cast<int64_t>(s.GlobalBatchSpan(p).second);
      after.at = {p.epoch, p.step + 1};
    }
    EXPECT_EQ(s.Next(p), after.at);
    p = after.at;
  }
  job.at = p;
  return after;
}

void ExpectEachOnce(const std::vector<int64_t>& ids, uint64_t n, const std::string& what) {
  std::vector<int> count(n, 0);
  for (int64_t id : ids) {
    ASSERT_GE(id, 0) << what;
    ASSERT_LT(static_cast<uint64_t>(id), n) << what;
    ++count[static_cast<size_t>(id)];
  }
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(count[i], 1) << what << ": sample " << i;
}

// 4 ranks, stopped at a random step, then 2, then 3 (per-rank batch kept), then 4: every
// sample of every epoch exactly once, for several dataset sizes and seeds of the stops.
TEST(ElasticTest, KeepingThePerRankBatchDeliversEverySampleOncePerEpoch) {
  for (uint64_t n : {96u, 101u, 157u, 1000u}) {
    for (unsigned trial = 0; trial < 20; ++trial) {
      std::mt19937 rng(trial * 131 + static_cast<unsigned>(n));
      std::map<int64_t, std::vector<int64_t>> seen;
      const int32_t worlds[] = {4, 2, 3, 4};
      Saved saved{{0, 0}, 0, 5, 4};
      int64_t total = 0;
      for (size_t hop = 0; hop < 4; ++hop) {
        AttachSpec spec = SpecFor(saved, 5, worlds[hop], ElasticMode::kKeepRankBatch);
        Job job = Start(spec, n);
        // Two epochs in all: the last hop runs to the end of epoch 1.
        int64_t steps = 0;
        if (hop == 3) {
          for (Position p = job.at; p.epoch < 2; p = job.sampler->Next(p)) ++steps;
        } else {
          steps = std::uniform_int_distribution<int64_t>(1, job.sampler->steps_per_epoch())(rng);
        }
        saved = RunSteps(job, steps, seen);
        total += steps;
        if (saved.at.epoch >= 2) break;
      }
      ASSERT_GE(saved.at.epoch, 2) << "n " << n << " trial " << trial;
      for (int64_t e = 0; e < 2; ++e) {
        ExpectEachOnce(seen[e], n, absl::StrCat("n ", n, " trial ", trial, " epoch ", e));
      }
    }
  }
}

// 4 -> 2 -> 4 ranks keeping the global batch: every global batch equals the uninterrupted
// run's, and the step numbers carry over (no resume base).
TEST(ElasticTest, KeepingTheGlobalBatchReproducesTheUninterruptedGlobalBatches) {
  constexpr uint64_t kN = 1003;
  std::map<int64_t, std::vector<int64_t>> ignored;
  std::vector<std::vector<int64_t>> straight;
  {
    AttachSpec spec = SpecFor(Saved{{0, 0}, 0, 8, 4}, 8, 4, ElasticMode::kKeepGlobalBatch);
    Job job = Start(spec, kN, /*drop_last=*/true);
    RunSteps(job, 2 * job.sampler->steps_per_epoch(), ignored, &straight);
  }
  std::vector<std::vector<int64_t>> hopped;
  Saved saved{{0, 0}, 0, 8, 4};
  const int32_t worlds[] = {4, 2, 4};
  const int64_t stops[] = {13, 29};  // then to the end of epoch 1 (31 steps an epoch)
  for (size_t hop = 0; hop < 3; ++hop) {
    // The script's constant per-rank batch (8): at 2 ranks it becomes 16.
    AttachSpec spec = SpecFor(saved, 8, worlds[hop], ElasticMode::kKeepGlobalBatch);
    Job job = Start(spec, kN, /*drop_last=*/true);
    EXPECT_EQ(spec.feed.batch_size, 32 / worlds[hop]);
    EXPECT_EQ(spec.feed.resume_epoch, -1);
    const int64_t steps = hop < 2 ? stops[hop] : 2 * 31 - 13 - 29;
    saved = RunSteps(job, steps, ignored, &hopped);
  }
  EXPECT_EQ(saved.at, (Position{2, 0}));
  ASSERT_EQ(hopped.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(hopped[i], straight[i]) << "batch " << i;
}

TEST(ElasticTest, AWorldSizeThatDoesNotSplitTheGlobalBatchIsRefusedNamingWhatWould) {
  AttachSpec spec = SpecFor(Saved{{1, 5}, 0, 64, 4}, 64, 3, ElasticMode::kKeepGlobalBatch);
  const absl::StatusOr<std::string> r = ResolveElastic(spec);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "world_size: the saved position's global batch of 256 samples (64 x 4 ranks) does "
            "not split over 3 ranks; resume at a world size that divides it (1, 2, 4, 8, 16, 32, "
            "64, 128, 256), or with elastic=rank_batch to keep 64 samples per rank");
  // The other mode takes it.
  spec.elastic = ElasticMode::kKeepRankBatch;
  ASSERT_TRUE(ResolveElastic(spec).ok());
  EXPECT_EQ(spec.feed.batch_size, 64);
  EXPECT_EQ(spec.start.step, 1280 / 192);
  EXPECT_EQ(spec.feed.resume_epoch, 1);
  EXPECT_EQ(spec.feed.resume_base, 1280u % 192u);
}

TEST(ElasticTest, ABatchSizeKeepingNeitherIsRefused) {
  AttachSpec spec = SpecFor(Saved{{0, 2}, 0, 64, 4}, 32, 2, ElasticMode::kKeepGlobalBatch);
  const absl::StatusOr<std::string> r = ResolveElastic(spec);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "batch_size: 32 x 2 ranks is a global batch of 64, not the saved position's global "
            "batch of 256 samples (64 x 4 ranks); resume with batch_size=128 (or the saved 64, "
            "which then becomes 128), or with elastic=rank_batch to change the global batch");
  // G / W' itself is taken as asked.
  spec.feed.batch_size = 128;
  ASSERT_TRUE(ResolveElastic(spec).ok());
  EXPECT_EQ(spec.feed.batch_size, 128);
  EXPECT_EQ(spec.start, (Position{0, 2}));
}

TEST(ElasticTest, ACursorOutsideItsStepIsRefused) {
  Saved saved{{0, 3}, 7, 4, 2};  // step 3 of a global batch of 8 begins at 24
  AttachSpec spec = SpecFor(saved, 4, 2, ElasticMode::kKeepGlobalBatch);
  const absl::StatusOr<std::string> r = ResolveElastic(spec);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "start.samples: 7 is not a cursor of step 3 at a global batch of 8 (it lies in [24, "
            "32))");
  spec.start_samples = -1;
  EXPECT_THAT(ResolveElastic(spec).status().message(), HasSubstr("start.samples: must be >= 0"));
}

TEST(ElasticTest, APositionFromBeforeTheCursorIsStepTimesTheSavedGlobalBatch) {
  // samples 0 with step 6 at 4 x 4: cursor 96; at 5 x 4 per rank that is step 4, base 16.
  AttachSpec spec = SpecFor(Saved{{2, 6}, 0, 4, 4}, 5, 4, ElasticMode::kKeepRankBatch);
  const absl::StatusOr<std::string> note = ResolveElastic(spec);
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(*note,
            "elastic resume (keep the per-rank batch) from 4 x 4 ranks to 5 x 4 ranks at epoch 2 "
            "sample 96 (step 4)");
  EXPECT_EQ(spec.start, (Position{2, 4}));
  EXPECT_EQ(spec.feed.resume_epoch, 2);
  EXPECT_EQ(spec.feed.resume_base, 16u);
  EXPECT_TRUE(spec.relaid);
}

TEST(ElasticTest, AReattachInsideAResumedEpochFindsTheSameBase) {
  // Resumed at cursor 96 with 5 x 4: base 16, step 4. Two steps later the client saves
  // (2, 6, 136) at 5 x 4; attaching that again gives base 16 and step 6.
  AttachSpec spec = SpecFor(Saved{{2, 6}, 136, 5, 4}, 5, 4, ElasticMode::kKeepGlobalBatch);
  const absl::StatusOr<std::string> note = ResolveElastic(spec);
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(*note, "");  // the saved layout: nothing elastic to log
  EXPECT_EQ(spec.start, (Position{2, 6}));
  EXPECT_EQ(spec.feed.resume_epoch, 2);
  EXPECT_EQ(spec.feed.resume_base, 16u);
  EXPECT_FALSE(spec.relaid);
}

TEST(ElasticTest, AResumeInTheDroppedTailStartsTheNextEpoch) {
  // 100 samples, drop_last; 10 x 2 ranks read to cursor 80 (step 4 of 5). At 30 x 1 rank:
  // base 20, step 2 would read [80, 110): past the end, so epoch 1 begins.
  AttachSpec spec = SpecFor(Saved{{0, 4}, 80, 10, 2}, 30, 1, ElasticMode::kKeepRankBatch);
  Job job = Start(spec, 100, /*drop_last=*/true);
  EXPECT_EQ(job.at, (Position{1, 0}));
  EXPECT_EQ(job.sampler->StepsIn(0), 2);
  EXPECT_EQ(job.sampler->StepsIn(1), 3);
}

TEST(ElasticTest, ACursorPastTheEpochIsRefused) {
  AttachSpec spec = SpecFor(Saved{{0, 1}, 150, 100, 1}, 40, 1, ElasticMode::kKeepRankBatch);
  ASSERT_TRUE(ResolveElastic(spec).ok());
  SamplerConfig c;
  c.num_samples = 120;
  c.batch_size = 40;
  c.world_size = 1;
  c.drop_last = false;
  c.resume_epoch = spec.feed.resume_epoch;
  c.resume_base = spec.feed.resume_base;
  absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SettleElasticStart(spec, **s).message(),
            "start.samples: 150 is past the 120 samples of epoch 0");
}

}  // namespace
}  // namespace gpufeed::server
