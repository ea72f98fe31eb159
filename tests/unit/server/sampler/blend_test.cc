#include "server/sampler/blend.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/sampler/sampler.h"
#include "server/sampler/splitmix.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

BlendSpec Spec(std::vector<uint64_t> sizes, std::vector<double> weights, uint64_t seed = 7) {
  BlendSpec spec;
  spec.seed = seed;
  spec.segments.push_back(
      BlendSegment{0, std::move(weights), std::vector<uint64_t>(sizes.size(), 0)});
  spec.sizes = std::move(sizes);
  return spec;
}

std::unique_ptr<Blend> Make(BlendSpec spec) {
  absl::StatusOr<std::unique_ptr<Blend>> blend = Blend::Create(std::move(spec));
  EXPECT_TRUE(blend.ok()) << blend.status();
  return blend.ok() ? *std::move(blend) : nullptr;
}

std::vector<BlendPick> Sequence(const Blend& blend, uint64_t first, uint64_t count) {
  std::vector<BlendPick> picks(count);
  blend.Fill(first, picks);
  return picks;
}

// Sizes that make every source cycle its epochs within 100k samples, none a divisor of another.
const std::vector<uint64_t> kSizes = {5003, 3001, 1999};
const std::vector<double> kWeights = {0.5, 0.3, 0.2};

TEST(BlendTest, SharesWithinOnePercentAtEveryThousand) {
  auto blend = Make(Spec(kSizes, kWeights));
  const std::vector<BlendPick> picks = Sequence(*blend, 0, 100000);
  std::vector<uint64_t> counts(3, 0);
  for (size_t t = 0; t < picks.size(); ++t) {
    ++counts[picks[t].source];
    if ((t + 1) % 1000 != 0) continue;
    for (int k = 0; k < 3; ++k) {
      const double share = static_cast<double>(counts[k]) / static_cast<double>(t + 1);
      ASSERT_LE(std::abs(share - kWeights[k]), 0.01) << "source " << k << " at " << t + 1;
    }
  }
  EXPECT_EQ(counts, (std::vector<uint64_t>{50000, 30000, 20000}));
}

// (weights, dataset_index) of a vector make_megatron_vector.py wrote.
std::pair<std::vector<double>, std::string> ReadVector(const std::string& name) {
  std::ifstream in(std::string(GPUFEED_SOURCE_DIR) + "/tests/data/blend/" + name);
  EXPECT_TRUE(in.good()) << name;
  std::vector<double> weights;
  std::string digits, line;
  while (std::getline(in, line)) {
    if (line.rfind("# weights:", 0) == 0) {
      for (absl::string_view w : absl::StrSplit(line.substr(10), ' ', absl::SkipEmpty())) {
        double value = 0;
        EXPECT_TRUE(absl::SimpleAtod(w, &value)) << w;
        weights.push_back(value);
      }
    } else if (!line.empty() && line[0] != '#') {
      digits += line;
    }
  }
  return {weights, digits};
}

// The source sequence is Megatron-Core's build_blending_indices' dataset_index on the same
// weights (the vectors come from the peer itself: tests/data/blend/make_megatron_vector.py),
// and each pick's index is its dataset_sample_index (the source's count so far).
void ExpectMegatron(const std::string& name) {
  const auto [weights, digits] = ReadVector(name);
  ASSERT_EQ(digits.size(), 100000u) << name;
  auto blend = Make(Spec(std::vector<uint64_t>(weights.size(), 977), weights));
  const std::vector<BlendPick> picks = Sequence(*blend, 0, digits.size());
  std::vector<uint64_t> counts(weights.size(), 0);
  for (size_t t = 0; t < digits.size(); ++t) {
    ASSERT_EQ(picks[t].source, digits[t] - '0') << name << ": first difference at sample " << t;
    ASSERT_EQ(picks[t].index, counts[picks[t].source]++) << name << " at " << t;
  }
}

TEST(BlendTest, SourceSequenceIsMegatronsThreeSources) { ExpectMegatron("megatron_0.5_0.3_0.2.txt"); }

