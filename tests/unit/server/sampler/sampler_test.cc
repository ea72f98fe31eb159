#include "server/sampler/sampler.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/printers.h"

namespace gpufeed::server {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::unique_ptr<Sampler> MakeSampler(uint64_t n, int64_t b, int32_t w, uint64_t seed, bool shuffle,
                                     bool drop_last, bool even = false) {
  SamplerConfig c;
  c.num_samples = n;
  c.batch_size = b;
  c.world_size = w;
  c.seed = seed;
  c.shuffle = shuffle;
  c.drop_last = drop_last;
  c.even = even;
  absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(c);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// A config without drop_last (as even needs), with or without the even split.
SamplerConfig PaddedConfig(uint64_t n, int64_t b, int32_t w, uint64_t seed, bool even) {
  SamplerConfig c;
  c.num_samples = n;
  c.batch_size = b;
  c.world_size = w;
  c.seed = seed;
  c.drop_last = false;
  c.even = even;
  return c;
}

struct Slice {
  std::vector<int64_t> ids;
  int64_t valid = 0;
};

Slice SliceOf(const Sampler& s, Position p, int32_t rank) {
  Slice out;
  out.ids.assign(static_cast<size_t>(s.config().batch_size), -1);
  out.valid = s.RankSlice(p, rank, std::span<int64_t>(out.ids));
  return out;
}

// Every id, rank-major, of every step of a run of `steps` positions from `from`.
std::vector<int64_t> IdsOfRun(const Sampler& s, Position from, int64_t steps) {
  std::vector<int64_t> out;
  Position p = from;
  for (int64_t i = 0; i < steps; ++i) {
    for (int32_t r = 0; r < s.config().world_size; ++r) {
      Slice slice = SliceOf(s, p, r);
      out.insert(out.end(), slice.ids.begin(), slice.ids.end());
    }
    p = s.Next(p);
  }
  return out;
}

bool IsPermutation(const std::vector<uint64_t>& perm, uint64_t n) {
  if (perm.size() != n) return false;
  std::vector<bool> seen(n, false);
  for (uint64_t v : perm) {
    if (v >= n || seen[v]) return false;
    seen[v] = true;
  }
  return true;
}

// ---- the partition contract over (W, N, B, drop_last) ----

class SamplerPartitionTest
    : public ::testing::TestWithParam<std::tuple<int32_t, std::pair<uint64_t, int64_t>, bool>> {};

TEST_P(SamplerPartitionTest, EveryEpochVisitsEachSampleExactlyOnce) {
  const int32_t w = std::get<0>(GetParam());
  const uint64_t n = std::get<1>(GetParam()).first;
  const int64_t b = std::get<1>(GetParam()).second;
  const bool drop_last = std::get<2>(GetParam());
  const uint64_t global = static_cast<uint64_t>(w) * static_cast<uint64_t>(b);
  if (drop_last && global > n) {
    // No full step per epoch: refused, naming the field.
    SamplerConfig c{n, b, w, 7, true, drop_last};
    absl::StatusOr<std::unique_ptr<Sampler>> refused = Sampler::Create(c);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("batch_size"));
    return;
  }

  std::unique_ptr<Sampler> s = MakeSampler(n, b, w, /*seed=*/7, true, drop_last);
  ASSERT_NE(s, nullptr);
  const int64_t expected_steps =
      static_cast<int64_t>(drop_last ? n / global : (n + global - 1) / global);
  ASSERT_EQ(s->steps_per_epoch(), expected_steps);

  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    SCOPED_TRACE(absl::StrCat("epoch ", epoch));
    const std::vector<uint64_t> perm = EpochPermutation(n, 7, epoch, true);
    std::vector<int64_t> valid_ids;
    for (int64_t step = 0; step < s->steps_per_epoch(); ++step) {
      for (int32_t r = 0; r < w; ++r) {
        Slice slice = SliceOf(*s, Position{epoch, step}, r);
        // Rows are perm[(g*W + r)*B + i], wrapping to the epoch's start (perm[i mod N]).
        int64_t expected_valid = 0;
        for (int64_t i = 0; i < b; ++i) {
          const uint64_t index = (static_cast<uint64_t>(step) * w + r) * b + i;
          ASSERT_EQ(slice.ids[i], static_cast<int64_t>(perm[index % n]))
              << "step " << step << " rank " << r << " row " << i;
          if (index < n) ++expected_valid;
          // Valid rows are a prefix of the slice: row i is valid iff it is not padding.
          ASSERT_EQ(i < slice.valid, index < n) << "step " << step << " rank " << r << " row " << i;
        }
        ASSERT_EQ(slice.valid, expected_valid) << "step " << step << " rank " << r;
        valid_ids.insert(valid_ids.end(), slice.ids.begin(), slice.ids.begin() + slice.valid);
        if (drop_last) {
          ASSERT_EQ(slice.valid, b);
        }
      }
    }
    if (drop_last) {
      // Exactly the first steps*W*B entries of the permutation, no duplicates.
      const uint64_t used = static_cast<uint64_t>(s->steps_per_epoch()) * global;
      ASSERT_EQ(valid_ids.size(), used);
      std::vector<int64_t> expected(perm.begin(), perm.begin() + static_cast<int64_t>(used));
      std::set<int64_t> unique(valid_ids.begin(), valid_ids.end());
      EXPECT_EQ(unique.size(), used);
      std::sort(valid_ids.begin(), valid_ids.end());
      std::sort(expected.begin(), expected.end());
      EXPECT_EQ(valid_ids, expected);
    } else {
      // Exactly each sample once.
      ASSERT_EQ(valid_ids.size(), n);
      std::sort(valid_ids.begin(), valid_ids.end());
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(valid_ids[i], static_cast<int64_t>(i));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SamplerPartitionTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 8),
                       ::testing::Values(std::make_pair(uint64_t{96}, int64_t{4}),   // divides
                                         std::make_pair(uint64_t{100}, int64_t{3}),  // remainder
                                         std::make_pair(uint64_t{37}, int64_t{5}),   // prime N
                                         std::make_pair(uint64_t{10}, int64_t{4}),   // W*B > N
                                         std::make_pair(uint64_t{1}, int64_t{1})),
                       ::testing::Bool()),
    [](const auto& info) {
      return absl::StrCat("W", std::get<0>(info.param), "_N", std::get<1>(info.param).first, "_B",
                          std::get<1>(info.param).second,
                          std::get<2>(info.param) ? "_drop" : "_pad");
    });

