// The staged form of an image batch, for the GPU paths: instead of finished tensors, the host
// slot holds per sample what the GPU needs to finish it, and the GPU's copy thread decodes
// (nvJPEG), crops, resizes, flips, normalises, casts and lays out into the consumer's slot.
//
// Host slot in staged form:
//   [labels: batch x int64, final layout][records: batch x StagedRecord][tasks: batch x
//   AugmentTask, written by the copy thread][arena: sample bytes, claimed per sample]
// A sample is staged as one of:
//   kRaw   decoded uint8 RGB of the region the kernel reads (the crop box, or the whole image
//          when it is resized first); copied to the device scratch, then the kernel.
//   kJpeg  the file's bytes; nvJPEG decodes them into the device scratch, then the kernel.
//   kFinal the finished image row, augmented on the CPU (when the arena or the device scratch
//          has no room for the sample's raw form); copied into the slot's image row as is.
#pragma once

#include <cstddef>
#include <cstdint>

#include "server/augment/output.h"

namespace gpufeed::server {

enum class StagedKind : uint32_t { kFinal = 0, kRaw = 1, kJpeg = 2 };

// Where a sample's image comes from and how the kernel maps it onto the output. The kernel
// crops `crop` out of the source, resamples it (antialiased bilinear) to resize_height x
// resize_width, takes the out_height x out_width window at (window_top, window_left) of that
// (zeros outside, as CenterCrop pads) and flips it left-right when `flip`.
struct StagedGeometry {
  int32_t src_height = 0, src_width = 0;
  int32_t crop_top = 0, crop_left = 0, crop_height = 0, crop_width = 0;
  int32_t resize_height = 0, resize_width = 0;
  int32_t window_top = 0, window_left = 0;
  int32_t flip = 0;
};

struct StagedRecord {
  StagedKind kind = StagedKind::kFinal;
  StagedGeometry geometry;
  uint64_t host_offset = 0;  // from the arena's start
  uint64_t host_bytes = 0;
  uint64_t device_offset = 0;  // from the device scratch's start (kRaw, kJpeg)
  uint64_t device_bytes = 0;
};

// One sample for the GPU kernel (device/augment_kernel.h). Written by the copy thread into
// the host slot's task area, copied to the start of the device scratch.
struct AugmentTask {
  uint64_t src_offset = 0;  // the source's first byte, from the device scratch's start
  int32_t src_pitch = 0;    // bytes from one source row to the next
  int32_t row = 0;          // the sample's row in the batch
  StagedGeometry geometry;
};

// A staged slot's layout. Offsets are from the slot's start.
struct StagedLayout {
  int64_t batch = 0;
  uint64_t labels_offset = 0;
  uint64_t records_offset = 0;
  uint64_t tasks_offset = 0;
  uint64_t arena_offset = 0;
  uint64_t arena_bytes = 0;
  uint64_t stride_bytes = 0;           // page-aligned
  uint64_t device_tasks_bytes = 0;     // the tasks at the device scratch's start
  uint64_t device_scratch_bytes = 0;   // per device ring: tasks, then pixels
  uint64_t final_row_bytes = 0;        // one finished image row
  OutputSpec output;                   // of the finished image
  int32_t out_height = 0, out_width = 0;
};

// Arena room per sample, on the host and on the GPU (shared by the batch's samples: small
// files and crops leave room for large ones). 640 KiB holds a 500x375 JPEG decoded, and
// ImageNet's mean image (~400x350) with room to spare.
inline constexpr uint64_t kStageBytesPerSample = uint64_t{640} << 10;

StagedLayout MakeStagedLayout(int64_t batch, const OutputSpec& output, int out_height,
                              int out_width, uint64_t bytes_per_sample = kStageBytesPerSample);

}  // namespace gpufeed::server
