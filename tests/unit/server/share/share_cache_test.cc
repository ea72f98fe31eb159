#include "server/share/share_cache.h"

#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

constexpr uint64_t kEntry = 1024;

// An image whose entry costs exactly kEntry bytes (pixels plus the entry overhead), its
// pixels all `fill`.
std::shared_ptr<const Image> ImageOf(uint8_t fill = 7, uint64_t bytes = kEntry) {
  auto image = std::make_shared<Image>();
  image->height = 1;
  image->width = static_cast<int>((bytes - ShareCache::kEntryOverhead) / 3);
  image->rgb.assign(bytes - ShareCache::kEntryOverhead, fill);
  return image;
}

ShareCache::Member JoinAt(ShareCache& cache, const std::string& key, int64_t cursor) {
  absl::StatusOr<ShareCache::Member> m = cache.Join(key, "data", cursor);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

// Claims the one-row batch of sample `id` at position `at`, [at, at + 1) (the cursor moves to
// at + 1 where it was at `at`): the found sample's first byte, or -1 for a miss.
int ClaimOne(ShareCache::Member& m, int64_t id, int64_t at) {
  const int64_t ids[] = {id};
  const std::vector<ShareCache::Row> got = m.Claim(ids, at, at + 1);
  return got[0].found == nullptr ? -1 : got[0].found->rgb[0];
}

// A job alone keeps its decodes while there is room: a job that joins later reads them.
TEST(ShareCacheTest, AMemberAloneFillsTheCacheForJobsToCome) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member solo = JoinAt(cache, "g", 0);
  EXPECT_EQ(ClaimOne(solo, /*id=*/5, /*at=*/0), -1);
  solo.Offer(5, /*at=*/0, ImageOf(4));  // nobody is behind position 0, yet
  ShareCache::Member later = JoinAt(cache, "g", 0);
  EXPECT_EQ(ClaimOne(later, 5, 0), 4);
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.misses, 1u);
  EXPECT_EQ(c.hits, 1u);
  EXPECT_EQ(c.inserts, 1u);
  EXPECT_EQ(c.bypassed, 0u);
  EXPECT_EQ(c.bytes, kEntry);
}

TEST(ShareCacheTest, TheLeaderDecodesForTheOneBehindAndAPassedEntryGoesFirst) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member lead = JoinAt(cache, "g", 100);
  ShareCache::Member trail = JoinAt(cache, "g", 0);
  EXPECT_EQ(ClaimOne(lead, 42, 100), -1);
  lead.Offer(42, 100, ImageOf(9));
  EXPECT_EQ(cache.counters().inserts, 1u);
  EXPECT_EQ(cache.counters().bytes, kEntry);
  EXPECT_EQ(cache.counters().entries, 1u);
  trail.Advance(100);
  EXPECT_EQ(ClaimOne(trail, 42, 100), 9);
  EXPECT_EQ(cache.counters().hits, 1u);
  // Both members are past position 100: no member reads it now. It stays while there is room,
  // and is the first to go when there is none.
  EXPECT_EQ(cache.counters().entries, 1u);
  EXPECT_EQ(cache.counters().evictions, 0u);
  ShareCache::Member far_behind = JoinAt(cache, "g", -100000);  // wants everything, far ahead
  for (int64_t id = 1; id <= 99; ++id) lead.Offer(100 + id, 101 + id, ImageOf(1));
  EXPECT_EQ(cache.counters().entries, 100u);
  lead.Offer(200, 201, ImageOf(1));
  EXPECT_EQ(cache.counters().evictions, 1u);
  EXPECT_EQ(ClaimOne(far_behind, 42, -100000), -1);  // the passed one went
  EXPECT_EQ(ClaimOne(far_behind, 101, -100000), 1);
}

