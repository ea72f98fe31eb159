#include "common/os/file.h"

#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/os/fd.h"
#include "common/os/file_lease.h"
#include "common/os/guarded_copy.h"
#include "common/status.h"

namespace gpufeed {
namespace {

std::optional<std::pair<uint64_t, uint64_t>> IdentityOf(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  return std::make_pair(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
}

// fstat's st_mtim in ns; 0 when fstat fails.
int64_t ModifiedNsOf(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return 0;
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, UniqueFd fd, uint64_t size)
      : path_(std::move(path)), fd_(std::move(fd)), size_(size) {}

  uint64_t size() const override { return size_; }
  int64_t modified_ns() const override { return ModifiedNsOf(fd_.get()); }
  std::optional<std::pair<uint64_t, uint64_t>> identity() const override {
    return IdentityOf(fd_.get());
  }
  const std::string& path() const override { return path_; }

  absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    size_t done = 0;
    while (done < dst.size()) {
      const ssize_t n = ::pread(fd_.get(), dst.data() + done, dst.size() - done,
                                static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, absl::StrCat("reading ", path_, " at offset ", offset + done));
      }
      if (n == 0) {
        return absl::DataLossError(absl::StrCat(
            "reading ", path_, ": file shrank (wanted ", dst.size(), " bytes at offset ",
            offset, ", file ends after ", offset + done, ")"));
      }
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

 private:
  const std::string path_;
  const UniqueFd fd_;
  const uint64_t size_;
};

class MappedFile final : public RandomAccessFile {
 public:
  MappedFile(std::string path, UniqueFd fd, Mapping mapping, uint64_t size, bool own_description)
      : path_(std::move(path)),
        fd_(std::move(fd)),
        mapping_(std::move(mapping)),
        size_(size),
        leased_(own_description && WatchByLease(fd_.get())) {}
  ~MappedFile() override {
    if (leased_) EndLease(fd_.get());
  }

  // While the read lease holds, nobody can have opened the file for writing or truncated it
  // since it was opened (common/os/file_lease.h): no fstat.
  absl::Status CheckNotShrunk() const override {
    if (leased_ && LeaseHolds(fd_.get())) return absl::OkStatus();
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", path_));
    if (static_cast<uint64_t>(st.st_size) < size_) {
      return absl::DataLossError(absl::StrCat("reading ", path_, ": file shrank from ", size_,
                                              " to ", st.st_size, " bytes while being read"));
    }
    return absl::OkStatus();
  }

  uint64_t size() const override { return size_; }
  int64_t modified_ns() const override { return ModifiedNsOf(fd_.get()); }
  std::optional<std::pair<uint64_t, uint64_t>> identity() const override {
    return IdentityOf(fd_.get());
  }
  const std::string& path() const override { return path_; }

  absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset > size_ || dst.size() > size_ - offset) {
      return absl::DataLossError(absl::StrCat("reading ", path_, ": ", dst.size(),
                                              " bytes at offset ", offset, " run past its end (",
                                              size_, " bytes)"));
    }
    absl::Status s = GuardedCopy(dst.data(), mapping_.data() + offset, dst.size());
    if (!s.ok()) {
      return absl::DataLossError(absl::StrCat("reading ", path_, ": file shrank (wanted ",
                                              dst.size(), " bytes at offset ", offset, ")"));
    }
    return absl::OkStatus();
  }

 private:
  const std::string path_;
  const UniqueFd fd_;
  const Mapping mapping_;
  const uint64_t size_;
  const bool leased_;  // a read lease watches the file (file_lease.h)

 public:
  bool watched_by_lease() const override { return leased_ && LeaseHolds(fd_.get()); }
};

// A checked regular file: the fd and its size at open.
struct Opened {
  UniqueFd fd;
  uint64_t size = 0;
  // Whether `fd` is an open file description of the daemon's alone, which may carry a read
  // lease (file_lease.h): false for a client's descriptor the daemon could only dup.
  bool own_description = true;
};

absl::StatusOr<Opened> OpenRegular(const std::string& path) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd fd, OpenChecked(path, FileKind::kRegular));
  GPUFEED_ASSIGN_OR_RETURN(uint64_t size, CheckFileKind(fd.get(), FileKind::kRegular, path));
  return Opened{std::move(fd), size};
}

// Whether two descriptors name one file (device and inode).
bool SameFile(int a, int b) {
  const std::optional<std::pair<uint64_t, uint64_t>> id = IdentityOf(a);
  return id.has_value() && id == IdentityOf(b);
}

