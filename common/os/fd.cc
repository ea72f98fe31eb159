#include "common/os/fd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed {

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Mapping::~Mapping() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

absl::StatusOr<Mapping> Mapping::Map(int fd, uint64_t offset, uint64_t size, bool writable) {
  if (size == 0) return absl::InvalidArgumentError("mapping of 0 bytes");
  if (offset % PageSize() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("mapping offset ", offset, " not page-aligned"));
  }
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* data = ::mmap(nullptr, size, prot, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (data == MAP_FAILED) return ErrnoToStatus(errno, "mmap");
  return Mapping(static_cast<std::byte*>(data), size);
}

absl::StatusOr<UniqueFd> CreateSealedMemfd(const std::string& name, uint64_t size) {
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoToStatus(errno, "memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("sizing memfd to ", size, " bytes"));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoToStatus(errno, "sealing memfd");
  }
  return fd;
}

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace gpufeed
