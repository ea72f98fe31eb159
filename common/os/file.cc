#include "common/os/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
#include "common/os/guarded_copy.h"
#include "common/status.h"

namespace gpufeed {
namespace {

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, UniqueFd fd, uint64_t size)
      : path_(std::move(path)), fd_(std::move(fd)), size_(size) {}

  uint64_t size() const override { return size_; }
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
  MappedFile(std::string path, UniqueFd fd, Mapping mapping, uint64_t size)
      : path_(std::move(path)), fd_(std::move(fd)), mapping_(std::move(mapping)), size_(size) {}

  absl::Status CheckNotShrunk() const override {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", path_));
    if (static_cast<uint64_t>(st.st_size) < size_) {
      return absl::DataLossError(absl::StrCat("reading ", path_, ": file shrank from ", size_,
                                              " to ", st.st_size, " bytes while being read"));
    }
    return absl::OkStatus();
  }

  uint64_t size() const override { return size_; }
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
};

// Opens `path` read-only, checking it is a regular file; returns the fd and its size.
absl::StatusOr<std::pair<UniqueFd, uint64_t>> OpenRegular(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat("opening dataset ", path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", path, " is not a regular file"));
  }
  return std::make_pair(std::move(fd), static_cast<uint64_t>(st.st_size));
}

class MappedFileSystemImpl final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) override {
    GPUFEED_ASSIGN_OR_RETURN(auto opened, OpenRegular(path));
    Mapping mapping;
    if (opened.second > 0) {
      GPUFEED_ASSIGN_OR_RETURN(mapping, Mapping::Map(opened.first.get(), 0, opened.second,
                                                     /*writable=*/false));
    }
    return std::make_unique<MappedFile>(path, std::move(opened.first), std::move(mapping),
                                        opened.second);
  }
};

class PosixFileSystemImpl final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) override {
    GPUFEED_ASSIGN_OR_RETURN(auto opened, OpenRegular(path));
    return std::make_unique<PosixFile>(path, std::move(opened.first), opened.second);
  }
};

}  // namespace

FileSystem* PosixFileSystem() {
  static PosixFileSystemImpl* fs = new PosixFileSystemImpl();  // stateless, never destroyed
  return fs;
}

FileSystem* MappedFileSystem() {
  static MappedFileSystemImpl* fs = new MappedFileSystemImpl();  // stateless, never destroyed
  return fs;
}

}  // namespace gpufeed
