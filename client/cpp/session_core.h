// Internal to the client: everything a session shares with its batches (the stream, the mapped
// ring, the reader thread, the releases, the position). Session and Batch are thin handles on
// it; batches hold it by shared_ptr, so the mapping outlives the last batch.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/cpp/device_ring.h"
#include "common/os/fd.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gpufeed::client::internal {

// Set up in order, on one thread: Attach, MapRing, OpenStream (which starts the reader). From
// then on Next, Release (from any thread), Detach and the accessors are safe to call.
class SessionCore : public std::enable_shared_from_this<SessionCore> {
 public:
  // `socket` is the gRPC socket's path as this process sees it: the memory socket lies beside it.
  SessionCore(std::shared_ptr<grpc::Channel> channel, std::string socket,
              absl::Duration rpc_timeout);
  ~SessionCore();  // stops the stream and joins the reader; does not detach

  // Validates `options`, attaches and checks the daemon's reply (the layout lies in the slots).
  absl::StatusOr<SessionInfo> Attach(const AttachOptions& options) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens the dataset `request` names with this process's rights and passes the descriptor
  // to the daemon on its memory socket (docs/SECURITY.md section 2); sets dataset.handle.
  // An error opening it names the path and the errno, in the client's words.
  absl::Status PassDataset(v1::AttachRequest* request);
  // Maps the ring: host memory or a VMM fd from the memory socket, or a legacy IPC handle.
  absl::Status MapRing();
  // Opens the stream and starts the reader thread.
  absl::Status OpenStream();

  absl::StatusOr<Batch> Next(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns a slot to the daemon; from any thread.
  void Release(int32_t slot, uint64_t generation, absl::Duration waited, void* stream)
      ABSL_LOCKS_EXCLUDED(mu_, release_mu_, write_mu_);
  // Ends the session at the daemon and stops the stream. Idempotent.
  absl::Status Detach() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  absl::StatusOr<Position> DaemonPosition();
  absl::Status WaitReady(int32_t slot, void* stream) const;

  Position position() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t rejected() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Event {
    bool end = false;  // the end marker, after the last batch before stop_epoch
    v1::BatchReady batch;
  };

  std::vector<std::string> ReadyEvents() const;
  // The reader thread: queues batches and rejections until the stream ends, then records why.
  void ReadLoop() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  // Stops the stream and joins the reader. Safe to call twice.
  void Stop() ABSL_LOCKS_EXCLUDED(write_mu_);

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Feed::Stub> stub_;
  const std::string socket_;
  const absl::Duration rpc_timeout_;

  // Set by Attach, MapRing and OpenStream before the reader starts; read-only afterwards.
  std::string mem_socket_;
  uint64_t session_id_ = 0;
  std::string token_;
  int64_t steps_per_epoch_ = 1;
  uint64_t stride_ = 0;
  int32_t ring_slots_ = 0;
  std::vector<Tensor> layout_;
  std::vector<uint64_t> offsets_;
  std::string fingerprint_;  // the feed's
  Mapping mapping_;          // host delivery
  bool device_ = false;      // device delivery
  GpuTarget gpu_;
  v1::DeviceRing device_reply_;
  std::unique_ptr<DeviceRingMapping> device_ring_;  // freed after the last batch
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  // Once the reader runs, it alone calls Read and Finish; writes happen under write_mu_.
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream_;
  std::thread reader_;

  absl::Mutex write_mu_;  // one writer on the stream at a time
  bool writes_done_ ABSL_GUARDED_BY(write_mu_) = false;

  absl::Mutex release_mu_;
  v1::StreamRequest releases_ ABSL_GUARDED_BY(release_mu_);  // queued, not yet written
  bool release_writer_active_ ABSL_GUARDED_BY(release_mu_) = false;

  mutable absl::Mutex mu_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  absl::Status end_ ABSL_GUARDED_BY(mu_);  // not OK once the stream is over
  Position position_ ABSL_GUARDED_BY(mu_);
  int64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_rejection_ ABSL_GUARDED_BY(mu_);
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace gpufeed::client::internal