// Nine weights, not normalised: normalised as numpy.sum's pairwise sum does.
TEST(BlendTest, SourceSequenceIsMegatronsNineSources) { ExpectMegatron("megatron_9_sources.txt"); }

TEST(BlendTest, FirstSamplesFollowTheRuleAsWritten) {
  // max(t, 1): samples 0 and 1 both see t = 1, so the second goes to source 1 (0.3 > 0.5 - 1).
  auto blend = Make(Spec({10, 10, 10}, {0.5, 0.3, 0.2}));
  std::vector<int32_t> sources;
  for (const BlendPick& pick : Sequence(*blend, 0, 10)) sources.push_back(pick.source);
  EXPECT_EQ(sources, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 2, 0, 1, 0}));
  // Equal weights: ties go to the lowest index.
  auto even = Make(Spec({10, 10, 10}, {1, 1, 1}));
  sources.clear();
  for (const BlendPick& pick : Sequence(*even, 0, 6)) sources.push_back(pick.source);
  EXPECT_EQ(sources, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
}

TEST(BlendTest, EachSourceCyclesItsOwnEpochsWithUnionIds) {
  auto blend = Make(Spec(kSizes, kWeights, 11));
  const std::vector<BlendPick> picks = Sequence(*blend, 0, 40000);
  uint64_t state = 11;
  std::vector<uint64_t> seeds;
  for (int k = 0; k < 3; ++k) seeds.push_back(SplitMix64(state));
  std::map<std::pair<int32_t, uint64_t>, std::vector<uint64_t>> orders;  // (source, epoch)
  for (const BlendPick& pick : picks) {
    const uint64_t n = kSizes[pick.source];
    const uint64_t epoch = pick.index / n;
    std::vector<uint64_t>& order = orders[{pick.source, epoch}];
    if (order.empty()) order = EpochPermutation(n, seeds[pick.source], static_cast<int64_t>(epoch), true);
    ASSERT_EQ(pick.sample, order[pick.index % n]);
    ASSERT_EQ(pick.id, blend->offset(pick.source) + pick.sample);
  }
  EXPECT_EQ(blend->offset(0), 0u);
  EXPECT_EQ(blend->offset(1), 5003u);
  EXPECT_EQ(blend->offset(2), 8004u);
}

TEST(BlendTest, RandomAccessEqualsSequential) {
  const BlendSpec spec = Spec(kSizes, kWeights);
  auto sequential = Make(spec);
  const uint64_t total = 5 * Blend::kSnapshotInterval + 123;
  const std::vector<BlendPick> picks = Sequence(*sequential, 0, total);
  std::mt19937_64 random(1);
  for (int trial = 0; trial < 50; ++trial) {
    auto fresh = Make(spec);  // nothing memoised: the first At replays from 0
    const uint64_t t = random() % total;
    ASSERT_EQ(fresh->At(t), picks[t]) << t;
    for (int again = 0; again < 5; ++again) {
      const uint64_t u = random() % total;
      ASSERT_EQ(fresh->At(u), picks[u]) << u;
      std::vector<uint64_t> counts(3, 0);
      for (uint64_t i = 0; i < u; ++i) ++counts[picks[i].source];
      ASSERT_EQ(fresh->LedgerAt(u), counts) << u;
    }
  }
}

