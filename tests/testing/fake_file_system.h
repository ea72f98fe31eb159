// An in-memory FileSystem for reader tests: files are path -> bytes. A test can make a file
// shrink after it was opened (as a file rewritten under a running daemon does) and make
// OpenForRead fail with a status of its choice.
//
// Files follow the RandomAccessFile contract: size() is the size at open; a read that runs
// past the current end, and CheckNotShrunk() once the file holds fewer bytes than at open,
// are DATA_LOSS ("... file shrank ...").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/os/file.h"

namespace gpufeed::testing {

class FakeFileSystem final : public FileSystem {
 public:
  // Creates or replaces the file at `path`. Files already open keep seeing the old bytes.
  void AddFile(const std::string& path, std::string bytes) {
    absl::MutexLock lock(&mu_);
    files_[path] = std::make_shared<Contents>(std::move(bytes));
  }

  // A file that reports `size_at_open` bytes when opened but holds only `bytes`, as if it
  // shrank right after open: reads past bytes.size() fail with DATA_LOSS and write nothing.
  // Lets a test present sizes no real test file could have (a sparse terabyte).
  void AddFileWithSize(const std::string& path, std::string bytes, uint64_t size_at_open) {
    absl::MutexLock lock(&mu_);
    auto contents = std::make_shared<Contents>(std::move(bytes));
    contents->size_at_open = size_at_open;
    files_[path] = std::move(contents);
  }

  // Cuts the file at `path` to `new_size` bytes: files already open see it shrink (their
  // size() stays what it was at open; reads past the new end fail).
  void Shrink(const std::string& path, uint64_t new_size) {
    std::shared_ptr<Contents> contents;
    {
      absl::MutexLock lock(&mu_);
      auto it = files_.find(path);
      if (it == files_.end()) return;
      contents = it->second;
    }
    absl::MutexLock lock(&contents->mu);
    if (new_size < contents->bytes.size()) contents->bytes.resize(new_size);
  }

  // The next OpenForRead(path) calls fail with `status` until ClearOpenFailure(path).
  void FailOpen(const std::string& path, absl::Status status) {
    absl::MutexLock lock(&mu_);
    open_failures_[path] = std::move(status);
  }
  void ClearOpenFailure(const std::string& path) {
    absl::MutexLock lock(&mu_);
    open_failures_.erase(path);
  }

  // Reads of `path` after the first `pass` (files open now and later) wait until the returned
  // notification is notified: a stuck disk, for liveness tests.
  std::shared_ptr<absl::Notification> BlockReads(const std::string& path, int pass = 0) {
    auto gate = std::make_shared<absl::Notification>();
    absl::MutexLock lock(&mu_);
    auto it = files_.find(path);
    if (it != files_.end()) {
      absl::MutexLock contents_lock(&it->second->mu);
      it->second->gate = gate;
      it->second->gate_passes = pass;
    }
    return gate;
  }

  int open_count() const {
    absl::MutexLock lock(&mu_);
    return open_count_;
  }

  // The fake has no descriptors: a file opened through one, or beneath a directory one, is
  // the file at its display path (`path`), so reader tests run unchanged either way.
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFromFd(int fd,
                                                               const std::string& path) override {
    {
      absl::MutexLock lock(&mu_);
      ++fd_opens_;
    }
    return OpenForRead(path);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForReadBeneath(
      int dirfd, const std::string& relative, const std::string& path,
      const PeerCred* reader) override {
    {
      absl::MutexLock lock(&mu_);
      ++fd_opens_;
    }
    return OpenForRead(path);
  }
  // Opens through OpenFromFd / OpenForReadBeneath so far.
  int fd_open_count() const {
    absl::MutexLock lock(&mu_);
    return fd_opens_;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    absl::MutexLock lock(&mu_);
    ++open_count_;
    if (auto f = open_failures_.find(path); f != open_failures_.end()) return f->second;
    auto it = files_.find(path);
    if (it == files_.end()) {
      return absl::NotFoundError(absl::StrCat("opening dataset ", path, ": no such file"));
    }
    uint64_t size;
    {
      absl::MutexLock contents_lock(&it->second->mu);
      size = it->second->size_at_open.value_or(it->second->bytes.size());
    }
    return std::unique_ptr<RandomAccessFile>(new File(path, it->second, size));
  }

 private:
  struct Contents {
    explicit Contents(std::string b) : bytes(std::move(b)) {}
    absl::Mutex mu;
    std::string bytes ABSL_GUARDED_BY(mu);
    std::optional<uint64_t> size_at_open ABSL_GUARDED_BY(mu);
    std::shared_ptr<absl::Notification> gate ABSL_GUARDED_BY(mu);  // BlockReads
    int gate_passes ABSL_GUARDED_BY(mu) = 0;                       // reads let through first
  };

  class File final : public RandomAccessFile {
   public:
    File(std::string path, std::shared_ptr<Contents> contents, uint64_t size)
        : path_(std::move(path)), contents_(std::move(contents)), size_(size) {}
    uint64_t size() const override { return size_; }
    const std::string& path() const override { return path_; }
    absl::Status CheckNotShrunk() const override {
      absl::MutexLock lock(&contents_->mu);
      if (contents_->bytes.size() < size_) {
        return absl::DataLossError(absl::StrCat("reading ", path_, ": file shrank from ", size_,
                                                " to ", contents_->bytes.size(), " bytes"));
      }
      return absl::OkStatus();
    }
    absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      std::shared_ptr<absl::Notification> gate;
      {
        absl::MutexLock lock(&contents_->mu);
        if (contents_->gate_passes > 0) {
          --contents_->gate_passes;
        } else {
          gate = contents_->gate;
        }
      }
      if (gate != nullptr) gate->WaitForNotification();
      absl::MutexLock lock(&contents_->mu);
      const std::string& bytes = contents_->bytes;
      if (offset > bytes.size() || dst.size() > bytes.size() - offset) {
        return absl::DataLossError(absl::StrCat("reading ", path_, ": file shrank (wanted ",
                                                dst.size(), " bytes at offset ", offset,
                                                ", file ends after ", bytes.size(), ")"));
      }
      if (!dst.empty()) std::memcpy(dst.data(), bytes.data() + offset, dst.size());
      return absl::OkStatus();
    }

   private:
    const std::string path_;
    const std::shared_ptr<Contents> contents_;
    const uint64_t size_;
  };

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Contents>> files_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Status> open_failures_ ABSL_GUARDED_BY(mu_);
  int open_count_ ABSL_GUARDED_BY(mu_) = 0;
  int fd_opens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpufeed::testing
