#include "common/os/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
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

class PosixFileSystemImpl final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) override {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat("opening dataset ", path));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", path));
    if (!S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.path: ", path, " is not a regular file"));
    }
    return std::make_unique<PosixFile>(path, std::move(fd), static_cast<uint64_t>(st.st_size));
  }
};

}  // namespace

FileSystem* PosixFileSystem() {
  static PosixFileSystemImpl* fs = new PosixFileSystemImpl();  // stateless, never destroyed
  return fs;
}

}  // namespace gpufeed
