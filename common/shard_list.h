// Bounds on an explicit list of shard files (DatasetSpec.paths), checked by the client
// library before it sends one and by gpufeedd when it receives one: a list fits one Attach
// (gpufeedd takes requests of up to 4 MiB) and is named entry by entry in errors.
#pragma once

#include <cstddef>

namespace gpufeed {

inline constexpr size_t kMaxListedShards = 16384;
inline constexpr size_t kMaxListedShardBytes = size_t{2} << 20;  // the paths' bytes together

}  // namespace gpufeed
