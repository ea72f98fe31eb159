// Owning types for OS handles: a file descriptor and a memory mapping. Only their
// destructors close what they own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace gpufeed {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A shared mapping of (part of) a file descriptor.
class Mapping {
 public:
  Mapping() = default;
  Mapping(Mapping&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  // Maps `size` bytes of `fd` from `offset` (a multiple of the page size).
  static absl::StatusOr<Mapping> Map(int fd, uint64_t offset, uint64_t size, bool writable);

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  Mapping(std::byte* data, uint64_t size) : data_(data), size_(size) {}
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

// An anonymous memory file of exactly `size` bytes, sealed so that nobody who receives it
// (a consumer) can shrink or grow it: a shrunken memfd would SIGBUS the daemon.
absl::StatusOr<UniqueFd> CreateSealedMemfd(const std::string& name, uint64_t size);

uint64_t PageSize();

}  // namespace gpufeed