TEST(SamplerTest, PaddingWrapsToTheEpochStart) {
  // N=10, W=2, B=4: 2 steps; step 1 holds perm[8..15]: rank 0 gets perm[8], perm[9] then
  // perm[0], perm[1]; rank 1 gets perm[4..7]... wrapped: perm[2], perm[3], perm[4], perm[5].
  std::unique_ptr<Sampler> s = MakeSampler(10, 4, 2, 3, true, /*drop_last=*/false);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->steps_per_epoch(), 2);
  const std::vector<uint64_t> p = EpochPermutation(10, 3, 0, true);
  auto id = [&](size_t i) { return static_cast<int64_t>(p[i]); };
  Slice r0 = SliceOf(*s, {0, 1}, 0);
  Slice r1 = SliceOf(*s, {0, 1}, 1);
  EXPECT_EQ(r0.valid, 2);
  EXPECT_THAT(r0.ids, ElementsAre(id(8), id(9), id(0), id(1)));
  EXPECT_EQ(r1.valid, 0);
  EXPECT_THAT(r1.ids, ElementsAre(id(2), id(3), id(4), id(5)));
}

// Positions name each row's place in the epoch's order: the sample there is the same for
// samplers of one order whatever their batch size, world size or split (sharing groups key
// their cache by it).
TEST(SamplerTest, PositionsAreTheRowsPlacesInTheOrderForEveryLayout) {
  const std::vector<uint64_t> perm = EpochPermutation(103, 7, 2, true);
  for (const auto& [b, w, even] : {std::tuple{int64_t{8}, 1, false}, std::tuple{int64_t{16}, 2, false},
                                   std::tuple{int64_t{10}, 2, true}, std::tuple{int64_t{32}, 1, false}}) {
    std::unique_ptr<Sampler> s = MakeSampler(103, b, w, 7, true, /*drop_last=*/false, even);
    ASSERT_NE(s, nullptr);
    for (int64_t step = 0; step < s->steps_per_epoch(); ++step) {
      const auto [first, end] = s->GlobalBatchSpan({2, step});
      EXPECT_EQ(first, std::min<uint64_t>(103, step * b * w));
      EXPECT_EQ(end, std::min<uint64_t>(103, (step + 1) * b * w));
      for (int32_t rank = 0; rank < w; ++rank) {
        std::vector<int64_t> ids(b);
        std::vector<uint64_t> positions(b);
        s->RankSlice({2, step}, rank, std::span<int64_t>(ids), std::span<uint64_t>(positions));
        for (int64_t i = 0; i < b; ++i) {
          ASSERT_LT(positions[i], 103u);
          EXPECT_EQ(static_cast<uint64_t>(ids[i]), perm[positions[i]])
              << "B=" << b << " W=" << w << " step " << step << " rank " << rank << " row " << i;
        }
      }
    }
  }
  // The last global batch of N=10, W=2, B=4 wraps: rank 0's rows are places 8, 9, 0, 1.
  std::unique_ptr<Sampler> s = MakeSampler(10, 4, 2, 3, true, /*drop_last=*/false);
  std::vector<int64_t> ids(4);
  std::vector<uint64_t> positions(4);
  s->RankSlice({0, 1}, 0, std::span<int64_t>(ids), std::span<uint64_t>(positions));
  EXPECT_THAT(positions, ElementsAre(8, 9, 0, 1));
  EXPECT_EQ(s->GlobalBatchSpan({0, 1}), std::make_pair(uint64_t{8}, uint64_t{10}));
}