// A client's descriptor is one open file description shared with the client, which can set
// its lease signal and owner (F_SETSIG, F_SETOWN) or its flags at will. So the daemon reads
// through a description of its own: the file reopened through /proc/self/fd (the client's
// right to read it was checked by the kernel when the client opened it, and the mem server
// refused O_PATH and write-only descriptors). Only on the local file systems leases are
// taken on: there an open cannot wait on another process, as a FUSE server's could. Where
// the reopen fails (a daemon without the right to open the file itself) the dup is read,
// without a lease.
absl::StatusOr<Opened> FromClientFd(int fd, const std::string& path) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd dup, DupFd(fd));
  GPUFEED_ASSIGN_OR_RETURN(uint64_t size, CheckFileKind(dup.get(), FileKind::kRegular, path));
  if (OnLeasableFileSystem(dup.get())) {
    UniqueFd reopened(::open(absl::StrCat("/proc/self/fd/", dup.get()).c_str(), kDatasetOpenFlags));
    if (reopened.valid() && SameFile(dup.get(), reopened.get())) {
      return Opened{std::move(reopened), size, /*own_description=*/true};
    }
  }
  return Opened{std::move(dup), size, /*own_description=*/false};
}

// PERMISSION_DENIED unless the mode bits of the directory `fd` let `reader` search it.
absl::Status CheckSearchable(int fd, absl::string_view dir, const std::string& path,
                             const PeerCred& reader) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", dir));
  if (!ModeLetsSearch(st.st_uid, st.st_gid, st.st_mode, reader)) {
    return absl::PermissionDeniedError(absl::StrCat("opening ", path,
                                                    ": the mode bits of its directory ", dir,
                                                    " do not let uid ", reader.uid, " search it"));
  }
  return absl::OkStatus();
}

// Opens `relative` beneath `dirfd` as `reader` would reach it: every directory on the way,
// `dirfd` itself included, must let `reader` search it now, by its mode bits, as the kernel
// would ask of the reader's own open (a 0744 directory, or one made 0700 after the client
// opened it, hides its files from the daemon too). Checked at each open, not once at
// Attach, so a chmod later takes effect on the next read. No links anywhere on the way.
absl::StatusOr<UniqueFd> OpenBeneathAs(int dirfd, const std::string& relative,
                                       const std::string& path, const PeerCred& reader) {
  std::vector<absl::string_view> parts = absl::StrSplit(relative, '/', absl::SkipEmpty());
  if (parts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("opening ", path, ": no file name"));
  }
  GPUFEED_RETURN_IF_ERROR(CheckSearchable(dirfd, "(the dataset folder)", path, reader));
  UniqueFd dir;  // the directory reached so far, when below dirfd
  std::string reached;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    absl::StrAppend(&reached, reached.empty() ? "" : "/", parts[i]);
    open_how how{};
    how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    const std::string part(parts[i]);
    UniqueFd next(static_cast<int>(
        ::syscall(SYS_openat2, dir.valid() ? dir.get() : dirfd, part.c_str(), &how, sizeof(how))));
    if (!next.valid()) return ErrnoToStatus(errno, absl::StrCat("opening ", path));
    GPUFEED_RETURN_IF_ERROR(CheckSearchable(next.get(), reached, path, reader));
    dir = std::move(next);
  }
  return OpenBeneath(dir.valid() ? dir.get() : dirfd, std::string(parts.back()), path,
                     /*follow_links=*/false);
}

