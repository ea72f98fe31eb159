// The job registry (server/session/job_registry.h): one feed per job, each rank once, jobs
// namespaced by uid; directly and through the manager.
#include "server/session/job_registry.h"

#include <string>

#include "tests/unit/server/session/session_manager_fixture.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

TEST_F(SessionManagerTest, AttachSameJobAndRankTwiceIsAlreadyExists) {
  StartManager();
  absl::StatusOr<Attachment> first = manager_->Attach(Spec());
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t free_after_first = pool_->free_bytes();
  const absl::Status s = manager_->Attach(Spec()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("'train' rank 0"));
  EXPECT_EQ(pool_->free_bytes(), free_after_first);
  EXPECT_EQ(manager_->num_sessions(), 1);
  // The same rank of another job is fine.
  AttachSpec other = Spec();
  other.job = "eval";
  EXPECT_TRUE(manager_->Attach(other).ok());
}

TEST_F(SessionManagerTest, RanksOfAJobMustAgreeOnTheFeed) {
  StartManager();
  ASSERT_TRUE(manager_->Attach(Spec()).ok());
  AttachSpec rank1 = Spec();
  rank1.rank = 1;
  rank1.feed.batch_size = 8;
  const absl::Status s = manager_->Attach(rank1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("job 'train'"));
  EXPECT_THAT(s.message(), HasSubstr("batch_size=8"));
  EXPECT_EQ(manager_->num_sessions(), 1);
  // With the same feed it attaches, and both share one feed.
  rank1.feed.batch_size = 4;
  absl::StatusOr<Attachment> a1 = manager_->Attach(rank1);
  ASSERT_TRUE(a1.ok()) << a1.status();
  const std::vector<FeedSnapshot> feeds = manager_->ListFeeds();
  ASSERT_EQ(feeds.size(), 1u);
  EXPECT_EQ(feeds[0].sessions, 2);
  EXPECT_EQ(feeds[0].key, a1->feed_key);
  EXPECT_EQ(feeds[0].num_samples, 100u);
}