// even: DistributedSampler's split. N=103, W=2, B=10: ceil(103/2) = 52 real samples a rank
// (6 steps, the last with 2 valid rows), rank r at epoch positions r, r+2, ..., and one wrapped
// duplicate (position 103 -> perm[0]) to make 104 = 52 x 2.
TEST(SamplerTest, EvenGivesEveryRankTheSameRealCountAsDistributedSampler) {
  SamplerConfig c = PaddedConfig(103, 10, 2, 9, true);
  absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(c);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ((*s)->steps_per_epoch(), 6);
  const std::vector<uint64_t> p = EpochPermutation(103, 9, 0, true);
  std::vector<int64_t> all;
  for (int32_t rank = 0; rank < 2; ++rank) {
    int64_t valid = 0;
    std::vector<int64_t> real;
    for (int64_t step = 0; step < 6; ++step) {
      Slice slice = SliceOf(**s, {0, step}, rank);
      EXPECT_EQ(slice.valid, step < 5 ? 10 : 2) << "rank " << rank << " step " << step;
      for (int64_t i = 0; i < 10; ++i) {
        const uint64_t k = static_cast<uint64_t>(step * 10 + i);
        EXPECT_EQ(slice.ids[static_cast<size_t>(i)],
                  static_cast<int64_t>(p[(k * 2 + static_cast<uint64_t>(rank)) % 103]));
      }
      real.insert(real.end(), slice.ids.begin(), slice.ids.begin() + slice.valid);
      valid += slice.valid;
    }
    EXPECT_EQ(valid, 52) << "rank " << rank;
    all.insert(all.end(), real.begin(), real.end());
  }
  std::sort(all.begin(), all.end());
  std::vector<int64_t> want(103);
  std::iota(want.begin(), want.end(), 0);
  want.push_back(static_cast<int64_t>(p[0]));  // the one wrapped position, 103
  std::sort(want.begin(), want.end());
  EXPECT_EQ(all, want);
  c.drop_last = true;
  absl::StatusOr<std::unique_ptr<Sampler>> refused = Sampler::Create(c);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("even: pads each rank's share"));
}

// even, N a multiple of W: ceil(N/W) = N/W real samples a rank, no wrapped duplicate. N=12,
// W=3, B=5: one step of 5 rows a rank, 4 of them real (mutation testing found per_rank off by
// one here survived: the test above has N % W != 0).
TEST(SamplerTest, EvenWithRanksDividingTheDatasetPadsNothingTwice) {
  SamplerConfig c = PaddedConfig(12, 5, 3, 4, true);
  absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(c);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ((*s)->steps_per_epoch(), 1);
  std::vector<int64_t> real;
  for (int32_t rank = 0; rank < 3; ++rank) {
    Slice slice = SliceOf(**s, {0, 0}, rank);
    EXPECT_EQ(slice.valid, 4) << "rank " << rank;
    real.insert(real.end(), slice.ids.begin(), slice.ids.begin() + slice.valid);
  }
  std::sort(real.begin(), real.end());
  std::vector<int64_t> want(12);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(real, want);
}

