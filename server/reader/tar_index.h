// An index of a tar file's regular members (where each one's bytes lie), for random access by
// pread: what a WebDataset shard is read through.
//
// Why our own reader rather than libarchive (Debian's libarchive-dev): gpufeed needs only the
// offset and size of every member of an uncompressed tar, to pread any member at any time in
// the epoch's random order. libarchive is a stream reader: it walks entries in order and hands
// out their data through its own buffers; it reports where a header lies
// (archive_read_header_position) but not where the data starts after the pax or GNU blocks
// before it, so we would derive the offsets from the header layout ourselves anyway, and the
// reads that matter would bypass it. The formats WebDataset's writers produce (Python's
// tarfile: GNU or pax; GNU tar; ustar) need ~200 lines: 512-byte headers with a checksum,
// octal or base-256 sizes, the ustar prefix, GNU long names ('L') and pax extended headers
// ('x': path and size). Compressed shards (.tar.gz) cannot be read at random offsets at all;
// their first block fails the header checksum and they are refused.
// Every byte is untrusted (docs/SECURITY.md section 6): sizes are checked against the file,
// names are bounded, and the member count and time spent are bounded by a WalkBudget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/file.h"
#include "server/reader/image_folder.h"

namespace gpufeed::server {

inline constexpr uint64_t kTarBlock = 512;
// A member whose data is at most this long carries it (a WebDataset .cls), read with its
// header at no extra cost.
inline constexpr uint64_t kTarInlineBytes = 64;
// The longest member path kept (PATH_MAX): a longer one is INVALID_ARGUMENT.
inline constexpr uint64_t kTarMaxMemberPath = 4096;

// One parsed 512-byte header block.
struct TarHeader {
  char type = '0';    // the typeflag: '0' (or '\0', '7') regular, '5' directory, 'L', 'x', ...
  std::string name;   // the name field, after the ustar prefix field and a '/' when it is set
  uint64_t size = 0;  // the size field (octal or GNU base-256)
};

// Parses a header block: nullopt for an all-zero block (the end of the archive);
// INVALID_ARGUMENT for a checksum that does not match (or is not a number: a compressed
// shard) or a size field that is not a number or past 2^62.
absl::StatusOr<std::optional<TarHeader>> ParseTarHeader(std::span<const std::byte> block);

// Applies the records of a pax extended header ("LEN key=value\n" each) to the next member:
// `path` and `size` where the records set them. INVALID_ARGUMENT for a malformed record.
absl::Status ApplyPaxRecords(absl::string_view records, std::optional<std::string>* path,
                             std::optional<uint64_t>* size);

// A regular member of a tar: its path (the ustar prefix, a GNU long name or a pax path
// applied), where its data starts and its size; `data` holds the bytes of a member of at
// most kTarInlineBytes.
struct TarMember {
  std::string path;
  uint64_t offset = 0;
  uint64_t size = 0;
  std::string data;
};

// The regular members of `file` in archive order; directories, links, devices and the like
// are skipped, pax global headers ignored. `display` names the shard in messages, which name
// the member and its header's offset: INVALID_ARGUMENT for a bad header, DATA_LOSS for a
// member or header cut by the end of the file. Each member (and each skipped entry) counts
// against `budget`.
absl::StatusOr<std::vector<TarMember>> IndexTar(const RandomAccessFile& file,
                                                const std::string& display, WalkBudget* budget);

}  // namespace gpufeed::server
