#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "server/device/augment_kernel.h"

namespace gpufeed::server {
namespace {

// The taps of output index `i` when resampling `in` samples to `out`: inputs [lo, hi) with
// raw triangle weights max(0, 1 - |(j - center + 0.5) * inv|), normalised by their sum. The
// same arithmetic (double, then float weights) as ComputeResampleWeights in resize.cc.
struct Taps {
  int lo = 0, hi = 0;
  double center = 0, inv = 1, total = 0;

  __device__ Taps(int i, int in, int out) {
    const double scale = static_cast<double>(in) / out;
    const double support = scale >= 1.0 ? scale : 1.0;
    inv = scale >= 1.0 ? 1.0 / scale : 1.0;
    center = scale * (i + 0.5);
    lo = max(static_cast<int>(center - support + 0.5), 0);
    hi = min(static_cast<int>(center + support + 0.5), in);
    for (int j = lo; j < hi; ++j) total += Raw(j);
  }
  __device__ double Raw(int j) const { return fmax(0.0, 1.0 - fabs((j - center + 0.5) * inv)); }
  __device__ float Weight(int j) const {
    return total > 0 ? static_cast<float>(Raw(j) / total) : 0.0f;
  }
};

__device__ void Store(float v, int c, const AugmentOutput& out, uint8_t* dst, size_t index) {
  if (out.dtype == AugmentDType::kUInt8) {
    dst[index] = static_cast<uint8_t>(fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f));
    return;
  }
  v /= 255.0f;
  if (out.normalize) v = (v - out.mean[c]) / out.std[c];
  switch (out.dtype) {
    case AugmentDType::kFloat16:
      reinterpret_cast<__half*>(dst)[index] = __float2half_rn(v);
      break;
    case AugmentDType::kBFloat16:
      reinterpret_cast<__nv_bfloat16*>(dst)[index] = __float2bfloat16_rn(v);
      break;
    default:
      reinterpret_cast<float*>(dst)[index] = v;
      break;
  }
}

// One thread per output pixel; blockIdx.z is the task.
__global__ void AugmentKernel(const AugmentTask* tasks, AugmentOutput out, const uint8_t* scratch,
                              uint8_t* slot) {
  const AugmentTask& task = tasks[blockIdx.z];
  const StagedGeometry& g = task.geometry;
  const int X = blockIdx.x * blockDim.x + threadIdx.x;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  if (X >= out.width || y >= out.height) return;
  const int x = g.flip ? out.width - 1 - X : X;  // output column X shows sampled column x
  const int ry = y + g.window_top, rx = x + g.window_left;
  float rgb[3] = {0, 0, 0};
  if (ry >= 0 && ry < g.resize_height && rx >= 0 && rx < g.resize_width) {
    const Taps ty(ry, g.crop_height, g.resize_height);
    const Taps tx(rx, g.crop_width, g.resize_width);
    const uint8_t* src = scratch + task.src_offset;
    for (int jy = ty.lo; jy < ty.hi; ++jy) {
      const float wy = ty.Weight(jy);
      const uint8_t* line = src + static_cast<size_t>(g.crop_top + jy) * task.src_pitch +
                            static_cast<size_t>(g.crop_left) * 3;
      float r = 0, gr = 0, b = 0;
      for (int jx = tx.lo; jx < tx.hi; ++jx) {
        const float wx = tx.Weight(jx);
        const uint8_t* s = line + 3 * jx;
        r += wx * s[0];
        gr += wx * s[1];
        b += wx * s[2];
      }
      rgb[0] += wy * r;
      rgb[1] += wy * gr;
      rgb[2] += wy * b;
    }
  }
  uint8_t* image = slot + out.image_offset + static_cast<size_t>(task.row) * out.row_bytes;
  const size_t plane = static_cast<size_t>(out.height) * out.width;
  const size_t p = static_cast<size_t>(y) * out.width + X;
  for (int c = 0; c < 3; ++c) Store(rgb[c], c, out, image, out.nchw ? c * plane + p : 3 * p + c);
}

}  // namespace

cudaError_t LaunchAugment(const AugmentTask* tasks, int count, const AugmentOutput& output,
                          const uint8_t* scratch, uint8_t* slot, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const dim3 block(32, 8);
  const dim3 grid((output.width + block.x - 1) / block.x, (output.height + block.y - 1) / block.y,
                  count);
  AugmentKernel<<<grid, block, 0, stream>>>(tasks, output, scratch, slot);
  return cudaGetLastError();
}

}  // namespace gpufeed::server