TEST(ShareCacheTest, AFullCacheKeepsWhatIsReadSoonest) {
  // Members at 0 and 50 read positions 0, 1, ...; room for two entries. Next uses: position 30
  // in 30 (by the member at 0), 60 in 10 (at 50), 40 in 40 (at 0), 55 in 5 (at 50).
  ShareCache cache(2 * kEntry);
  ShareCache::Member a = JoinAt(cache, "g", 0);
  ShareCache::Member b = JoinAt(cache, "g", 50);
  ShareCache::Member lead = JoinAt(cache, "g", 1000);
  lead.Offer(1, 30, ImageOf(1));
  lead.Offer(2, 60, ImageOf(2));
  lead.Offer(3, 40, ImageOf(3));  // farther than both: not kept
  EXPECT_EQ(cache.counters().bypassed, 1u);
  EXPECT_EQ(cache.counters().evictions, 0u);
  lead.Offer(4, 55, ImageOf(4));  // the entry at 30 is now the farthest: it goes
  EXPECT_EQ(cache.counters().evictions, 1u);
  EXPECT_EQ(cache.counters().bytes, 2 * kEntry);
  const int64_t ids[] = {1, 2, 3, 4};
  const std::vector<ShareCache::Row> got = b.Claim(ids, 50, 50);  // b stays at 50
  EXPECT_EQ(got[0].found, nullptr);
  ASSERT_NE(got[1].found, nullptr);
  EXPECT_EQ(got[1].found->rgb[0], 2);
  EXPECT_EQ(got[2].found, nullptr);
  ASSERT_NE(got[3].found, nullptr);
  EXPECT_EQ(got[3].found->rgb[0], 4);
  EXPECT_TRUE(got[0].wanted);  // position 50: b is there
  EXPECT_FALSE(got[1].wanted);  // found
}

TEST(ShareCacheTest, AStalledMembersEntriesAreTheFarthest) {
  // The member at 0 has stalled; the one at 500 keeps reading. What only the stalled member
  // will read is farther than what the one at 500 reads next, so it goes first.
  ShareCache cache(2 * kEntry);
  ShareCache::Member stalled = JoinAt(cache, "g", 0);
  ShareCache::Member reader = JoinAt(cache, "g", 500);
  ShareCache::Member lead = JoinAt(cache, "g", 2000);
  lead.Offer(1, 400, ImageOf(1));  // in 400, by the stalled member only
  lead.Offer(2, 510, ImageOf(2));  // in 10, by the reader
  lead.Offer(3, 520, ImageOf(3));  // in 20: pushes out the entry at 400
  EXPECT_EQ(cache.counters().evictions, 1u);
  EXPECT_EQ(ClaimOne(reader, 2, 515), 2);
  EXPECT_EQ(ClaimOne(reader, 3, 521), 3);
  EXPECT_EQ(ClaimOne(stalled, 1, 0), -1);
}

TEST(ShareCacheTest, AMemberThatLeavesStopsCountingAtOnce) {
  ShareCache cache(kEntry);  // room for one
  ShareCache::Member lead = JoinAt(cache, "g", 11);
  ShareCache::Member other = JoinAt(cache, "g", 30);
  auto trail = std::make_unique<ShareCache::Member>(JoinAt(cache, "g", 0));
  lead.Offer(1, 10, ImageOf(1));  // in 10, by trail
  lead.Offer(2, 40, ImageOf(2));  // in 10, by other: no nearer, not kept
  EXPECT_EQ(cache.counters().bypassed, 1u);
  EXPECT_EQ(cache.Groups()[0].cursors, (std::vector<int64_t>{0, 11, 30}));
  trail.reset();  // killed: position 10 is read by no member now
  EXPECT_EQ(cache.Groups()[0].cursors, (std::vector<int64_t>{11, 30}));
  lead.Offer(2, 40, ImageOf(2));  // in 10: the entry no member reads goes
  EXPECT_EQ(cache.counters().evictions, 1u);
  EXPECT_EQ(ClaimOne(other, 2, 30), 2);
  EXPECT_EQ(ClaimOne(other, 1, 31), -1);
  const std::vector<ShareGroupInfo> groups = cache.Groups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].key, "g");
  EXPECT_EQ(groups[0].members, 2);
  EXPECT_EQ(groups[0].counters.inserts, 2u);
}