// RankSlice writes ids[0, min(B, ids.size())) and nothing past them, in both splits.
TEST(SamplerTest, RankSliceWritesOnlyTheSpanItIsGiven) {
  for (const bool even : {false, true}) {
    absl::StatusOr<std::unique_ptr<Sampler>> s = Sampler::Create(PaddedConfig(23, 4, 2, 1, even));
    ASSERT_TRUE(s.ok()) << s.status();
    const Slice full = SliceOf(**s, {0, 1}, 1);
    std::vector<int64_t> wide(7, -7);  // B + 3: rows past B stay untouched
    EXPECT_EQ((*s)->RankSlice({0, 1}, 1, std::span<int64_t>(wide)), full.valid);
    EXPECT_THAT(wide, ElementsAre(full.ids[0], full.ids[1], full.ids[2], full.ids[3], -7, -7, -7))
        << "even " << even;
    std::vector<int64_t> narrow(5, -7);  // a span of 2 inside it: rows 2.. stay untouched
    (*s)->RankSlice({0, 1}, 1, std::span<int64_t>(narrow).first(2));
    EXPECT_THAT(narrow, ElementsAre(full.ids[0], full.ids[1], -7, -7, -7)) << "even " << even;
  }
}

// The smallest global batch, one sample by one rank: an epoch is N steps of one id each.
TEST(SamplerTest, ABatchOfOneOnOneRankStepsThroughEverySample) {
  const std::unique_ptr<Sampler> s = MakeSampler(5, 1, 1, 3, true, true);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->steps_per_epoch(), 5);
  std::vector<int64_t> ids = IdsOfRun(*s, {0, 0}, 5);
  std::sort(ids.begin(), ids.end());
  EXPECT_THAT(ids, ElementsAre(0, 1, 2, 3, 4));
}

TEST(SamplerTest, StepsPerEpochFloorsWithDropLastAndCeilsWithout) {
  EXPECT_EQ(MakeSampler(100, 3, 8, 0, true, true)->steps_per_epoch(), 4);   // 100/24
  EXPECT_EQ(MakeSampler(100, 3, 8, 0, true, false)->steps_per_epoch(), 5);  // ceil
  EXPECT_EQ(MakeSampler(96, 4, 3, 0, true, true)->steps_per_epoch(), 8);
  EXPECT_EQ(MakeSampler(96, 4, 3, 0, true, false)->steps_per_epoch(), 8);
  EXPECT_EQ(MakeSampler(5, 4, 2, 0, true, false)->steps_per_epoch(), 1);
}

TEST(SamplerTest, SameSeedSameOrderAcrossInstances) {
  std::unique_ptr<Sampler> a = MakeSampler(1000, 8, 4, 1234, true, true);
  std::unique_ptr<Sampler> b = MakeSampler(1000, 8, 4, 1234, true, true);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // Query b in a different order (epoch 1 first) to make sure caching does not matter.
  const std::vector<int64_t> b1 = IdsOfRun(*b, {1, 0}, b->steps_per_epoch());
  const std::vector<int64_t> b0 = IdsOfRun(*b, {0, 0}, b->steps_per_epoch());
  EXPECT_EQ(IdsOfRun(*a, {0, 0}, a->steps_per_epoch()), b0);
  EXPECT_EQ(IdsOfRun(*a, {1, 0}, a->steps_per_epoch()), b1);
}

