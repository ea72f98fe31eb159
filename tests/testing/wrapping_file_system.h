// A FileSystem that forwards to another and lets a test act on every open and read: count
// bytes, throw (a dataset that runs out of memory or has a bug), and so on. One decorator
// instead of one per test.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/os/file.h"
#include "common/status.h"

namespace gpufeed::testing {

class WrappingFileSystem : public FileSystem {
 public:
  explicit WrappingFileSystem(FileSystem* inner) : inner_(inner) {}

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    OnOpen();
    return Wrap(inner_->OpenForRead(path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFromFd(int fd,
                                                               const std::string& path) override {
    OnOpen();
    return Wrap(inner_->OpenFromFd(fd, path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForReadBeneath(
      int dirfd, const std::string& relative, const std::string& path,
      const PeerCred* reader) override {
    OnOpen();
    return Wrap(inner_->OpenForReadBeneath(dirfd, relative, path, reader));
  }

 protected:
  // Called before every open, and before every read of `file` (before it reaches the inner
  // file); may throw.
  virtual void OnOpen() {}
  virtual void OnRead(const RandomAccessFile& file, uint64_t offset, std::span<std::byte> dst) {}

 private:
  class File final : public RandomAccessFile {
   public:
    File(std::unique_ptr<RandomAccessFile> inner, WrappingFileSystem* fs)
        : inner_(std::move(inner)), fs_(fs) {}
    uint64_t size() const override { return inner_->size(); }
    const std::string& path() const override { return inner_->path(); }
    absl::Status CheckNotShrunk() const override { return inner_->CheckNotShrunk(); }
    absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      fs_->OnRead(*inner_, offset, dst);
      return inner_->ReadAt(offset, dst);
    }

   private:
    const std::unique_ptr<RandomAccessFile> inner_;
    WrappingFileSystem* const fs_;
  };

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> Wrap(
      absl::StatusOr<std::unique_ptr<RandomAccessFile>> file) {
    if (!file.ok()) return file.status();
    return std::unique_ptr<RandomAccessFile>(new File(std::move(*file), this));
  }

  FileSystem* const inner_;
};

}  // namespace gpufeed::testing
