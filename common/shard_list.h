// What the client library and gpufeedd agree on about lists of shard files: the bounds on an
// explicit list (DatasetSpec.paths), checked by the client before it sends one and by gpufeedd
// when it receives one (a list fits one Attach: gpufeedd takes requests of up to 4 MiB, and is
// named entry by entry in errors), and which files go with a token shard instead of being
// shards themselves (docs/howto/token-files.md).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace gpufeed {

inline constexpr size_t kMaxListedShards = 16384;
inline constexpr size_t kMaxListedShardBytes = size_t{2} << 20;  // the paths' bytes together

// A token shard's document offsets: S.offsets.npy beside S.<extension> (S.npy, S.bin, ...).
inline constexpr char kOffsetsSuffix[] = ".offsets.npy";

// The offsets file that goes with shard `name` (a name or a path): its name up to its last
// extension, then .offsets.npy ("web_0.npy" -> "web_0.offsets.npy", "train" ->
// "train.offsets.npy").
inline std::string OffsetsFileOf(std::string_view name) {
  const size_t slash = name.find_last_of('/');
  const size_t dot = name.find_last_of('.');
  const bool has_ext = dot != std::string_view::npos && dot > 0 &&
                       (slash == std::string_view::npos || dot > slash + 1);
  return std::string(has_ext ? name.substr(0, dot) : name) + std::string(kOffsetsSuffix);
}

// Whether `name` is a companion of another name of `sorted` (sorted names of one directory):
// Megatron's X.idx of an X.bin there, or the offsets file (OffsetsFileOf) of a shard there.
// A companion is read with its shard, never as a shard itself; one without its shard is no
// companion (a reader refuses it, named, where it is selected).
inline bool IsCompanionIn(const std::string& name, const std::vector<std::string>& sorted) {
  const auto has = [&sorted](const std::string& n) {
    return std::binary_search(sorted.begin(), sorted.end(), n);
  };
  constexpr std::string_view kIdx = ".idx";
  if (name.size() > kIdx.size() && name.compare(name.size() - kIdx.size(), kIdx.size(), kIdx) == 0) {
    return has(name.substr(0, name.size() - kIdx.size()) + ".bin");
  }
  const size_t n = std::string_view(kOffsetsSuffix).size();
  if (name.size() <= n || name.compare(name.size() - n, n, kOffsetsSuffix) != 0) return false;
  // The shards whose offsets file this is: S itself and S.<ext>, which sort right after S.
  const std::string stem = name.substr(0, name.size() - n);
  for (auto it = std::lower_bound(sorted.begin(), sorted.end(), stem);
       it != sorted.end() && it->compare(0, stem.size(), stem) == 0; ++it) {
    if (*it != name && OffsetsFileOf(*it) == name) return true;
  }
  return false;
}

}  // namespace gpufeed