TEST(SamplerTest, AnotherEpochOrSeedGivesAnotherOrder) {
  const std::vector<uint64_t> base = EpochPermutation(1000, 1234, 0, true);
  EXPECT_NE(EpochPermutation(1000, 1234, 1, true), base);
  EXPECT_NE(EpochPermutation(1000, 1235, 0, true), base);
  EXPECT_NE(EpochPermutation(1000, 1234, 1, true), EpochPermutation(1000, 1235, 0, true));
  EXPECT_EQ(EpochPermutation(1000, 1234, 0, true), base);
  // Through the sampler too.
  std::unique_ptr<Sampler> a = MakeSampler(1000, 10, 2, 1, true, true);
  std::unique_ptr<Sampler> b = MakeSampler(1000, 10, 2, 2, true, true);
  EXPECT_NE(SliceOf(*a, {0, 0}, 0).ids, SliceOf(*a, {1, 0}, 0).ids);
  EXPECT_NE(SliceOf(*a, {0, 0}, 0).ids, SliceOf(*b, {0, 0}, 0).ids);
}

TEST(SamplerTest, NoShuffleIsIdentity) {
  std::vector<uint64_t> identity(50);
  std::iota(identity.begin(), identity.end(), uint64_t{0});
  EXPECT_EQ(EpochPermutation(50, 99, 0, false), identity);
  EXPECT_EQ(EpochPermutation(50, 99, 5, false), identity);
  std::unique_ptr<Sampler> s = MakeSampler(50, 5, 2, 99, /*shuffle=*/false, true);
  ASSERT_NE(s, nullptr);
  EXPECT_THAT(SliceOf(*s, {0, 0}, 0).ids, ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(SliceOf(*s, {0, 0}, 1).ids, ElementsAre(5, 6, 7, 8, 9));
  EXPECT_THAT(SliceOf(*s, {3, 4}, 1).ids, ElementsAre(45, 46, 47, 48, 49));
}

TEST(SamplerTest, EpochPermutationIsAPermutation) {
  for (uint64_t n : {0, 1, 2, 3, 17, 1000, 65537}) {
    for (int64_t epoch : {0, 1, 9}) {
      for (uint64_t seed : {uint64_t{0}, uint64_t{42}, ~uint64_t{0}}) {
        EXPECT_TRUE(IsPermutation(EpochPermutation(n, seed, epoch, true), n))
            << "n=" << n << " epoch=" << epoch << " seed=" << seed;
      }
    }
  }
}

TEST(SamplerTest, EpochPermutationActuallyShuffles) {
  // Not a statistical test, just that a shuffle moves most elements.
  const std::vector<uint64_t> p = EpochPermutation(1000, 42, 0, true);
  int fixed = 0;
  for (uint64_t i = 0; i < p.size(); ++i) fixed += p[i] == i ? 1 : 0;
  EXPECT_LT(fixed, 20);
}

// First 8 entries of EpochPermutation(100, seed=42, epoch=0, shuffle=true), computed once by
// running the generator and hard-coded here on purpose (see GoldenPermutationIsStable). They
// also agree with the independent Python transcription in tests/python/reference.py.
constexpr uint64_t kGoldenPermutation42[8] = {53, 21, 94, 16, 83, 39, 65, 6};

// Users checkpoint (seed, epoch, step) and expect the very same samples after an upgrade:
// these values pin the generator ("feistel1": 4 Feistel rounds keyed by SplitMix64 of
// (seed, epoch), cycle walking). If this test fails, the permutation changed and every user's
// resumed run would silently see other samples. Do not update the numbers unless the change
// is deliberate, announced as breaking, and kSamplerName (the fingerprint's sampler=) changes
// with it.
TEST(SamplerTest, GoldenPermutationIsStable) {
  const std::vector<uint64_t> perm = EpochPermutation(100, /*seed=*/42, /*epoch=*/0, true);
  ASSERT_EQ(perm.size(), 100u);
  EXPECT_THAT(std::vector<uint64_t>(perm.begin(), perm.begin() + 8),
              ElementsAreArray(kGoldenPermutation42));
  EXPECT_THAT(EpochPermutation(10, 3, 0, true), ElementsAre(9, 2, 0, 4, 8, 6, 1, 5, 7, 3));
  const EpochOrder order(1000, 1234, 0, true);
  std::vector<uint64_t> first;
  for (uint64_t i = 0; i < 8; ++i) first.push_back(order.At(i));
  EXPECT_THAT(first, ElementsAre(432, 508, 891, 716, 752, 551, 274, 463));
  EXPECT_STREQ(kSamplerName, "feistel1");
}

// A dataset of 2^40 + 3 samples: 20 bits a half, so cycle walking runs over a domain 4x
// larger than n minus 3. Values from the Python transcription as well.
TEST(SamplerTest, GoldenPermutationOfAHugeDatasetIsStable) {
  const uint64_t n = (uint64_t{1} << 40) + 3;
  const EpochOrder order(n, 42, 0, true);
  EXPECT_EQ(order.At(0), 847031520438u);
  EXPECT_EQ(order.At(1), 491539896703u);
  EXPECT_EQ(order.At(2), 104077952822u);
  EXPECT_EQ(order.At(3), 504542592838u);
  EXPECT_EQ(order.At(n - 1), 307362905394u);
  EXPECT_EQ(order.At(n - 2), 902955081928u);
}

// Every id exactly once, checked exhaustively, for small n, primes, and powers of two +- 1
// (where the domain is exactly n, or has just grown by an even bit count).
TEST(SamplerTest, EpochOrderIsABijectionForManySizes) {
  std::vector<uint64_t> sizes = {1, 2, 3, 4, 5, 6, 7, 11, 13, 97, 101, 257, 1009, 4093, 65521,
                                 1000003};
  for (int k = 1; k <= 20; ++k) {
    const uint64_t p = uint64_t{1} << k;
    sizes.insert(sizes.end(), {p - 1, p, p + 1});
  }
  for (const uint64_t n : sizes) {
    for (const auto& [seed, epoch] : {std::pair<uint64_t, int64_t>{0, 0}, {42, 1},
                                      {~uint64_t{0}, kMaxEpoch}}) {
      const EpochOrder order(n, seed, epoch, true);
      std::vector<bool> seen(n, false);
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t id = order.At(i);
        ASSERT_LT(id, n) << "n=" << n << " seed=" << seed << " epoch=" << epoch << " i=" << i;
        ASSERT_FALSE(seen[id]) << "n=" << n << " seed=" << seed << " epoch=" << epoch
                               << ": id " << id << " twice";
        seen[id] = true;
      }
    }
  }
}