TEST_F(SessionManagerTest, RanksNamingTheSameFileDifferentlyShareTheJob) {
  // The job check once compared the paths as given while the feed registry resolves them,
  // so rank 1 naming the same file as "..././tokens.bin" was refused.
  StartManager();
  absl::StatusOr<Attachment> a0 = manager_->Attach(Spec());
  ASSERT_TRUE(a0.ok()) << a0.status();
  AttachSpec rank1 = Spec();
  rank1.rank = 1;
  rank1.feed.dataset.path = dir_.path() + "/./tokens.bin";
  absl::StatusOr<Attachment> a1 = manager_->Attach(rank1);
  ASSERT_TRUE(a1.ok()) << a1.status();
  EXPECT_EQ(a1->feed_key, a0->feed_key);
  // Through a symlink too.
  ASSERT_EQ(::symlink(path_.c_str(), dir_.Join("link.bin").c_str()), 0);
  AttachSpec other = Spec();
  other.job = "other";
  other.feed.dataset.path = dir_.Join("link.bin");
  absl::StatusOr<Attachment> a2 = manager_->Attach(other);
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_EQ(a2->feed_key, a0->feed_key);
  EXPECT_EQ(manager_->ListFeeds().size(), 1u);
  // The same (job, rank) by another name is still the same rank.
  AttachSpec again = Spec();
  again.feed.dataset.path = dir_.Join("link.bin");
  EXPECT_EQ(manager_->Attach(again).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(SessionManagerTest, JobsAreNamespacedByTheOwnersUid) {
  StartManager();
  ASSERT_TRUE(manager_->Attach(SpecOf(Spec(), 1000)).ok());
  // The same job and rank of another uid is another job: no squatting...
  absl::StatusOr<Attachment> other = manager_->Attach(SpecOf(Spec(), 1001));
  ASSERT_TRUE(other.ok()) << other.status();
  // ...even with a different feed, which within one uid's job is refused.
  AttachSpec reseeded = Spec();
  reseeded.feed.seed = 99;
  reseeded.rank = 1;
  EXPECT_TRUE(manager_->Attach(SpecOf(reseeded, 1002)).ok());
  const absl::Status mismatch = manager_->Attach(SpecOf(reseeded, 1000)).status();
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kFailedPrecondition) << mismatch;
  EXPECT_THAT(mismatch.message(),
              HasSubstr("job 'train' is attached with another feed: seed=99 (the job's: "));
  const absl::Status twice = manager_->Attach(SpecOf(Spec(), 1001)).status();
  EXPECT_EQ(twice.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(twice.message(),
            "job 'train' rank 0 is already attached; to run another job beside it, give that "
            "one another name (job=)");
  // Detaching uid 1001's rank frees only uid 1001's (job, rank).
  ASSERT_TRUE(manager_->Detach(other->session_id, other->token, AsUid(1001)).ok());
  EXPECT_TRUE(manager_->Attach(SpecOf(Spec(), 1001)).ok());
  EXPECT_EQ(manager_->Attach(SpecOf(Spec(), 1000)).status().code(),
            absl::StatusCode::kAlreadyExists);
}

JobMember Member(uint32_t uid, const std::string& job, int32_t rank,
                 const std::string& canonical = "kind=tokens;batch_size=4;seed=1",
                 const std::string& feed_key = "feed-a") {
  return JobMember{uid, job, rank, canonical, feed_key};
}

TEST(JobRegistryTest, RanksJoinOnceAndLeaveTheJobWhenTheLastGoes) {
  JobRegistry jobs;
  EXPECT_TRUE(jobs.CheckJoin(Member(1000, "train", 0)).ok());
  jobs.Join(Member(1000, "train", 0));
  EXPECT_EQ(jobs.size(), 1u);
  const absl::Status twice = jobs.CheckJoin(Member(1000, "train", 0));
  EXPECT_EQ(twice.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(twice.message(),
            "job 'train' rank 0 is already attached; to run another job beside it, give that "
            "one another name (job=)");
  EXPECT_TRUE(jobs.CheckJoin(Member(1000, "train", 1)).ok());
  jobs.Join(Member(1000, "train", 1));
  // Another uid's job of the same name is another job.
  EXPECT_TRUE(jobs.CheckJoin(Member(1001, "train", 0, "other", "feed-b")).ok());
  jobs.Leave(1000, "train", 0);
  EXPECT_TRUE(jobs.CheckJoin(Member(1000, "train", 0)).ok());
  EXPECT_EQ(jobs.size(), 1u);
  jobs.Leave(1000, "train", 1);
  EXPECT_EQ(jobs.size(), 0u);
  // With no rank left the job is forgotten: another feed may take its name.
  EXPECT_TRUE(jobs.CheckJoin(Member(1000, "train", 0, "other", "feed-b")).ok());
  jobs.Leave(1000, "train", 5);  // never joined: nothing happens
  jobs.Join(Member(1000, "train", 0));
  jobs.Clear();
  EXPECT_EQ(jobs.size(), 0u);
}

TEST(JobRegistryTest, AnotherFeedIsRefusedNamingWhatDiffers) {
  JobRegistry jobs;
  jobs.Join(Member(1000, "train", 0));
  const absl::Status s =
      jobs.CheckJoin(Member(1000, "train", 1, "kind=tokens;batch_size=8;seed=1;shuffle=true"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "job 'train' is attached with another feed: batch_size=8 (the job's: 4), "
            "shuffle=true (the job's: (none)); rank 1 asked for "
            "{kind=tokens;batch_size=8;seed=1;shuffle=true}: every rank of a job must use the "
            "same dataset and sampling; to run another job beside it, give that one another "
            "name (job=)");
  // The same text over another opened file (another inode: another feed key).
  const absl::Status file =
      jobs.CheckJoin(Member(1000, "train", 1, "kind=tokens;batch_size=4;seed=1", "feed-b"));
  EXPECT_EQ(file.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(file.message(), HasSubstr("is attached with another feed: another dataset file "
                                        "under the same path; rank 1 asked for {"));
  // The feed check comes first: a taken rank with another feed is a feed mismatch.
  EXPECT_EQ(jobs.CheckJoin(Member(1000, "train", 0, "kind=records")).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gpufeed::server