// Past its bound on memoised snapshots a blend drops the oldest (a run past 2^32 picks, at
// the real bound of 2^16): a reader going on finds a snapshot within one interval behind it,
// not only those of the run's start (a review: memoising stopped at the bound, and every
// later chunk replayed from the last one kept, seconds a chunk a billion picks on). The
// picks stay the sequential ones, positions before the kept snapshots included.
TEST(BlendTest, PastItsBoundTheOldestSnapshotsGoAndRecentOnesStay) {
  const BlendSpec spec = Spec(kSizes, kWeights);
  const uint64_t interval = Blend::kSnapshotInterval;
  const uint64_t total = 12 * interval + 5;
  const std::vector<BlendPick> picks = Sequence(*Make(spec), 0, total);
  absl::StatusOr<std::unique_ptr<Blend>> blend = Blend::Create(spec, 4);
  ASSERT_TRUE(blend.ok()) << blend.status();
  for (uint64_t c = 1; c <= 12; ++c) {
    const uint64_t t = c * interval + 3;
    ASSERT_EQ((*blend)->At(t), picks[t]) << t;
    EXPECT_EQ((*blend)->NearestKnown(t), c * interval) << "chunk " << c;
    EXPECT_EQ((*blend)->snapshots(), std::min<uint64_t>(c, 4));
  }
  // Those of chunks 9-12 kept; an early position replays from the segment's start.
  EXPECT_EQ((*blend)->NearestKnown(8 * interval + 1), 0u);
  ASSERT_EQ((*blend)->At(8 * interval + 1), picks[8 * interval + 1]);
  ASSERT_EQ((*blend)->At(2 * interval), picks[2 * interval]);
}

TEST(BlendTest, ConcurrentRandomAccessEqualsSequential) {
  const BlendSpec spec = Spec(kSizes, kWeights);
  const uint64_t total = 4 * Blend::kSnapshotInterval;
  const std::vector<BlendPick> picks = Sequence(*Make(spec), 0, total);
  auto shared = Make(spec);
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 random(100 + i);
      for (int trial = 0; trial < 40; ++trial) {
        const uint64_t t = random() % total;
        if (!(shared->At(t) == picks[t])) ++wrong[i];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(wrong, (std::vector<int>{0, 0, 0, 0}));
}

TEST(BlendTest, ResumeAtRandomPointsEqualsTheUninterruptedStream) {
  const BlendSpec spec = Spec(kSizes, kWeights, 3);
  const uint64_t total = 3 * Blend::kSnapshotInterval;
  const std::vector<BlendPick> picks = Sequence(*Make(spec), 0, total);
  std::mt19937_64 random(2);
  for (int trial = 0; trial < 20; ++trial) {
    const uint64_t t0 = random() % (total - 1000);
    auto before = Make(spec);
    const std::vector<uint64_t> ledger = before->LedgerAt(t0);  // what a checkpoint stores
    auto resumed = Make(spec);
    ASSERT_TRUE(resumed->AddAnchor(t0, ledger).ok());
    const std::vector<BlendPick> after = Sequence(*resumed, t0, 1000);
    ASSERT_TRUE(std::equal(after.begin(), after.end(), picks.begin() + t0)) << t0;
  }
}

// Counts, per source, every index and sample it delivered: indices 0, 1, 2, ... each once
// (no repeat, no skip), and within each of its epochs every sample once.
void ExpectNoRepeatNoSkip(const std::vector<BlendPick>& picks, const std::vector<uint64_t>& sizes) {
  std::vector<std::vector<BlendPick>> by_source(sizes.size());
  for (const BlendPick& pick : picks) by_source[pick.source].push_back(pick);
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<uint64_t> seen(sizes[k], 0);
    uint64_t repeats = 0, skips = 0;
    for (size_t i = 0; i < by_source[k].size(); ++i) {
      const BlendPick& pick = by_source[k][i];
      if (pick.index != i) ++(pick.index < i ? repeats : skips);
      if (i % sizes[k] == 0) std::fill(seen.begin(), seen.end(), 0);
      if (seen[pick.sample]++ != 0) ++repeats;
    }
    EXPECT_EQ(repeats, 0u) << "source " << k;
    EXPECT_EQ(skips, 0u) << "source " << k;
  }
}

