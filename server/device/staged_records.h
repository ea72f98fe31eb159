// A staged slot's records, as the device acts on them (docs/SECURITY.md section 3): copied
// out of the host slot into daemon memory once, then checked against the slot's layout
// before any copy, decode or kernel task uses them. A record that points outside its slot's
// arena or the ring's device scratch, a geometry that reads outside its source, or a row
// count above the batch is an error for the batch (INTERNAL), never an out-of-bounds read or
// write. The CUDA ring and the fake backend both go through this.
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "server/augment/staged.h"
#include "server/device/device_backend.h"

namespace gpufeed::server {

// The `count` records of the staged slot `host` (laid out by `layout`, its results going to
// `output`), each checked. The copy is what the caller uses: a later write to the slot
// cannot change what was checked.
absl::StatusOr<std::vector<StagedRecord>> ReadStagedRecords(const std::byte* host,
                                                            const StagedLayout& layout,
                                                            int count,
                                                            const StagedOutput& output);

// One record, row `row` of its batch.
absl::Status CheckStagedRecord(const StagedRecord& r, int row, const StagedLayout& layout,
                               const StagedOutput& output);

}  // namespace gpufeed::server
