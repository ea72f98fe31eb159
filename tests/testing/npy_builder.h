// Builds .npy bytes by hand, the way numpy.lib.format writes them: the magic "\x93NUMPY",
// the version (major, minor 0), a little-endian header length (uint16 for 1.0, uint32 for
// 2.0 and 3.0), then the dict text padded with spaces and ended by '\n' so that the data
// starts on a 64-byte boundary.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace gpufeed::testing {

// The header (everything before the data) for `dict`, e.g.
// "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }". `min_header_len` forces a
// longer, padded header (to build version 2.0 headers over 64 KiB).
inline std::string NpyHeaderBytes(const std::string& dict, int major = 1,
                                  size_t min_header_len = 0) {
  const size_t fixed = major == 1 ? 10 : 12;
  const size_t unpadded = std::max(dict.size() + 1, min_header_len);
  const size_t header_len = (fixed + unpadded + 63) / 64 * 64 - fixed;
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < fixed - 8; ++i) out += static_cast<char>((header_len >> (8 * i)) & 0xff);
  out += dict;
  out += std::string(header_len - dict.size() - 1, ' ');
  out += '\n';
  return out;
}

// A whole .npy file: the header of a C-order array of `descr` and `shape` (Python tuple
// text, e.g. "(6, 2, 3)"), followed by `data`.
inline std::string NpyFile(const std::string& descr, const std::string& shape,
                           const std::string& data, int major = 1) {
  return NpyHeaderBytes(
             "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }",
             major) +
         data;
}

}  // namespace gpufeed::testing
