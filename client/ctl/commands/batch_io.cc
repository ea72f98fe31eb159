#include "client/ctl/commands/batch_io.h"

#include <algorithm>

#include <cstddef>
#include <cstring>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#ifdef GPUFEED_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gpufeed::ctl {

absl::StatusOr<ConsumerStream> ConsumerStream::Create(int gpu_ordinal) {
#ifdef GPUFEED_WITH_CUDA
  cudaSetDevice(gpu_ordinal);
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    return absl::InternalError("--device: cannot create a CUDA stream");
  }
  return ConsumerStream(s);
#else
  return ConsumerStream();
#endif
}

ConsumerStream::ConsumerStream(ConsumerStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

ConsumerStream& ConsumerStream::operator=(ConsumerStream&& other) noexcept {
  if (this != &other) {
    Reset();
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

ConsumerStream::~ConsumerStream() { Reset(); }

void ConsumerStream::Synchronize() const {
#ifdef GPUFEED_WITH_CUDA
  if (stream_ != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
#endif
}

void ConsumerStream::Reset() {
#ifdef GPUFEED_WITH_CUDA
  if (stream_ != nullptr) {
    Synchronize();
    cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  }
#endif
  stream_ = nullptr;
}

namespace {

// sum_j (j+1) * t_j over one sample's elements, each read as an unsigned integer of its width.
uint64_t SampleChecksum(const std::byte* row, uint64_t elements, uint32_t width) {
  uint64_t sum = 0;
  for (uint64_t j = 0; j < elements; ++j) {
    uint64_t t = 0;
    switch (width) {
      case 1:
        t = static_cast<uint8_t>(row[j]);
        break;
      case 2: {
        uint16_t v;
        std::memcpy(&v, row + 2 * j, 2);
        t = v;
        break;
      }
      case 4: {
        uint32_t v;
        std::memcpy(&v, row + 4 * j, 4);
        t = v;
        break;
      }
      default:
        std::memcpy(&t, row + 8 * j, 8);
        break;
    }
    sum += (j + 1) * t;
  }
  return sum;
}

// The bytes of tensor `t` in host memory (copied back from the GPU for device delivery).
absl::StatusOr<std::vector<std::byte>> HostBytes(const client::Tensor& t, void* stream) {
  std::vector<std::byte> out(t.byte_size);
  if (t.device < 0) {
    std::memcpy(out.data(), t.data, t.byte_size);
    return out;
  }
#ifdef GPUFEED_WITH_CUDA
  auto* cs = static_cast<cudaStream_t>(stream);
  if (cudaMemcpyAsync(out.data(), t.data, t.byte_size, cudaMemcpyDeviceToHost, cs) != cudaSuccess ||
      cudaStreamSynchronize(cs) != cudaSuccess) {
    return absl::InternalError("copying a batch back from the GPU failed");
  }
#endif
  return out;
}

// Writes a version 1.0 .npy file: magic, header length, a dict header padded to 64 bytes.
absl::Status WriteNpy(const std::string& path, const std::string& descr,
                      const std::vector<int64_t>& shape, const void* data, uint64_t bytes) {
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (",
                   absl::StrJoin(shape, ", "), shape.size() == 1 ? ",), }" : "), }");
  header.append(63 - (10 + header.size()) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("--dump: cannot write ", path));
  const uint16_t length = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&length), 2);
  out << header;
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) return absl::DataLossError(absl::StrCat("--dump: short write to ", path));
  return absl::OkStatus();
}

// numpy's name for `dtype`; bfloat16, which numpy lacks, as its raw bits.
const char* NpyDescr(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
      return "|u1";
    case DType::kInt8:
      return "|i1";
    case DType::kUInt16:
      return "<u2";
    case DType::kInt16:
      return "<i2";
    case DType::kUInt32:
      return "<u4";
    case DType::kInt32:
      return "<i4";
    case DType::kInt64:
      return "<i8";
    case DType::kUInt64:
      return "<u8";
    case DType::kFloat16:
      return "<f2";
    case DType::kBFloat16:
      return "<u2";
    case DType::kFloat32:
      return "<f4";
    case DType::kFloat64:
      return "<f8";
    case DType::kBool:
      return "|b1";
    default:
      return "|u1";
  }
}

}  // namespace

absl::StatusOr<uint64_t> BatchChecksum(const client::Batch& batch, size_t tensor, void* stream) {
  const client::Tensor& t = batch.tensors()[tensor];
  absl::StatusOr<std::vector<std::byte>> host = HostBytes(t, stream);
  if (!host.ok()) return host.status();
  const uint32_t width = DTypeSize(t.dtype);
  uint64_t elements = 1;
  for (size_t d = 1; d < t.shape.size(); ++d) elements *= static_cast<uint64_t>(t.shape[d]);
  const uint64_t row_bytes = elements * width;
  uint64_t sum = 0;
  for (int64_t r = 0; r < batch.valid_count(); ++r) {
    sum += SampleChecksum(host->data() + static_cast<uint64_t>(r) * row_bytes, elements, width);
  }
  return sum;
}

absl::StatusOr<uint64_t> BatchDigest(const client::Batch& batch, void* stream) {
  uint64_t digest = 14695981039346656037ull;
  for (const client::Tensor& t : batch.tensors()) {
    absl::StatusOr<std::vector<std::byte>> host = HostBytes(t, stream);
    if (!host.ok()) return host.status();
    const uint64_t rows = t.shape.empty() ? 0 : static_cast<uint64_t>(t.shape[0]);
    const uint64_t row_bytes = rows == 0 ? 0 : host->size() / rows;
    const uint64_t valid = std::min<uint64_t>(rows, static_cast<uint64_t>(batch.valid_count()));
    for (uint64_t i = 0; i < valid * row_bytes; ++i) {
      digest = (digest ^ static_cast<uint8_t>((*host)[i])) * 1099511628211ull;
    }
  }
  return digest;
}

absl::Status DumpBatch(const client::Batch& batch, const std::string& prefix, void* stream) {
  for (const client::Tensor& t : batch.tensors()) {
    absl::StatusOr<std::vector<std::byte>> bytes = HostBytes(t, stream);
    if (!bytes.ok()) return bytes.status();
    absl::Status s = WriteNpy(absl::StrCat(prefix, ".", t.name, ".npy"), NpyDescr(t.dtype), t.shape,
                              bytes->data(), bytes->size());
    if (!s.ok()) return s;
  }
  const std::vector<int64_t>& ids = batch.ids();
  return WriteNpy(absl::StrCat(prefix, ".ids.npy"), "<i8", {static_cast<int64_t>(ids.size())},
                  ids.data(), ids.size() * sizeof(int64_t));
}

}  // namespace gpufeed::ctl
