#include "server/reader/tar_index.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"

namespace gpufeed::server {
namespace {

constexpr uint64_t kMaxSize = uint64_t{1} << 62;
constexpr uint64_t kMaxLongName = 64 << 10;  // a GNU long name's bytes
constexpr uint64_t kMaxPax = 1 << 20;        // a pax extended header's bytes

// A NUL-terminated (or full) field.
std::string Field(std::span<const std::byte> block, size_t at, size_t len) {
  const char* p = reinterpret_cast<const char*>(block.data()) + at;
  return std::string(p, strnlen(p, len));
}

// An octal number field: leading spaces, octal digits, then spaces or NULs to the end (or
// none). nullopt when it is anything else.
std::optional<uint64_t> Octal(std::span<const std::byte> block, size_t at, size_t len) {
  size_t i = 0;
  const auto c = [&](size_t k) { return static_cast<char>(block[at + k]); };
  while (i < len && c(i) == ' ') ++i;
  uint64_t v = 0;
  for (; i < len && c(i) >= '0' && c(i) <= '7'; ++i) {
    if (v > (kMaxSize >> 3)) return std::nullopt;
    v = v * 8 + static_cast<uint64_t>(c(i) - '0');
  }
  for (; i < len; ++i) {
    if (c(i) != ' ' && c(i) != '\0') return std::nullopt;
  }
  return v;
}

std::string HeaderAt(const std::string& display, uint64_t at) {
  return absl::StrCat("dataset.path: ", display, ": the tar header at byte ", at);
}

}  // namespace

absl::StatusOr<std::optional<TarHeader>> ParseTarHeader(std::span<const std::byte> block) {
  if (block.size() < kTarBlock) return absl::InvalidArgumentError("a header block is 512 bytes");
  if (std::all_of(block.begin(), block.begin() + kTarBlock,
                  [](std::byte b) { return b == std::byte{0}; })) {
    return std::nullopt;
  }
  // The checksum: the sum of the block's bytes with its own field read as spaces, unsigned
  // (POSIX) or, as some old writers did, signed.
  const std::optional<uint64_t> stored = Octal(block, 148, 8);
  uint64_t unsigned_sum = 0;
  int64_t signed_sum = 0;
  for (size_t i = 0; i < kTarBlock; ++i) {
    const uint8_t b = (i >= 148 && i < 156) ? ' ' : static_cast<uint8_t>(block[i]);
    unsigned_sum += b;
    signed_sum += static_cast<int8_t>(b);
  }
  if (!stored.has_value() ||
      (*stored != unsigned_sum && static_cast<int64_t>(*stored) != signed_sum)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad header checksum (stored ", stored.has_value() ? absl::StrCat(*stored) : "none",
        ", computed ", unsigned_sum, "): not a tar, a compressed one, or corrupt"));
  }
  TarHeader h;
  h.type = static_cast<char>(block[156]);
  h.name = Field(block, 0, 100);
  // POSIX ustar ("ustar\0"): a prefix field before the name. GNU's "ustar  \0" keeps other
  // things there (access and change times).
  if (std::memcmp(block.data() + 257, "ustar\0", 6) == 0) {
    const std::string prefix = Field(block, 345, 155);
    if (!prefix.empty()) h.name = absl::StrCat(prefix, "/", h.name);
  }
  if ((static_cast<uint8_t>(block[124]) & 0x80) != 0) {
    // GNU base-256: the first byte's high bit set, then a big-endian number; 0xff (negative)
    // is never a size.
    if (static_cast<uint8_t>(block[124]) == 0xff) {
      return absl::InvalidArgumentError("a negative base-256 size");
    }
    uint64_t v = static_cast<uint8_t>(block[124]) & 0x7f;
    for (size_t i = 125; i < 136; ++i) {
      if (v > (kMaxSize >> 8)) return absl::InvalidArgumentError("a size past 2^62 bytes");
      v = (v << 8) | static_cast<uint8_t>(block[i]);
    }
    h.size = v;
  } else {
    const std::optional<uint64_t> size = Octal(block, 124, 12);
    if (!size.has_value()) return absl::InvalidArgumentError("a size field that is no number");
    h.size = *size;
  }
  if (h.size > kMaxSize) return absl::InvalidArgumentError("a size past 2^62 bytes");
  return h;
}

