// Little-endian fields and magic numbers in a file's first bytes, for the readers that parse
// headers (token_formats.cc) and recognise formats (foreign_formats.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace gpufeed::server {

inline uint32_t Le32(absl::string_view b, size_t at) {
  uint32_t v;
  std::memcpy(&v, b.data() + at, 4);
  return v;
}
inline uint64_t Le64(absl::string_view b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}
inline uint16_t Le16(absl::string_view b, size_t at) {
  uint16_t v;
  std::memcpy(&v, b.data() + at, 2);
  return v;
}
// Token `i` of `tokens`, stored as `token_bytes` (2: uint16, else uint32) little-endian ids:
// what a vocabulary check and an eos scan read.
inline uint64_t TokenAt(const std::byte* tokens, uint64_t i, uint64_t token_bytes) {
  if (token_bytes == 2) {
    uint16_t t;
    std::memcpy(&t, tokens + i * 2, 2);
    return t;
  }
  uint32_t t;
  std::memcpy(&t, tokens + i * 4, 4);
  return t;
}
inline bool At(absl::string_view b, size_t at, absl::string_view magic) {
  return b.size() >= at + magic.size() && b.substr(at, magic.size()) == magic;
}

}  // namespace gpufeed::server
