// GuardedCopy (common/os/guarded_copy.h): a copy from a mapping of a file that shrank is
// DATA_LOSS, not a crash; a copy of what is there is exact; a SIGBUS outside a copy still
// kills the process.
#include "common/os/guarded_copy.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "common/os/fd.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed {
namespace {

using ::gpufeed::testing::TempDir;

constexpr char kShrankMessage[] = "the mapped file shrank (SIGBUS while reading it)";

// A file of `pages` pages, page i filled with the letter 'a' + i, and a read-only mapping of it.
class GuardedCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    page_ = PageSize();
    for (int i = 0; i < kPages; ++i) contents_ += std::string(page_, static_cast<char>('a' + i));
    path_ = dir_.WriteFile("data.bin", contents_);
    fd_ = UniqueFd(::open(path_.c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(fd_.valid()) << errno;
    absl::StatusOr<Mapping> m = Mapping::Map(fd_.get(), 0, contents_.size(), false);
    ASSERT_TRUE(m.ok()) << m.status();
    mapping_ = std::move(*m);
  }
  const std::byte* at(size_t offset) const { return mapping_.data() + offset; }

  static constexpr int kPages = 3;
  TempDir dir_;
  size_t page_ = 0;
  std::string contents_;
  std::string path_;
  UniqueFd fd_;
  Mapping mapping_;
};

TEST_F(GuardedCopyTest, CopiesWhatIsThereExactly) {
  std::string out(page_ + 10, '\0');
  ASSERT_TRUE(GuardedCopy(out.data(), at(page_ - 5), out.size()).ok());
  EXPECT_EQ(out, contents_.substr(page_ - 5, page_ + 10));
  std::string all(contents_.size(), '\0');
  ASSERT_TRUE(GuardedCopy(all.data(), at(0), all.size()).ok());
  EXPECT_EQ(all, contents_);
}

TEST_F(GuardedCopyTest, NothingToCopyIsOkEvenWithoutASource) {
  char out = 'z';
  EXPECT_TRUE(GuardedCopy(&out, nullptr, 0).ok());
  EXPECT_EQ(out, 'z');
}

TEST_F(GuardedCopyTest, ACopyFromATruncatedFileIsDataLoss) {
  ASSERT_EQ(::ftruncate(fd_.get(), 0), 0);
  std::string out(page_, '\0');
  const absl::Status s = GuardedCopy(out.data(), at(0), out.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), kShrankMessage);
}

// The page that holds the new end of file reads as zeros past it (why readers also check the
// size); only the pages wholly past it fault.
TEST_F(GuardedCopyTest, AShrunkFileFaultsOnlyPastTheNewLastPage) {
  ASSERT_EQ(::ftruncate(fd_.get(), static_cast<off_t>(page_ + 10)), 0);
  std::string out(2 * page_, '\0');
  ASSERT_TRUE(GuardedCopy(out.data(), at(0), out.size()).ok());
  EXPECT_EQ(out.substr(0, page_ + 10), contents_.substr(0, page_ + 10));
  EXPECT_EQ(out.substr(page_ + 10), std::string(page_ - 10, '\0'));
  std::string across(page_ + 1, '\0');
  const absl::Status s = GuardedCopy(across.data(), at(page_), across.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), kShrankMessage);
  // What arrived before the fault is memcpy's order (glibc's may copy the tail first): the
  // header promises nothing of it, so nothing is asserted.
}

TEST_F(GuardedCopyTest, TheGuardStaysArmedAfterAFaultAndOnEveryThread) {
  ASSERT_EQ(::ftruncate(fd_.get(), static_cast<off_t>(page_)), 0);
  std::string out(page_, '\0');
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(GuardedCopy(out.data(), at(2 * page_), page_).code(), absl::StatusCode::kDataLoss);
    ASSERT_TRUE(GuardedCopy(out.data(), at(0), page_).ok());
    EXPECT_EQ(out, contents_.substr(0, page_));
  }
  std::vector<absl::Status> seen(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < seen.size(); ++t) {
    threads.emplace_back([&, t] {
      std::string mine(page_, '\0');
      seen[t] = GuardedCopy(mine.data(), at(page_), mine.size());
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : seen) EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
}

// A fault the guard did not arm for is not swallowed: the process dies of it as it would have
// without the handler.
TEST_F(GuardedCopyTest, ASigbusOutsideACopyStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::string out(page_, '\0');
        (void)GuardedCopy(out.data(), at(0), out.size());  // installs the handler
        if (::ftruncate(fd_.get(), 0) != 0) _exit(3);
        volatile const char* p = reinterpret_cast<const char*>(at(page_));
        (void)*p;
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

}  // namespace
}  // namespace gpufeed
