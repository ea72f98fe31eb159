// The file system seen by dataset readers, as an injected interface so tests can hand in
// files that fail or shrink.
#pragma once

#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/fd.h"
#include "common/os/peer_cred.h"

namespace gpufeed {

// Every open the daemon makes of a dataset (docs/SECURITY.md section 2): read-only, never
// blocking (a FIFO opens at once instead of waiting for a writer), never a controlling tty.
// A type check with fstat follows before anything is read.
inline constexpr int kDatasetOpenFlags = O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;

enum class FileKind { kRegular, kDirectory };

// "a FIFO", "a socket", "a character device", ... for a stat mode.
const char* FileTypeName(unsigned mode);

// fstat(fd) and its type: INVALID_ARGUMENT "<field>: <display> is a FIFO, not a regular file"
// (or "not a directory") when it is not `want`. Returns the stat size (0 for a directory).
absl::StatusOr<uint64_t> CheckFileKind(int fd, FileKind want, absl::string_view display,
                                       absl::string_view field = "dataset.path");

// Opens `path` with kDatasetOpenFlags (O_DIRECTORY too for a directory) and checks its kind.
absl::StatusOr<UniqueFd> OpenChecked(const std::string& path, FileKind want,
                                     absl::string_view field = "dataset.path");

// Whether the mode bits of a file of owner `uid`, group `gid` and permission bits `mode` let
// `who` read it, as the kernel decides for an open without ACLs: the owner's bits for the
// owner, else the group's for a member, else the others'; root reads anything.
bool ModeLetsRead(uint32_t uid, uint32_t gid, unsigned mode, const PeerCred& who);
// The same for searching (x) a directory: a path beneath it is reachable only through it.
bool ModeLetsSearch(uint32_t uid, uint32_t gid, unsigned mode, const PeerCred& who);

// A dup (F_DUPFD_CLOEXEC) of `fd`: INTERNAL naming the errno when the table is full.
absl::StatusOr<UniqueFd> DupFd(int fd);

// The path the kernel gives for an open descriptor (readlink of /proc/self/fd/N).
absl::StatusOr<std::string> ResolvedPathOf(int fd);

// openat2(dirfd, relative, {kDatasetOpenFlags, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS}):
// nothing outside the directory is reachable by ".." or by links; `display` names the file
// in errors (EXDEV, an escape, is PERMISSION_DENIED "... lies outside the dataset folder").
// `follow_links` false adds RESOLVE_NO_SYMLINKS: a link anywhere on the way is refused (a
// caller's read must not pass, by a link inside the folder, through a directory the caller
// cannot search: its walk checked only the directories it listed).
absl::StatusOr<UniqueFd> OpenBeneath(int dirfd, const std::string& relative,
                                     absl::string_view display, bool follow_links = true);

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Size when the file was opened.
  virtual uint64_t size() const = 0;
  // Reads exactly dst.size() bytes at `offset`; a short read is DATA_LOSS (the file shrank).
  // Thread-safe.
  virtual absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const = 0;
  // DATA_LOSS when the file is now shorter than when it was opened. Reads that finished
  // before a successful check saw the file whole; readers call it after a batch of reads,
  // since a mapping reads the cut tail of its last page as zeros instead of faulting.
  virtual absl::Status CheckNotShrunk() const { return absl::OkStatus(); }
  // Whether a read lease now makes CheckNotShrunk free (common/os/file_lease.h): mapped files
  // on local file systems, for a daemon with the right to lease them.
  virtual bool watched_by_lease() const { return false; }
  // The file's modification time now (st_mtim, in ns), for a feed's fingerprint; 0 where the
  // file system keeps none (a test's fake).
  virtual int64_t modified_ns() const { return 0; }
  // The file's (device, inode), to know two names of one file (hard links); nullopt where
  // the file system keeps none (a test's fake).
  virtual std::optional<std::pair<uint64_t, uint64_t>> identity() const { return std::nullopt; }
  virtual const std::string& path() const = 0;
  // The version of the content where the store names one (an object's ETag), for a feed's
  // fingerprint: "" for files (their size and time say it).
  virtual std::string version() const { return ""; }
  // A hint: [offset, offset + length) will be read once, at `next_use` (a monotone counter of
  // the reader's, smaller sooner). A file behind a cache (an object store's) fetches it ahead
  // and keeps it by it; a local file ignores it (the page cache does its own read-ahead).
  virtual void WillRead(uint64_t offset, uint64_t length, uint64_t next_use) const {}
  // Whether WillRead does anything: readers skip working out their hints where it does not.
  virtual bool takes_read_hints() const { return false; }
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // NOT_FOUND / PERMISSION_DENIED / INVALID_ARGUMENT (a directory, a FIFO, a device) naming
  // the path. The daemon's own rights: an admin's attach by path.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) = 0;
  // Reads through `fd`, a descriptor a client opened with its own rights (the file keeps a
  // dup; the caller keeps `fd`): INVALID_ARGUMENT unless it is a regular file. `path` is the
  // display name, for messages only.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFromFd(
      int fd, const std::string& path) = 0;
  // Opens `relative` beneath the directory `dirfd` (OpenBeneath above) and checks it is a
  // regular file; with `reader`, as if the reader had opened it: a directory on the way
  // (`dirfd` included) whose mode bits would not let `reader` search it, or a file they would
  // not let it read, is PERMISSION_DENIED, and no symbolic link is followed. `path` is the
  // display name.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForReadBeneath(
      int dirfd, const std::string& relative, const std::string& path,
      const PeerCred* reader) = 0;
};

// The real file system, reading with pread(2): a file that shrinks underneath gives DATA_LOSS.
FileSystem* PosixFileSystem();

// The real file system, reading by memcpy from a read-only mapping of each file through
// GuardedCopy: the same DATA_LOSS on a shrunken file, about 3x the copy speed of pread for
// small samples (see common/os/guarded_copy.h).
FileSystem* MappedFileSystem();

}  // namespace gpufeed
