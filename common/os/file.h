// The file system seen by dataset readers, as an injected interface so tests can hand in
// files that fail or shrink.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gpufeed {

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
  virtual const std::string& path() const = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // NOT_FOUND / PERMISSION_DENIED / INVALID_ARGUMENT (a directory) naming the path.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) = 0;
};

// The real file system, reading with pread(2): a file that shrinks underneath gives DATA_LOSS.
FileSystem* PosixFileSystem();

// The real file system, reading by memcpy from a read-only mapping of each file through
// GuardedCopy: the same DATA_LOSS on a shrunken file, about 3x the copy speed of pread for
// small samples (see common/os/guarded_copy.h).
FileSystem* MappedFileSystem();

}  // namespace gpufeed
