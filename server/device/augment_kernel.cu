#include "server/device/augment_kernel.h"

#include "server/augment/augment_pixel.h"

namespace gpufeed::server {
namespace {

// One thread per output pixel; blockIdx.z is the task.
__global__ void AugmentKernel(const AugmentTask* tasks, AugmentOutput out, const uint8_t* scratch,
                              uint8_t* slot) {
  const int X = blockIdx.x * blockDim.x + threadIdx.x;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  if (X < out.width && y < out.height) AugmentPixel(tasks[blockIdx.z], out, scratch, slot, y, X);
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
