// The .npy header parser: the first bytes of a tokens or records dataset file.
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "server/reader/npy.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {

int FuzzNpyHeader(const uint8_t* data, size_t size) {
  // A copy of exactly `size` bytes, so ASan sees any read past the end.
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<server::NpyHeader> header = server::ParseNpyHeader(bytes);
  if (!header.ok()) {
    FUZZ_CHECK(header.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(!header.status().message().empty());
    return 0;
  }
  // What the readers rely on: the data starts inside what was read, after the fixed part,
  // the array has a dimension, no dimension is negative, and the dtype is a known one.
  FUZZ_CHECK(header->data_offset >= 10 && header->data_offset <= size);
  FUZZ_CHECK(!header->shape.empty());
  for (int64_t d : header->shape) FUZZ_CHECK(d >= 0);
  FUZZ_CHECK(header->dtype != DType::kUnspecified);
  FUZZ_CHECK(!header->fortran_order);
  return 0;
}

}  // namespace gpufeed::fuzz

GPUFEED_FUZZ_TARGET(FuzzNpyHeader)
