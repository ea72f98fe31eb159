// The tar index: the bytes of a WebDataset shard (every header, size, long name and pax
// record is untrusted).
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "common/os/file.h"
#include "server/reader/tar_index.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {
namespace {

// The input as a file: exactly its bytes, a read past them is DATA_LOSS as pread's is.
class BytesFile final : public RandomAccessFile {
 public:
  explicit BytesFile(std::string bytes) : bytes_(std::move(bytes)) {}
  uint64_t size() const override { return bytes_.size(); }
  absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset > bytes_.size() || dst.size() > bytes_.size() - offset) {
      return absl::DataLossError("short read");
    }
    std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
    return absl::OkStatus();
  }
  const std::string& path() const override { return path_; }

 private:
  const std::string bytes_;
  const std::string path_ = "/fuzz/shard.tar";
};

}  // namespace

int FuzzTarIndex(const uint8_t* data, size_t size) {
  const BytesFile file(std::string(reinterpret_cast<const char*>(data), size));
  server::FolderWalkLimits limits;
  limits.max_entries = 4096;
  server::WalkBudget budget(limits, file.path(), "indexing");
  absl::StatusOr<std::vector<server::TarMember>> members =
      server::IndexTar(file, file.path(), &budget);
  if (!members.ok()) {
    const absl::StatusCode code = members.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kDataLoss ||
               code == absl::StatusCode::kResourceExhausted);
    FUZZ_CHECK(absl::StartsWith(members.status().message(), "dataset.path: /fuzz/shard.tar"));
    return 0;
  }
  // What the reads rely on: each member's data lies inside the file, after a header.
  for (const server::TarMember& m : *members) {
    FUZZ_CHECK(m.offset >= server::kTarBlock && m.offset % server::kTarBlock == 0);
    FUZZ_CHECK(m.offset <= size && m.size <= size - m.offset);
    FUZZ_CHECK(m.data.size() <= server::kTarInlineBytes);
    FUZZ_CHECK(m.data.empty() || m.data.size() == m.size);
  }
  return 0;
}

}  // namespace gpufeed::fuzz

GPUFEED_FUZZ_TARGET(FuzzTarIndex)