// A sweep run one job after another: the images of a group outlive its last member, for the
// next job of the group; they are read by no member then, so they go first.
TEST(ShareCacheTest, AGroupsImagesOutliveItsLastMemberForTheNextJob) {
  ShareCache cache(2 * kEntry);
  {
    ShareCache::Member first = JoinAt(cache, "g", 0);
    EXPECT_EQ(ClaimOne(first, 1, 0), -1);
    first.Offer(1, 0, ImageOf(5));
  }
  ASSERT_EQ(cache.Groups().size(), 1u);
  EXPECT_EQ(cache.Groups()[0].members, 0);
  EXPECT_EQ(cache.counters().entries, 1u);
  ShareCache::Member next = JoinAt(cache, "g", 0);
  EXPECT_EQ(ClaimOne(next, 1, 0), 5);
  next.Leave();
  // Another group's images, read soon, push the ended group's out; the ended group goes.
  ShareCache::Member other = JoinAt(cache, "h", 0), behind = JoinAt(cache, "h", -5);
  other.Offer(2, 1, ImageOf());
  other.Offer(3, 2, ImageOf());
  EXPECT_EQ(cache.counters().evictions, 1u);
  ASSERT_EQ(cache.Groups().size(), 1u);
  EXPECT_EQ(cache.Groups()[0].key, "h");
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.hits, 1u);  // the ended group's counters stay in the totals
  EXPECT_EQ(c.inserts, 3u);
  EXPECT_EQ(c.entries, 2u);
}

TEST(ShareCacheTest, GroupsAreApartAndShareOneBudget) {
  ShareCache cache(2 * kEntry);
  ShareCache::Member a_lead = JoinAt(cache, "a", 101), a_trail = JoinAt(cache, "a", 0);
  ShareCache::Member b_lead = JoinAt(cache, "b", 101), b_trail = JoinAt(cache, "b", 90);
  a_lead.Offer(7, 100, ImageOf(1));  // in 100
  b_lead.Offer(7, 100, ImageOf(2));  // in 10: the same id in another group
  EXPECT_EQ(ClaimOne(a_trail, 7, 0), 1);
  EXPECT_EQ(ClaimOne(b_trail, 7, 90), 2);
  b_lead.Offer(8, 95, ImageOf(3));  // in 5: group a's entry is the node's farthest
  EXPECT_EQ(cache.counters().evictions, 1u);
  EXPECT_EQ(ClaimOne(a_trail, 7, 0), -1);
  EXPECT_EQ(ClaimOne(b_trail, 8, 90), 3);
  const std::vector<ShareGroupInfo> groups = cache.Groups();
  ASSERT_EQ(groups.size(), 2u);
  for (const ShareGroupInfo& g : groups) {
    EXPECT_EQ(g.counters.evictions, g.key == "a" ? 1u : 0u) << g.key;
    EXPECT_EQ(g.counters.entries, g.key == "a" ? 0u : 2u) << g.key;
  }
}

TEST(ShareCacheTest, AGroupReadsOneDatasetInOneOrder) {
  ShareCache cache(kEntry);
  absl::StatusOr<ShareCache::Member> a = cache.Join("uid 5/sweep", "/data/a (1000 samples)", 0);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<ShareCache::Member> b = cache.Join("uid 5/sweep", "/data/b (10 samples)", 0);
  EXPECT_EQ(b.status(),
            absl::FailedPreconditionError(
                "the group reads /data/a (1000 samples); this job reads /data/b (10 samples): the "
                "jobs of a group read one dataset in one order"));
  a->Leave();  // the group ends with its last member: another dataset may take the name
  EXPECT_TRUE(cache.Join("uid 5/sweep", "/data/b (10 samples)", 0).ok());
}