TEST(BlendTest, WeightsChangedAtAResumeRepeatAndSkipNothing) {
  const BlendSpec spec = Spec(kSizes, kWeights, 5);
  std::mt19937_64 random(4);
  for (int trial = 0; trial < 10; ++trial) {
    const uint64_t t0 = 1 + random() % 30000;
    const uint64_t t1 = t0 + 1 + random() % 30000;
    auto first = Make(spec);
    absl::StatusOr<BlendSpec> second_spec = first->WithWeightsAt(t0, {0.1, 0.6, 0.3});
    ASSERT_TRUE(second_spec.ok()) << second_spec.status();
    auto second = Make(*second_spec);
    absl::StatusOr<BlendSpec> third_spec = second->WithWeightsAt(t1, {2, 1, 7});
    ASSERT_TRUE(third_spec.ok()) << third_spec.status();
    ASSERT_EQ(third_spec->segments.size(), 3u);
    auto third = Make(*third_spec);

    std::vector<BlendPick> delivered = Sequence(*first, 0, t0);
    const std::vector<BlendPick> middle = Sequence(*second, t0, t1 - t0);
    delivered.insert(delivered.end(), middle.begin(), middle.end());
    const std::vector<BlendPick> last = Sequence(*third, t1, 40000);
    delivered.insert(delivered.end(), last.begin(), last.end());
    ExpectNoRepeatNoSkip(delivered, kSizes);

    // The third blend replays the whole history itself, at random places too.
    const std::vector<BlendPick> whole = Sequence(*third, 0, delivered.size());
    ASSERT_TRUE(whole == delivered) << "t0 " << t0 << " t1 " << t1;
    const uint64_t t = random() % delivered.size();
    ASSERT_EQ(Make(*third_spec)->At(t), delivered[t]) << t;

    // From t1 on, the source choice is the rule restarted with the new weights.
    auto restarted = Make(Spec(kSizes, {2, 1, 7}));
    const std::vector<BlendPick> fresh = Sequence(*restarted, 0, last.size());
    for (size_t i = 0; i < last.size(); ++i) {
      ASSERT_EQ(last[i].source, fresh[i].source) << i;
    }
  }
}

TEST(BlendTest, RefusesABadSpecNamingTheField) {
  auto refusal = [](BlendSpec spec) {
    absl::StatusOr<std::unique_ptr<Blend>> blend = Blend::Create(std::move(spec));
    EXPECT_EQ(blend.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(blend.status().message());
  };
  EXPECT_EQ(refusal(Spec({}, {})), "sizes is empty; a blend needs a source");
  EXPECT_EQ(refusal(Spec({3, 0}, {1, 1})), "sizes[1] is 0; every source needs a sample");
  EXPECT_EQ(refusal(Spec({3, 4}, {1, 0})),
            "segments[0].weights[1] is 0; each weight must be finite and > 0 (leave a source out "
            "instead)");
  EXPECT_EQ(refusal(Spec({3, 4}, {1, NAN})),
            "segments[0].weights[1] is nan; each weight must be finite and > 0 (leave a source "
            "out instead)");
  EXPECT_EQ(refusal(Spec({3, 4}, {1})),
            "segments[0].weights has 1 entries; the blend has 2 sources");
  BlendSpec spec = Spec({3, 4}, {1, 1});
  spec.segments.push_back(BlendSegment{10, {1, 2}, {6, 5}});
  EXPECT_EQ(refusal(spec),
            "segments[1].ledger grows by 11 samples in all; 10 samples lie between it and the "
            "ledger before (its counts must add up)");
  spec.segments[1].start = 0;
  EXPECT_THAT(refusal(spec), HasSubstr("segments[1].start is 0; starts must increase"));
  spec.segments.erase(spec.segments.begin());
  EXPECT_EQ(refusal(spec), "segments[0].ledger is not all zero");

  auto blend = Make(Spec({3, 4}, {1, 1}));
  const std::vector<uint64_t> short_ledger = {1};
  EXPECT_EQ(blend->AddAnchor(5, short_ledger).message(),
            "the ledger has 1 counts; the blend has 2 sources");
  const std::vector<uint64_t> wrong_sum = {1, 1};
  EXPECT_EQ(blend->AddAnchor(5, wrong_sum).message(),
            "the ledger grows by 2 samples in all; 5 samples lie between it and the ledger "
            "before (its counts must add up)");
  EXPECT_EQ(blend->WithWeightsAt(5, {1, -1}).status().message(),
            "segments[1].weights[1] is -1; each weight must be finite and > 0 (leave a source "
            "out instead)");
}

}  // namespace
}  // namespace gpufeed::server
