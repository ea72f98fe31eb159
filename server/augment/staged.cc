#include "server/augment/staged.h"

#include "server/augment/stage_arena.h"

#include <algorithm>

#include <unistd.h>

namespace gpufeed::server {
namespace {

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

StagedLayout MakeStagedLayout(int64_t batch, const OutputSpec& output, int out_height,
                              int out_width, uint64_t bytes_per_sample) {
  const uint64_t b = static_cast<uint64_t>(batch);
  const uint64_t final_row_bytes = OutputBytes(output, out_height, out_width);
  StagedLayout l;
  l.batch = batch;
  l.final_row_bytes = final_row_bytes;
  l.output = output;
  l.out_height = out_height;
  l.out_width = out_width;
  l.labels_offset = 0;
  l.records_offset = AlignUp(l.labels_offset + b * sizeof(int64_t), 256);
  l.tasks_offset = AlignUp(l.records_offset + b * sizeof(StagedRecord), 256);
  l.arena_offset = AlignUp(l.tasks_offset + b * sizeof(AugmentTask), 256);
  // Every sample must fit at least as a finished row, aligned.
  l.arena_bytes = b * AlignUp(std::max(bytes_per_sample, final_row_bytes), 256);
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  l.stride_bytes = AlignUp(l.arena_offset + l.arena_bytes, page);
  l.device_tasks_bytes = AlignUp(b * sizeof(AugmentTask), 256);
  l.device_scratch_bytes = l.device_tasks_bytes + b * bytes_per_sample;
  return l;
}

bool StageArena::TryClaim(uint64_t host_bytes, uint64_t device_bytes, Claim* out) {
  host_bytes = AlignUp(std::max<uint64_t>(host_bytes, 1), kAlign);
  device_bytes = AlignUp(device_bytes, kAlign);
  const uint64_t device_room = layout_.device_scratch_bytes - layout_.device_tasks_bytes;
  const uint64_t row = AlignUp(layout_.final_row_bytes, kAlign);
  absl::MutexLock lock(&mu_);
  const uint64_t after = static_cast<uint64_t>(layout_.batch - placed_ - 1);  // still to come
  if (placed_ >= layout_.batch || host_used_ + host_bytes + after * row > layout_.arena_bytes ||
      device_used_ + device_bytes > device_room) {
    return false;
  }
  out->host_offset = host_used_;
  out->device_offset = layout_.device_tasks_bytes + device_used_;
  host_used_ += host_bytes;
  device_used_ += device_bytes;
  ++placed_;
  return true;
}

StageArena::Claim StageArena::ClaimFinal() {
  const uint64_t row = AlignUp(layout_.final_row_bytes, kAlign);
  absl::MutexLock lock(&mu_);
  Claim c{host_used_, 0};
  host_used_ += row;
  ++placed_;
  return c;
}

}  // namespace gpufeed::server