// A session fills several batches at once: its cursor passes a batch only once every batch
// before it is claimed, so the entries of an earlier batch still being filled stay near.
TEST(ShareCacheTest, ClaimsOutOfOrderMoveTheCursorOnlyPastClaimedBatches) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member lead = JoinAt(cache, "g", 100), m = JoinAt(cache, "g", 0);
  lead.Offer(1, 5, ImageOf(1));
  lead.Offer(2, 15, ImageOf(2));
  lead.Offer(3, 25, ImageOf(3));
  auto cursors = [&] { return cache.Groups()[0].cursors; };
  const int64_t ids[] = {2};
  EXPECT_EQ(m.Claim(ids, 10, 20)[0].found->rgb[0], 2);  // batch [10, 20) before [0, 10)
  EXPECT_EQ(cursors(), (std::vector<int64_t>{0, 100}));  // not past [0, 10) yet
  const int64_t ids0[] = {1};
  EXPECT_EQ(m.Claim(ids0, 0, 10)[0].found->rgb[0], 1);
  EXPECT_EQ(cursors(), (std::vector<int64_t>{20, 100}));  // past both
  const int64_t ids3[] = {3};
  EXPECT_EQ(m.Claim(ids3, 30, 40)[0].found->rgb[0], 3);  // [20, 30) not claimed yet
  EXPECT_EQ(cursors(), (std::vector<int64_t>{20, 100}));
  EXPECT_EQ(m.Claim(ids3, 20, 30)[0].found->rgb[0], 3);
  EXPECT_EQ(cursors(), (std::vector<int64_t>{40, 100}));
}

TEST(ShareCacheTest, AnEntryLargerThanTheBudgetIsNotKept) {
  ShareCache cache(kEntry);
  ShareCache::Member lead = JoinAt(cache, "g", 11), trail = JoinAt(cache, "g", 0);
  lead.Offer(1, 10, ImageOf(7, 2 * kEntry));
  EXPECT_EQ(cache.counters().bypassed, 1u);
  EXPECT_EQ(cache.counters().bytes, 0u);
}

TEST(ShareCacheTest, AResumeAtAnOldPositionMakesLaterEntriesUseful) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member a = JoinAt(cache, "g", 50), b = JoinAt(cache, "g", 71);
  b.Offer(1, 70, ImageOf(3));  // in 20, by a
  b.Advance(0);                // b resumes from the epoch's start
  a.Advance(71);               // a passes it; b is still behind it
  EXPECT_EQ(cache.counters().entries, 1u);
  b.Advance(70);
  EXPECT_EQ(ClaimOne(b, 1, 70), 3);
  EXPECT_EQ(cache.Groups()[0].cursors, (std::vector<int64_t>{71, 71}));
}

// Four members 50 positions apart read 2,000 positions each in lockstep, the leader first
// (id = position). With room for the 150 positions between the last and the first (what all
// have passed goes first), each
// sample is decoded once: the leader misses, the others hit. Decodes per read: 1/4.
TEST(ShareCacheTest, MembersInLockstepDecodeEachSampleOnce) {
  constexpr int kMembers = 4, kLength = 2000, kGap = 50;
  ShareCache cache(160 * kEntry);
  std::vector<ShareCache::Member> members;
  for (int t = 0; t < kMembers; ++t) members.push_back(JoinAt(cache, "g", (kMembers - 1 - t) * kGap));
  std::vector<int> hits(kMembers, 0);
  for (int step = 0; step < kLength; ++step) {
    for (int t = 0; t < kMembers; ++t) {
      const int64_t at = (kMembers - 1 - t) * kGap + step;
      const int64_t ids[] = {at};
      if (members[t].Claim(ids, at, at + 1)[0].found != nullptr) {
        ++hits[t];
      } else {
        members[t].Offer(ids[0], at, ImageOf());
      }
      ASSERT_LE(cache.counters().bytes, cache.budget_bytes());
    }
  }
  // A trailing member misses only the positions before the next member's start.
  EXPECT_EQ(hits, (std::vector<int>{0, kLength - kGap, kLength - kGap, kLength - kGap}));
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.misses, uint64_t{kLength + 3 * kGap});  // the leader's, and each other's first 50
  members.clear();  // the images stay for the group's next job
  ASSERT_EQ(cache.Groups().size(), 1u);
  EXPECT_EQ(cache.Groups()[0].members, 0);
  EXPECT_EQ(cache.counters().bytes, cache.budget_bytes());
}

