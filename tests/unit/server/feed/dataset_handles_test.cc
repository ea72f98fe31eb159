#include "server/feed/dataset_handles.h"

#include <fcntl.h>
#include <unistd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

UniqueFd DevNull() { return UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

// Whether `fd` is open in this process.
bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

class DatasetHandlesTest : public ::testing::Test {
 protected:
  DatasetHandles Make(DatasetHandleOptions options = {}) {
    return DatasetHandles(options, [this] { return now_; });
  }
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

TEST_F(DatasetHandlesTest, AHandleIs32HexDigitsAndTakesItsDescriptorOnce) {
  DatasetHandles handles = Make();
  UniqueFd fd = DevNull();
  const int raw = fd.get();
  absl::StatusOr<std::string> h = handles.Add(std::move(fd), 1000);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_THAT(*h, MatchesRegex("[0-9a-f]{32}"));
  absl::StatusOr<std::string> other = handles.Add(DevNull(), 1000);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*h, *other);

  absl::StatusOr<UniqueFd> taken = handles.Take(*h, 1000);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->get(), raw);  // the very descriptor that was added
  absl::StatusOr<UniqueFd> again = handles.Take(*h, 1000);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.status().message(), HasSubstr("dataset.handle: no such handle"));
  EXPECT_EQ(handles.size(), 1u);
}

TEST_F(DatasetHandlesTest, AnotherUidsHandleIsNotFoundAndStaysForItsOwner) {
  DatasetHandles handles = Make();
  absl::StatusOr<std::string> h = handles.Add(DevNull(), 1000);
  ASSERT_TRUE(h.ok());
  absl::StatusOr<UniqueFd> stolen = handles.Take(*h, 1001);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(stolen.status().message(), HasSubstr("dataset.handle: "));
  EXPECT_TRUE(handles.Take(*h, 1000).ok());
}

// An s3:// dataset's handle carries the caller's access instead of a descriptor: taken once,
// by its uid only, as what it is (a descriptor's Take and an access's TakeAccess refuse each
// other's, spending the handle), expiring as a descriptor's does.
TEST_F(DatasetHandlesTest, AnAccessHandleIsTakenOnceByItsUidAsAnAccess) {
  DatasetHandles handles = Make({.lifetime = absl::Seconds(10)});
  auto access = std::make_shared<objstore::ObjectStoreAccess>();
  access->credentials.access_key_id = "AKIDEXAMPLE";
  access->credentials.secret_access_key = "secret";
  absl::StatusOr<std::string> h = handles.Add(access, 1000);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_THAT(*h, MatchesRegex("[0-9a-f]{32}"));
  EXPECT_EQ(handles.TakeAccess(*h, 1001).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::shared_ptr<const objstore::ObjectStoreAccess>> taken =
      handles.TakeAccess(*h, 1000);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->get(), access.get());
  EXPECT_EQ(handles.TakeAccess(*h, 1000).status().code(), absl::StatusCode::kNotFound);

  absl::StatusOr<std::string> as_fd = handles.Add(access, 1000);
  ASSERT_TRUE(as_fd.ok());
  absl::StatusOr<UniqueFd> wrong = handles.Take(*as_fd, 1000);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("names object store access"));
  EXPECT_EQ(handles.size(), 0u);  // spent
  absl::StatusOr<std::string> fd = handles.Add(DevNull(), 1000);
  ASSERT_TRUE(fd.ok());
  absl::StatusOr<std::shared_ptr<const objstore::ObjectStoreAccess>> not_access =
      handles.TakeAccess(*fd, 1000);
  EXPECT_EQ(not_access.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_access.status().message(), HasSubstr("names an opened file"));

  absl::StatusOr<std::string> expiring = handles.Add(access, 1000);
  ASSERT_TRUE(expiring.ok());
  now_ += absl::Seconds(11);
  EXPECT_EQ(handles.TakeAccess(*expiring, 1000).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(access.use_count(), 2);  // this test's and `taken`'s: the table holds none
}

TEST_F(DatasetHandlesTest, ExpiredHandlesAreDroppedAndTheirDescriptorsClosed) {
  DatasetHandles handles = Make({.lifetime = absl::Seconds(10)});
  UniqueFd fd = DevNull();
  const int raw = fd.get();
  absl::StatusOr<std::string> h = handles.Add(std::move(fd), 1000);
  ASSERT_TRUE(h.ok());
  now_ += absl::Seconds(9);
  absl::StatusOr<std::string> young = handles.Add(DevNull(), 1000);
  ASSERT_TRUE(young.ok());
  EXPECT_TRUE(IsOpen(raw));
  now_ += absl::Seconds(1);  // the first is 10 s old now
  absl::StatusOr<UniqueFd> late = handles.Take(*h, 1000);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(IsOpen(raw));
  EXPECT_TRUE(handles.Take(*young, 1000).ok());
}

// The lifeline (MemRequest.lifeline) is the owner's to take once, apart from the descriptor;
// an expired handle's lifeline is closed with it.
TEST_F(DatasetHandlesTest, ALifelineIsTakenOnceByItsOwnerAndClosedWithAnExpiredHandle) {
  DatasetHandles handles = Make({.lifetime = absl::Seconds(10)});
  UniqueFd line = DevNull();
  const int raw = line.get();
  absl::StatusOr<std::string> h = handles.Add(DevNull(), 1000, std::move(line));
  ASSERT_TRUE(h.ok());
  EXPECT_FALSE(handles.TakeLifeline(*h, 1001).valid());  // another uid's
  UniqueFd taken = handles.TakeLifeline(*h, 1000);
  EXPECT_EQ(taken.get(), raw);
  EXPECT_FALSE(handles.TakeLifeline(*h, 1000).valid());  // once
  EXPECT_TRUE(handles.Take(*h, 1000).ok());              // the descriptor is still there

  UniqueFd other_line = DevNull();
  const int other_raw = other_line.get();
  absl::StatusOr<std::string> expiring = handles.Add(DevNull(), 1000, std::move(other_line));
  ASSERT_TRUE(expiring.ok());
  now_ += absl::Seconds(10);
  EXPECT_FALSE(handles.TakeLifeline(*expiring, 1000).valid());
  EXPECT_EQ(handles.Take(*expiring, 1000).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(IsOpen(other_raw));
}

TEST_F(DatasetHandlesTest, MalformedHandlesAreInvalidArgument) {
  DatasetHandles handles = Make();
  for (const std::string& bad : std::vector<std::string>{"", "abc", std::string(32, 'g'), std::string(32, 'A'),
                                std::string(33, 'a')}) {
    absl::StatusOr<UniqueFd> r = handles.Take(bad, 1000);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("dataset.handle: must be the 32 hex digits"));
  }
}

TEST_F(DatasetHandlesTest, TheTableAndEachUidsShareAreBounded) {
  DatasetHandles handles = Make({.max_handles = 3, .max_per_uid = 2});
  ASSERT_TRUE(handles.Add(DevNull(), 1).ok());
  ASSERT_TRUE(handles.Add(DevNull(), 1).ok());
  absl::StatusOr<std::string> third = handles.Add(DevNull(), 1);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("uid 1 holds 2 dataset handles"));
  ASSERT_TRUE(handles.Add(DevNull(), 2).ok());
  absl::StatusOr<std::string> full = handles.Add(DevNull(), 3);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("gpufeedd holds 3 dataset handles"));
  now_ += absl::Seconds(11);  // all expire: room again
  EXPECT_TRUE(handles.Add(DevNull(), 3).ok());
  EXPECT_EQ(handles.size(), 1u);
}

}  // namespace
}  // namespace gpufeed::server
