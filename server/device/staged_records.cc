#include "server/device/staged_records.h"

#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace gpufeed::server {
namespace {

// [offset, offset + bytes) lies within [0, limit), without wrapping.
bool Within(uint64_t offset, uint64_t bytes, uint64_t limit) {
  return offset <= limit && bytes <= limit - offset;
}

absl::Status Bad(int row, const char* what) {
  return absl::InternalError(absl::StrCat("staged batch row ", row, ": ", what));
}

// The kernel reads rows crop_top + [0, crop_height) and columns crop_left + [0, crop_width)
// of a src_height x src_width RGB source, src_width * 3 bytes a row, and maps its window
// (offsets added to output coordinates in int) onto a resize_height x resize_width image.
absl::Status CheckGeometry(const StagedGeometry& g, uint64_t device_bytes, int row) {
  constexpr int32_t kMaxWindow = int32_t{1} << 30;  // y + window_top cannot overflow
  if (g.src_height <= 0 || g.src_width <= 0 ||
      g.src_width > std::numeric_limits<int32_t>::max() / 3) {
    return Bad(row, "source size out of range");
  }
  const uint64_t source = static_cast<uint64_t>(g.src_height) *
                          static_cast<uint64_t>(g.src_width) * 3;
  if (source > device_bytes) return Bad(row, "source larger than its scratch range");
  if (g.crop_top < 0 || g.crop_left < 0 || g.crop_height <= 0 || g.crop_width <= 0 ||
      g.crop_height > g.src_height - g.crop_top || g.crop_width > g.src_width - g.crop_left) {
    return Bad(row, "crop outside the source");
  }
  if (g.resize_height <= 0 || g.resize_width <= 0 || g.resize_height > kMaxWindow ||
      g.resize_width > kMaxWindow || g.window_top < -kMaxWindow || g.window_top > kMaxWindow ||
      g.window_left < -kMaxWindow || g.window_left > kMaxWindow) {
    return Bad(row, "resize or window out of range");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckStagedRecord(const StagedRecord& r, int row, const StagedLayout& layout,
                               const StagedOutput& output) {
  switch (r.kind) {
    case StagedKind::kFinal:
      // A finished row, copied as is into the slot's image row.
      if (!Within(r.host_offset, output.image_row_bytes, layout.arena_bytes)) {
        return Bad(row, "finished row outside the slot's arena");
      }
      return absl::OkStatus();
    case StagedKind::kRaw:
    case StagedKind::kJpeg:
      break;
    default:
      return Bad(row, "unknown record kind");
  }
  if (r.host_bytes == 0 || !Within(r.host_offset, r.host_bytes, layout.arena_bytes)) {
    return Bad(row, "sample bytes outside the slot's arena");
  }
  // The scratch starts with the kernel's tasks; samples lie after them.
  if (r.device_offset < layout.device_tasks_bytes ||
      !Within(r.device_offset, r.device_bytes, layout.device_scratch_bytes)) {
    return Bad(row, "scratch range outside the ring's scratch");
  }
  if (r.kind == StagedKind::kRaw && r.host_bytes > r.device_bytes) {
    return Bad(row, "raw pixels larger than their scratch range");
  }
  return CheckGeometry(r.geometry, r.device_bytes, row);
}

absl::StatusOr<std::vector<StagedRecord>> ReadStagedRecords(const std::byte* host,
                                                            const StagedLayout& layout,
                                                            int count,
                                                            const StagedOutput& output) {
  if (count < 0 || count > layout.batch) {
    return absl::InternalError(absl::StrCat("staged batch of ", count,
                                            " rows: the slot holds at most ", layout.batch));
  }
  std::vector<StagedRecord> records(static_cast<size_t>(count));
  if (count > 0) {
    std::memcpy(records.data(), host + layout.records_offset,
                records.size() * sizeof(StagedRecord));
  }
  for (int i = 0; i < count; ++i) {
    if (absl::Status s = CheckStagedRecord(records[static_cast<size_t>(i)], i, layout, output);
        !s.ok()) {
      return s;
    }
  }
  return records;
}

}  // namespace gpufeed::server