// Threads at their own pace (a trailing member may pass the one ahead): the counters add up
// and the budget holds whatever the interleaving.
TEST(ShareCacheTest, ConcurrentMembersStayInBudget) {
  constexpr int kMembers = 4, kLength = 2000;
  ShareCache cache(64 * kEntry);
  std::vector<ShareCache::Member> members;
  for (int t = 0; t < kMembers; ++t) members.push_back(JoinAt(cache, "g", t * 50));
  std::vector<std::thread> threads;
  for (int t = 0; t < kMembers; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t at = t * 50; at < t * 50 + kLength; ++at) {
        const int64_t ids[] = {at};
        if (members[t].Claim(ids, at, at + 1)[0].found == nullptr) {
          members[t].Offer(ids[0], at, ImageOf());
        }
        EXPECT_LE(cache.counters().bytes, cache.budget_bytes());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.hits + c.misses, uint64_t{kMembers} * kLength);
  // Every miss was offered once: kept, not kept, or another member's came first.
  EXPECT_EQ(c.inserts + c.bypassed + c.raced, c.misses);
  members.clear();
  EXPECT_EQ(cache.Groups()[0].members, 0);
  EXPECT_LE(cache.counters().bytes, cache.budget_bytes());
}

// Members in lockstep claim the same sample before either offers it: they share one decode in
// flight. The first row to start decodes; the other takes its image; a failed decode leaves
// the sample to be claimed anew.
TEST(ShareCacheTest, MembersThatClaimASampleAtOnceShareOneDecode) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member a = JoinAt(cache, "g", 0), b = JoinAt(cache, "g", 0);
  const int64_t ids[] = {7, 8};
  std::vector<ShareCache::Row> ra = a.Claim(ids, 0, 2), rb = b.Claim(ids, 0, 2);
  ASSERT_NE(ra[0].pending, nullptr);
  EXPECT_EQ(ra[0].pending, rb[0].pending);
  EXPECT_EQ(cache.counters().misses, 4u);
  // b's row starts first; a's row waits for it on another thread.
  ASSERT_TRUE(rb[0].pending->TryStart());
  EXPECT_FALSE(ra[0].pending->TryStart());
  std::shared_ptr<const Image> waited;
  std::thread waiter([&] { waited = ra[0].pending->Wait(absl::Seconds(30)); });
  const std::shared_ptr<const Image> decoded = ImageOf(3);
  rb[0].pending->Finish(decoded);
  waiter.join();
  EXPECT_EQ(waited, decoded);
  // Decoded and not yet offered: a later claim finds it.
  ShareCache::Member c = JoinAt(cache, "g", 0);
  EXPECT_EQ(ClaimOne(c, 7, 0), 3);
  b.Offer(7, 0, decoded);
  EXPECT_EQ(cache.counters().inserts, 1u);
  // Sample 8's decode fails: the waiter gets nothing, and the next claim starts anew.
  ASSERT_TRUE(ra[1].pending->TryStart());
  ra[1].pending->Finish(nullptr);
  EXPECT_EQ(rb[1].pending->Wait(absl::Seconds(30)), nullptr);
  const int64_t eight[] = {8};
  std::vector<ShareCache::Row> again = c.Claim(eight, 1, 2);
  ASSERT_NE(again[0].pending, nullptr);
  EXPECT_NE(again[0].pending, ra[1].pending);
  EXPECT_TRUE(again[0].pending->TryStart());
  // A wait for a decode nobody finishes ends at its timeout, with nothing.
  const absl::Time start = absl::Now();
  EXPECT_EQ(again[0].pending->Wait(absl::Milliseconds(50)), nullptr);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
}

// The map of decodes in flight holds only rows of fills in progress: a fill that ends, done or
// not (a deadline, an error: rows never started), lets go of its rows, and a decode no row
// shares any more leaves the map; a member that ends lets go of what it still held.
TEST(ShareCacheTest, DecodesInFlightLastOnlyAsLongAsTheFillsThatShareThem) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member a = JoinAt(cache, "g", 0), b = JoinAt(cache, "g", 0);
  auto pending = [&] { return cache.Groups()[0].pending; };
  const int64_t ids[] = {1, 2, 3};
  const std::vector<ShareCache::Row> ra = a.Claim(ids, 0, 3);
  const int64_t two[] = {2, 3};
  const std::vector<ShareCache::Row> rb = b.Claim(two, 1, 3);
  EXPECT_EQ(pending(), 3);
  ASSERT_TRUE(ra[0].pending->TryStart());  // a's fill decodes sample 1, then fails
  ra[0].pending->Finish(nullptr);
  a.EndFill({{ra[0].pending, ra[1].pending, ra[2].pending}});
  EXPECT_EQ(pending(), 2);  // 2 and 3: b's rows still share them
  b.EndFill({{rb[0].pending, rb[1].pending}});
  EXPECT_EQ(pending(), 0);
  // A member that ends mid-fill lets go at once; another member's EndFill after it is a no-op
  // for what it held.
  const std::vector<ShareCache::Row> again = b.Claim(ids, 3, 6);
  EXPECT_EQ(pending(), 3);
  b.Leave();
  EXPECT_EQ(pending(), 0);
  b.EndFill({{again[0].pending}});
  EXPECT_EQ(cache.Groups()[0].members, 1);
}

