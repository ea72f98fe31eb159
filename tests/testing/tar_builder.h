// Tar archives for tests: ustar or GNU headers written from the POSIX layout, with the ustar
// prefix field, GNU long names ('L'), pax extended headers ('x') and base-256 sizes, so the
// reader is tested against each form (and against Python's tarfile in tests/python).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

namespace gpufeed::testing {

struct TarHeaderSpec {
  TarHeaderSpec(std::string n = "", uint64_t s = 0) : name(std::move(n)), size(s) {}  // NOLINT
  std::string name;
  uint64_t size = 0;
  char type = '0';
  std::string prefix;    // ustar's prefix field (POSIX magic only)
  bool gnu = false;      // GNU magic "ustar  \0" instead of POSIX "ustar\0" "00"
  bool base256 = false;  // the size in GNU base-256
};

// One 512-byte header block with a correct checksum (`checksum_delta` spoils it).
inline std::string TarHeaderBlock(const TarHeaderSpec& h, int checksum_delta = 0) {
  std::string b(512, '\0');
  std::memcpy(b.data(), h.name.data(), std::min<size_t>(h.name.size(), 100));
  std::memcpy(b.data() + 100, "0000644", 7);
  std::memcpy(b.data() + 108, "0001750", 7);
  std::memcpy(b.data() + 116, "0001750", 7);
  if (h.base256) {
    b[124] = static_cast<char>(0x80);
    for (int i = 0; i < 8; ++i) b[135 - i] = static_cast<char>((h.size >> (8 * i)) & 0xff);
  } else {
    std::snprintf(b.data() + 124, 12, "%011llo", static_cast<unsigned long long>(h.size));
  }
  std::memcpy(b.data() + 136, "14707151510", 11);
  b[156] = h.type;
  if (h.gnu) {
    std::memcpy(b.data() + 257, "ustar  ", 8);
  } else {
    std::memcpy(b.data() + 257, "ustar", 6);
    std::memcpy(b.data() + 263, "00", 2);
    std::memcpy(b.data() + 345, h.prefix.data(), std::min<size_t>(h.prefix.size(), 155));
  }
  std::memset(b.data() + 148, ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : b) sum += c;
  std::snprintf(b.data() + 148, 8, "%06o", sum + static_cast<unsigned>(checksum_delta));
  b[155] = ' ';
  return b;
}

inline std::string TarPadded(const std::string& data) {
  return data + std::string((512 - data.size() % 512) % 512, '\0');
}

// A header and its data, padded to whole blocks.
inline std::string TarMemberBytes(TarHeaderSpec h, const std::string& data) {
  h.size = data.size();
  return TarHeaderBlock(h) + TarPadded(data);
}
inline std::string TarFile(const std::string& name, const std::string& data) {
  return TarMemberBytes({name}, data);
}

// A GNU long name ('L' of "././@LongLink") before a member whose own field is cut.
inline std::string TarGnuLongName(const std::string& name, const std::string& data) {
  TarHeaderSpec l{"././@LongLink"};
  l.type = 'L';
  l.gnu = true;
  TarHeaderSpec m{name.substr(0, 99)};
  m.gnu = true;
  return TarMemberBytes(l, name + std::string(1, '\0')) + TarMemberBytes(m, data);
}

// A pax record "LEN key=value\n" (LEN counts the whole record).
inline std::string PaxRecord(const std::string& key, const std::string& value) {
  const std::string body = " " + key + "=" + value + "\n";
  size_t len = body.size() + 1;
  while (std::to_string(len).size() + body.size() != len) ++len;
  return std::to_string(len) + body;
}

// A pax extended header ('x') setting the path before a member.
inline std::string TarPaxPath(const std::string& name, const std::string& data) {
  TarHeaderSpec x{"PaxHeaders/x"};
  x.type = 'x';
  return TarMemberBytes(x, PaxRecord("path", name)) + TarMemberBytes({name.substr(0, 99)}, data);
}

// The end of an archive: two zero blocks.
inline std::string TarEnd() { return std::string(1024, '\0'); }

}  // namespace gpufeed::testing