// Near 2^40 an exhaustive check is out of reach: samples of positions give distinct ids in
// range, from the start, the end and the middle of the epoch.
TEST(SamplerTest, EpochOrderNear2To40GivesDistinctIdsInRange) {
  for (const uint64_t n : {(uint64_t{1} << 40) - 1, uint64_t{1} << 40, (uint64_t{1} << 40) + 1,
                           uint64_t{1099511627689}}) {  // the largest prime below 2^40
    const EpochOrder order(n, 7, 3, true);
    std::set<uint64_t> ids;
    for (const uint64_t start : {uint64_t{0}, n / 2, n - 50000}) {
      for (uint64_t i = start; i < start + 50000; ++i) {
        const uint64_t id = order.At(i);
        ASSERT_LT(id, n) << "n=" << n << " i=" << i;
        ids.insert(id);
      }
    }
    EXPECT_EQ(ids.size(), 150000u) << "n=" << n;
  }
}

// A former crash: 2^31 samples (a 4 GiB sparse token file with seq_len 1) made the
// sampler materialise a 2^31-entry permutation. Any position is now computed on its own.
TEST(SamplerTest, HugeDatasetsNeedNoMemoryPerSample) {
  std::unique_ptr<Sampler> s = MakeSampler(uint64_t{1} << 40, 4, 2, 9, true, true);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->steps_per_epoch(), int64_t{1} << 37);
  const Position last{kMaxEpoch, s->steps_per_epoch() - 1};
  Slice a = SliceOf(*s, last, 1);
  EXPECT_EQ(a.valid, 4);
  const EpochOrder order(uint64_t{1} << 40, 9, kMaxEpoch, true);
  const uint64_t first = (uint64_t{1} << 40) - 4;  // rank 1's rows are the epoch's last four
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(a.ids[i], static_cast<int64_t>(order.At(first + i)));
}