// A member holds at most max_in_flight rows of decodes in flight: past it a miss decodes for
// itself alone (counted unshared), so no member grows the map past its own batches.
TEST(ShareCacheTest, AMemberHoldsAtMostItsCapOfDecodesInFlight) {
  ShareCache cache(100 * kEntry);
  absl::StatusOr<ShareCache::Member> m = cache.Join("g", "data", 0, {.uid = 0, .max_in_flight = 2});
  ASSERT_TRUE(m.ok());
  const int64_t ids[] = {1, 2, 3, 4};
  const std::vector<ShareCache::Row> rows = m->Claim(ids, 0, 4);
  EXPECT_NE(rows[1].pending, nullptr);
  EXPECT_EQ(rows[2].pending, nullptr);
  EXPECT_EQ(rows[3].pending, nullptr);
  EXPECT_TRUE(rows[3].wanted);  // still decoded whole and offered
  ShareGroupInfo g = cache.Groups()[0];
  EXPECT_EQ(g.pending, 2);
  EXPECT_EQ(g.counters.misses, 4u);
  EXPECT_EQ(g.counters.unshared, 2u);
  m->EndFill({{rows[0].pending, rows[1].pending}});
  const int64_t more[] = {5, 6, 7};
  EXPECT_NE(m->Claim(more, 4, 7)[1].pending, nullptr);  // room again
  EXPECT_EQ(cache.Groups()[0].pending, 2);
}

// Across uids, a decode made for another uid comes marked check_read, in the cache and in
// flight; one made for the member's own uid does not.
TEST(ShareCacheTest, ADecodeMadeForAnotherUidIsMarkedForAReadCheck) {
  ShareCache cache(100 * kEntry);
  ShareCache::Member a = *cache.Join("uid */g", "data", 0, {.uid = 1001});
  ShareCache::Member a2 = *cache.Join("uid */g", "data", 0, {.uid = 1001});
  ShareCache::Member b = *cache.Join("uid */g", "data", 0, {.uid = 1002});
  const int64_t one[] = {1};
  const std::vector<ShareCache::Row> ra = a.Claim(one, 0, 1);
  ASSERT_TRUE(ra[0].pending->TryStart(1001));
  ra[0].pending->Finish(ImageOf(5));
  EXPECT_EQ(ra[0].pending->decoder_uid(), 1001u);
  // Decoded, not offered yet: found in flight.
  std::vector<ShareCache::Row> rb = b.Claim(one, 0, 1), ra2 = a2.Claim(one, 0, 1);
  ASSERT_NE(rb[0].found, nullptr);
  EXPECT_TRUE(rb[0].check_read);
  ASSERT_NE(ra2[0].found, nullptr);
  EXPECT_FALSE(ra2[0].check_read);
  a.Offer(1, 0, ra[0].pending->image());
  a.EndFill({{ra[0].pending}});
  rb = b.Claim(one, 1, 2);
  ra2 = a2.Claim(one, 1, 2);
  EXPECT_TRUE(rb[0].check_read);
  EXPECT_FALSE(ra2[0].check_read);
  b.EndFill({.pending = {}, .read_checks_passed = 1, .read_checks_refused = 1});
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.read_checks_passed, 1u);
  EXPECT_EQ(c.read_checks_refused, 1u);
}

}  // namespace
}  // namespace gpufeed::server