absl::Status ApplyPaxRecords(absl::string_view records, std::optional<std::string>* path,
                             std::optional<uint64_t>* size) {
  while (!records.empty()) {
    const size_t space = records.find(' ');
    uint64_t len = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtoi(records.substr(0, space), &len) ||
        len <= space + 1 || len > records.size() || records[len - 1] != '\n') {
      return absl::InvalidArgumentError("a malformed pax record");
    }
    const absl::string_view record = records.substr(space + 1, len - space - 2);
    records.remove_prefix(len);
    const size_t eq = record.find('=');
    if (eq == absl::string_view::npos)
      return absl::InvalidArgumentError("a pax record without '='");
    const absl::string_view key = record.substr(0, eq), value = record.substr(eq + 1);
    if (key == "path") {
      *path = std::string(value);
    } else if (key == "size") {
      uint64_t v = 0;
      if (!absl::SimpleAtoi(value, &v) || v > kMaxSize) {
        return absl::InvalidArgumentError("a pax size that is no number");
      }
      *size = v;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TarMember>> IndexTar(const RandomAccessFile& file,
                                                const std::string& display, WalkBudget* budget) {
  const uint64_t end = file.size();
  std::vector<TarMember> out;
  // What the headers before the next entry said of it (GNU 'L', pax 'x').
  std::optional<std::string> long_name, pax_path;
  std::optional<uint64_t> pax_size;
  // A header with the block after it: a small member's data comes with its header.
  std::vector<std::byte> buf(2 * kTarBlock);
  uint64_t at = 0;
  while (at < end) {
    if (end - at < kTarBlock) {
      return absl::DataLossError(absl::StrCat(
          HeaderAt(display, at), " is cut by the end of the file (", end - at, " bytes left)"));
    }
    const uint64_t n = std::min<uint64_t>(buf.size(), end - at);
    GPUFEED_RETURN_IF_ERROR(file.ReadAt(at, std::span<std::byte>(buf.data(), n)));
    absl::StatusOr<std::optional<TarHeader>> header =
        ParseTarHeader(std::span<const std::byte>(buf.data(), kTarBlock));
    if (!header.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          HeaderAt(display, at),
          out.empty() ? "" : absl::StrCat(" (after member ", EscapeForLog(out.back().path), ")"),
          ": ", header.status().message()));
    }
    if (!header->has_value()) break;  // the end-of-archive blocks
    GPUFEED_RETURN_IF_ERROR(budget->Count());
    TarHeader& h = **header;
    const bool regular = h.type == '0' || h.type == '\0' || h.type == '7';
    const bool meta = h.type == 'L' || h.type == 'K' || h.type == 'x' || h.type == 'g';
    const uint64_t size = !meta && pax_size.has_value() ? *pax_size : h.size;
    const std::string name = pax_path.value_or(long_name.value_or(h.name));
    const uint64_t data = at + kTarBlock;
    if (size > end - data) {
      return absl::DataLossError(absl::StrCat(
          "dataset.path: ", display, ": member ", EscapeForLog(meta ? h.name : name),
          " (header at byte ", at, ") holds ", size, " bytes, past the end of the file (",
          end - data, " left): the shard is truncated"));
    }
    auto payload = [&](uint64_t cap) -> absl::StatusOr<std::string> {
      if (size > cap) {
        return absl::InvalidArgumentError(absl::StrCat(HeaderAt(display, at), ": a '",
                                                       std::string(1, h.type), "' header of ", size,
                                                       " bytes, more than ", cap));
      }
      std::string bytes(size, '\0');
      GPUFEED_RETURN_IF_ERROR(file.ReadAt(
          data, std::span<std::byte>(reinterpret_cast<std::byte*>(bytes.data()), size)));
      return bytes;
    };
    if (h.type == 'L') {
      GPUFEED_ASSIGN_OR_RETURN(std::string bytes, payload(kMaxLongName));
      long_name = bytes.substr(0, bytes.find('\0'));
    } else if (h.type == 'x') {
      GPUFEED_ASSIGN_OR_RETURN(std::string bytes, payload(kMaxPax));
      if (absl::Status s = ApplyPaxRecords(bytes, &pax_path, &pax_size); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(HeaderAt(display, at), ": ", s.message()));
      }
    } else if (!meta) {  // 'K' (a long link name) and 'g' (pax globals) change no member
      if (regular) {
        // Every kept name is memory until the feed goes (1 MiB pax paths in a tar linked 700
        // times would take gigabytes): a member path longer than a Linux path is refused.
        if (name.size() > kTarMaxMemberPath) {
          return absl::InvalidArgumentError(absl::StrCat(
              HeaderAt(display, at), ": a member path of ", name.size(), " bytes, more than ",
              kTarMaxMemberPath, " (", EscapeForLog(name, 64), ")"));
        }
        TarMember m{name, data, size, ""};
        if (size <= kTarInlineBytes && kTarBlock + size <= n) {
          m.data.assign(reinterpret_cast<const char*>(buf.data()) + kTarBlock, size);
        }
        out.push_back(std::move(m));
      }
      long_name.reset();
      pax_path.reset();
      pax_size.reset();
    }
    // The data, padded to a whole block; padding cut by the end of the file loses nothing.
    const uint64_t blocks = (size + kTarBlock - 1) / kTarBlock;
    at = data + std::min(blocks * kTarBlock, end - data);
  }
  return out;
}

}  // namespace gpufeed::server