absl::StatusOr<Opened> FromBeneath(int dirfd, const std::string& relative, const std::string& path,
                                   const PeerCred* reader) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd fd, reader == nullptr
                                            ? OpenBeneath(dirfd, relative, path)
                                            : OpenBeneathAs(dirfd, relative, path, *reader));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", FileTypeName(st.st_mode), ", not a regular file"));
  }
  if (reader != nullptr && !ModeLetsRead(st.st_uid, st.st_gid, st.st_mode, *reader)) {
    return absl::PermissionDeniedError(
        absl::StrCat("opening ", path, ": its mode bits do not let uid ", reader->uid,
                     " read it"));
  }
  return Opened{std::move(fd), static_cast<uint64_t>(st.st_size)};
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> Mapped(const std::string& path,
                                                         absl::StatusOr<Opened> opened) {
  if (!opened.ok()) return opened.status();
  Mapping mapping;
  if (opened->size > 0) {
    GPUFEED_ASSIGN_OR_RETURN(mapping, Mapping::Map(opened->fd.get(), 0, opened->size,
                                                   /*writable=*/false));
  }
  return std::unique_ptr<RandomAccessFile>(new MappedFile(
      path, std::move(opened->fd), std::move(mapping), opened->size, opened->own_description));
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> Pread(const std::string& path,
                                                        absl::StatusOr<Opened> opened) {
  if (!opened.ok()) return opened.status();
  return std::unique_ptr<RandomAccessFile>(
      new PosixFile(path, std::move(opened->fd), opened->size));
}

class MappedFileSystemImpl final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) override {
    return Mapped(path, OpenRegular(path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFromFd(
      int fd, const std::string& path) override {
    return Mapped(path, FromClientFd(fd, path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForReadBeneath(
      int dirfd, const std::string& relative, const std::string& path,
      const PeerCred* reader) override {
    return Mapped(path, FromBeneath(dirfd, relative, path, reader));
  }
};

class PosixFileSystemImpl final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) override {
    return Pread(path, OpenRegular(path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFromFd(
      int fd, const std::string& path) override {
    return Pread(path, FromClientFd(fd, path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForReadBeneath(
      int dirfd, const std::string& relative, const std::string& path,
      const PeerCred* reader) override {
    return Pread(path, FromBeneath(dirfd, relative, path, reader));
  }
};

}  // namespace

const char* FileTypeName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFLNK: return "a symbolic link";
    default: return "of an unknown type";
  }
}

absl::StatusOr<uint64_t> CheckFileKind(int fd, FileKind want, absl::string_view display,
                                       absl::string_view field) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", display));
  const bool ok = want == FileKind::kRegular ? S_ISREG(st.st_mode) : S_ISDIR(st.st_mode);
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", display, " is ", FileTypeName(st.st_mode), ", not ",
        want == FileKind::kRegular ? "a regular file" : "a directory"));
  }
  return want == FileKind::kRegular ? static_cast<uint64_t>(st.st_size) : 0;
}

absl::StatusOr<UniqueFd> OpenChecked(const std::string& path, FileKind want,
                                     absl::string_view field) {
  // No O_DIRECTORY for a directory: its ENOTDIR would hide what the path is (a FIFO, ...),
  // which the type check names. O_NONBLOCK keeps a FIFO from blocking the open.
  UniqueFd fd(::open(path.c_str(), kDatasetOpenFlags));
  if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat("opening dataset ", path));
  GPUFEED_RETURN_IF_ERROR(CheckFileKind(fd.get(), want, path, field).status());
  return fd;
}

bool ModeLetsRead(uint32_t uid, uint32_t gid, unsigned mode, const PeerCred& who) {
  if (who.uid == 0) return true;
  if (who.uid == uid) return (mode & S_IRUSR) != 0;
  if (who.InGroup(gid)) return (mode & S_IRGRP) != 0;
  return (mode & S_IROTH) != 0;
}

bool ModeLetsSearch(uint32_t uid, uint32_t gid, unsigned mode, const PeerCred& who) {
  // The execute bits shifted into the read bits' places: owner, group, others alike.
  return ModeLetsRead(uid, gid, (mode & 0111) << 2, who);
}

absl::StatusOr<UniqueFd> DupFd(int fd) {
  UniqueFd out(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!out.valid()) return ErrnoToStatus(errno, "dup of a dataset descriptor");
  return out;
}

absl::StatusOr<std::string> ResolvedPathOf(int fd) {
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  char buffer[PATH_MAX + 1];
  const ssize_t n = ::readlink(link.c_str(), buffer, PATH_MAX);
  if (n < 0) return ErrnoToStatus(errno, "resolving a dataset descriptor");
  return std::string(buffer, static_cast<size_t>(n));
}

absl::StatusOr<UniqueFd> OpenBeneath(int dirfd, const std::string& relative,
                                     absl::string_view display, bool follow_links) {
  open_how how{};
  how.flags = static_cast<uint64_t>(kDatasetOpenFlags);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  if (!follow_links) how.resolve |= RESOLVE_NO_SYMLINKS;
  for (int attempt = 0;; ++attempt) {
    const long fd = ::syscall(SYS_openat2, dirfd, relative.c_str(), &how, sizeof(how));
    if (fd >= 0) return UniqueFd(static_cast<int>(fd));
    // EAGAIN: a rename or mount raced the lookup; the kernel asks to retry.
    if (errno == EINTR || (errno == EAGAIN && attempt < 16)) continue;
    if (errno == EXDEV) {
      return absl::PermissionDeniedError(
          absl::StrCat("opening ", display, ": it lies outside the dataset folder"));
    }
    if (errno == ELOOP && !follow_links) {
      return absl::PermissionDeniedError(absl::StrCat(
          "opening ", display, ": a symbolic link, which a caller's dataset may not use"));
    }
    return ErrnoToStatus(errno, absl::StrCat("opening ", display));
  }
}

FileSystem* PosixFileSystem() {
  static PosixFileSystemImpl* fs = new PosixFileSystemImpl();  // stateless, never destroyed
  return fs;
}

FileSystem* MappedFileSystem() {
  static MappedFileSystemImpl* fs = new MappedFileSystemImpl();  // stateless, never destroyed
  return fs;
}

}  // namespace gpufeed