TEST(SamplerTest, ResumeFromAnyPositionReproducesTheRest) {
  for (bool drop_last : {true, false}) {
    std::unique_ptr<Sampler> s = MakeSampler(23, 2, 3, 5, true, drop_last);
    ASSERT_NE(s, nullptr);
    const int64_t spe = s->steps_per_epoch();
    const int64_t total = 3 * spe;  // three epochs
    const std::vector<int64_t> full = IdsOfRun(*s, {0, 0}, total);
    const size_t per_step = static_cast<size_t>(s->config().world_size * s->config().batch_size);
    Position p{0, 0};
    for (int64_t k = 0; k < total; ++k) {
      // A fresh sampler, as a restarted daemon would have.
      std::unique_ptr<Sampler> resumed = MakeSampler(23, 2, 3, 5, true, drop_last);
      const std::vector<int64_t> rest = IdsOfRun(*resumed, p, total - k);
      const std::vector<int64_t> expected(full.begin() + static_cast<int64_t>(k * per_step),
                                          full.end());
      ASSERT_EQ(rest, expected) << "resuming at (" << p.epoch << ", " << p.step << ")";
      p = s->Next(p);
    }
    EXPECT_EQ(p, (Position{3, 0}));
  }
}

TEST(SamplerTest, NextWrapsEpochs) {
  std::unique_ptr<Sampler> s = MakeSampler(10, 2, 2, 0, true, true);  // 2 steps
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->steps_per_epoch(), 2);
  EXPECT_EQ(s->Next({0, 0}), (Position{0, 1}));
  EXPECT_EQ(s->Next({0, 1}), (Position{1, 0}));
  EXPECT_EQ(s->Next({7, 1}), (Position{8, 0}));
  std::unique_ptr<Sampler> one = MakeSampler(4, 4, 1, 0, true, true);  // 1 step
  EXPECT_EQ(one->Next({0, 0}), (Position{1, 0}));
}

TEST(SamplerTest, PositionsAreOrdered) {
  EXPECT_LT((Position{0, 5}), (Position{1, 0}));
  EXPECT_LT((Position{1, 0}), (Position{1, 1}));
  EXPECT_EQ((Position{2, 3}), (Position{2, 3}));
}

TEST(SamplerTest, ConcurrentReadersAgree) {
  std::unique_ptr<Sampler> s = MakeSampler(500, 5, 4, 11, true, true);
  ASSERT_NE(s, nullptr);
  std::unique_ptr<Sampler> reference = MakeSampler(500, 5, 4, 11, true, true);
  const std::vector<int64_t> expected = IdsOfRun(*reference, {0, 0}, 4 * s->steps_per_epoch());
  std::vector<std::vector<int64_t>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] { got[t] = IdsOfRun(*s, {0, 0}, 4 * s->steps_per_epoch()); });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

// ---- Create refusals ----

absl::Status CreateStatus(uint64_t n, int64_t b, int32_t w, bool drop_last) {
  SamplerConfig c;
  c.num_samples = n;
  c.batch_size = b;
  c.world_size = w;
  c.drop_last = drop_last;
  return Sampler::Create(c).status();
}

TEST(SamplerCreateTest, RejectsZeroBatchSize) {
  const absl::Status s = CreateStatus(100, 0, 1, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("batch_size"));
  EXPECT_EQ(CreateStatus(100, -3, 1, true).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SamplerCreateTest, RejectsZeroWorldSize) {
  const absl::Status s = CreateStatus(100, 2, 0, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("world_size"));
}

TEST(SamplerCreateTest, RejectsZeroSamples) {
  const absl::Status s = CreateStatus(0, 2, 1, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("samples"));
}

TEST(SamplerCreateTest, RejectsGlobalBatchLargerThanDatasetWithDropLast) {
  const absl::Status s = CreateStatus(10, 4, 3, true);  // 12 > 10
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("batch_size"));
  EXPECT_THAT(s.message(), HasSubstr("12"));
  EXPECT_THAT(s.message(), HasSubstr("10"));
  // Without drop_last the one step is padded instead.
  EXPECT_TRUE(CreateStatus(10, 4, 3, false).ok());
  // Exactly N fits.
  EXPECT_TRUE(CreateStatus(12, 4, 3, true).ok());
}

TEST(SamplerCreateTest, RejectsOverflowingGlobalBatch) {
  const absl::Status s = CreateStatus(100, int64_t{1} << 40, 1 << 30, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overflow"));
}

}  // namespace
}  // namespace gpufeed::server
