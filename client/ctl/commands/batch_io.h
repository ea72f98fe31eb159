// What gpufeedctl consume does with a batch besides counting it: the consumer's CUDA stream,
// checksums and .npy dumps (both read device batches back through that stream).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {

// The consumer's own CUDA stream, for device delivery: batches are waited for and released on
// it, the way a training step would. Its one owner: the destructor waits for the stream's work
// and destroys it, on every path out of the command. A default-constructed one holds no stream
// (host delivery), and so does every one in a build without CUDA.
class ConsumerStream {
 public:
  ConsumerStream() = default;
  // Makes `gpu_ordinal` the current device (it stays so, for the copies back) and creates a
  // non-blocking stream on it.
  static absl::StatusOr<ConsumerStream> Create(int gpu_ordinal);

  ConsumerStream(ConsumerStream&& other) noexcept;
  ConsumerStream& operator=(ConsumerStream&& other) noexcept;
  ConsumerStream(const ConsumerStream&) = delete;
  ConsumerStream& operator=(const ConsumerStream&) = delete;
  ~ConsumerStream();

  // The cudaStream_t as the client library takes it; nullptr without one.
  void* get() const { return stream_; }
  // Waits for the work queued on the stream.
  void Synchronize() const;

 private:
  explicit ConsumerStream(void* stream) : stream_(stream) {}
  void Reset();

  void* stream_ = nullptr;
};

// The checksum gpufeedctl prints for tensor `tensor` of `batch`: over its valid samples, the
// sum of sum_j (j+1) * t_j, t_j a sample's j-th element read as an unsigned integer of its
// width, mod 2^64. Device batches are copied back on `stream` first.
absl::StatusOr<uint64_t> BatchChecksum(const client::Batch& batch, size_t tensor, void* stream);
// FNV-1a (64 bits) of the bytes of every tensor's valid rows, in tensor order: equal digests
// are, for a test, equal batches byte for byte.
absl::StatusOr<uint64_t> BatchDigest(const client::Batch& batch, void* stream);

// Writes each tensor of `batch` as PREFIX.<tensor>.npy and its ids as PREFIX.ids.npy.
absl::Status DumpBatch(const client::Batch& batch, const std::string& prefix, void* stream);

}  // namespace gpufeed::ctl
