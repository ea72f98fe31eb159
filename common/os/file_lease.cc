#include "common/os/file_lease.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <pthread.h>
#include <signal.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace gpufeed {
namespace {

// Per descriptor number, whether its lease holds: written by WatchByLease and by the signal
// handler, which can only use a static table (no allocation, no locks).
constexpr int kMaxWatchedFd = 1 << 16;
std::atomic<bool> g_holds[kMaxWatchedFd];

int LeaseSignal() { return SIGRTMIN + 7; }

void OnLeaseBreak(int, siginfo_t* info, void*) {
  const int fd = info->si_fd;
  if (fd < 0 || fd >= kMaxWatchedFd) return;
  g_holds[fd].store(false, std::memory_order_release);
  const int saved = errno;
  ::fcntl(fd, F_SETLEASE, F_UNLCK);  // the writer goes on now; the reader fstats from here
  errno = saved;
}

// A lease whose break signal nobody can take would be broken by the kernel after
// lease-break-time with the mark still "holds": refused when this thread blocks the signal
// (threads inherit the mask of the thread that made them, so a process that blocks it does so
// from the start, as gpufeedd does for SIGTERM and SIGINT only).
bool SignalDeliverable() {
  sigset_t blocked;
  return ::pthread_sigmask(SIG_BLOCK, nullptr, &blocked) == 0 &&
         sigismember(&blocked, LeaseSignal()) == 0;
}

bool HandlerInstalled() {
  static const bool installed = [] {
    struct sigaction action {};
    action.sa_sigaction = OnLeaseBreak;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask);
    return ::sigaction(LeaseSignal(), &action, nullptr) == 0;
  }();
  return installed;
}

// $GPUFEED_FILE_LEASES=0 turns leases off (every check an fstat): for comparison, or where
// a writer must never wait on the daemon's signal handler.
bool LeasesWanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("GPUFEED_FILE_LEASES");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return wanted;
}

}  // namespace

bool OnLeasableFileSystem(int fd) {
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0) return false;
  switch (static_cast<uint64_t>(fs.f_type)) {
    case EXT4_SUPER_MAGIC:  // ext2, ext3 and ext4 share it
    case XFS_SUPER_MAGIC:
    case BTRFS_SUPER_MAGIC:
    case TMPFS_MAGIC:
      return true;
    default:
      return false;
  }
}

bool WatchByLease(int fd) {
  if (fd < 0 || fd >= kMaxWatchedFd || !LeasesWanted() || !OnLeasableFileSystem(fd) ||
      !SignalDeliverable() || !HandlerInstalled()) {
    return false;
  }
  // One open file description, one lease: a description that holds one already (a second
  // file made from a dup of the same descriptor) is left to its first holder, whose EndLease
  // would otherwise end this file's lease unseen. This one checks with fstat.
  if (::fcntl(fd, F_GETLEASE) != F_UNLCK) return false;
  // Marked as holding before the lease is asked for: a break that comes at once then marks it
  // broken after, never before (a stale mark from an earlier file of this number only costs
  // an fstat).
  g_holds[fd].store(true, std::memory_order_release);
  f_owner_ex owner{F_OWNER_PID, ::getpid()};
  if (::fcntl(fd, F_SETSIG, LeaseSignal()) != 0 || ::fcntl(fd, F_SETOWN_EX, &owner) != 0 ||
      ::fcntl(fd, F_SETLEASE, F_RDLCK) != 0) {
    g_holds[fd].store(false, std::memory_order_release);
    return false;
  }
  return true;
}

bool LeaseHolds(int fd) {
  return fd >= 0 && fd < kMaxWatchedFd && g_holds[fd].load(std::memory_order_acquire);
}

void EndLease(int fd) {
  if (fd < 0 || fd >= kMaxWatchedFd) return;
  g_holds[fd].store(false, std::memory_order_release);
  ::fcntl(fd, F_SETLEASE, F_UNLCK);
}

}  // namespace gpufeed
