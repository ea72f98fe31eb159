// A parser for NumPy's .npy format (versions 1.0, 2.0 and 3.0): magic, version, header
// length, then a Python dict literal {'descr': ..., 'fortran_order': ..., 'shape': (...)}.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace gpufeed::server {

struct NpyHeader {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  bool fortran_order = false;
  uint64_t data_offset = 0;  // first byte of the array data
};

// The first bytes of every .npy file.
inline constexpr char kNpyMagic[] = "\x93NUMPY";

// Bytes to read from the start of a file to be sure to hold any header we accept.
inline constexpr uint64_t kNpyMaxHeaderBytes = 1 << 16;

// Parses the header at the start of `prefix` (at least the whole header). Rejects with
// INVALID_ARGUMENT what cannot be served as fixed-size numeric rows: object, string,
// structured or big-endian dtypes, Fortran order, 0-d arrays, malformed text.
absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view prefix);

}  // namespace gpufeed::server
