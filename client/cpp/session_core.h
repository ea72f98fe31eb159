// Internal to the client: everything a session shares with its batches (the stream, the mapped
// ring, the reader thread, the releases, the position). Session and Batch are thin handles on
// it; batches hold it by shared_ptr, so the mapping outlives the last batch.
//
// Re-attach. A session is a series of *attachments* (links), one per daemon
// session: the first in Session::Attach, another each time the stream or the connection ends
// with UNAVAILABLE (daemon killed, restarting, shutting down, draining) and
// `reconnect_timeout` > 0. It is done by Next(), on the consumer's thread, once every batch
// the old stream had delivered has been handed out (they lie in the old ring, which stays
// mapped): position_ is then exactly the next batch the user has not seen. Next() joins the
// old reader, then retries with backoff (50 ms doubling to 200 ms, bounded by the call's own
// timeout and by reconnect_timeout from the first failure): the same AttachRequest as the
// first (job, rank, world size, feed spec, delivery, ring slots, stop epoch, elastic) but for
// batch_size, which is the one the session serves (an elastic resume may serve another), with
// the dataset opened and passed again and start = position_ (its global cursor included) with
// the feed's fingerprint, then MapRing and OpenStream as the first time. UNAVAILABLE, NOT_FOUND (no socket yet), DEADLINE_EXCEEDED and
// ALREADY_EXISTS (the old daemon still ending our old session) are retried; anything else
// (another feed: FAILED_PRECONDITION, another slot layout) ends the session with that error.
// Each ring mapping is a RingMapping held by shared_ptr by the core and by every batch in
// it, so a batch handed out before a re-attach stays readable until released. Each batch
// carries the link it came from; OpenStream bumps the link under release_mu_ (dropping the
// releases queued for the old session) and under write_mu_, so a release of an old batch
// goes nowhere: never to the new session, whose slots and generations it could alias.
#pragma once

#include <atomic>
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

// The position after batch `b`, from the daemon's global cursor and end-of-epoch mark
// (BatchReady.samples, end_of_epoch): after an elastic resume an epoch may have another
// number of steps than `steps_per_epoch`. A daemon before those fields sends neither (a
// batch within an epoch always moves the cursor): then by `steps_per_epoch`, samples 0.
Position PositionAfter(const v1::BatchReady& b, int64_t steps_per_epoch);

// One attachment's ring as this process maps it: host memory or a device ring.
struct RingMapping {
  Mapping host;                               // host delivery
  std::unique_ptr<DeviceRingMapping> device;  // device delivery
  const std::byte* base() const { return device != nullptr ? device->base() : host.data(); }
};

// Set up in order, on one thread: Attach, MapRing, OpenStream (which starts the reader). From
// then on Next, Release (from any thread), Detach and the accessors are safe to call.
class SessionCore : public std::enable_shared_from_this<SessionCore> {
 public:
  // `socket` is the gRPC socket's path as this process sees it: the memory socket lies beside it.
  // `keepalive`: a re-attach's channels ping as the first one does (rpc.h, ChannelFor).
  SessionCore(std::shared_ptr<grpc::Channel> channel, std::string socket,
              absl::Duration rpc_timeout, absl::Duration reconnect_timeout,
              absl::Duration keepalive = absl::ZeroDuration());
  ~SessionCore();  // detaches if DetachWhenUnused was called; stops the stream, joins the reader

  // Validates `options`, attaches and checks the daemon's reply (the layout lies in the slots).
  absl::StatusOr<SessionInfo> Attach(const AttachOptions& options) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens the dataset `request` names with this process's rights and passes the descriptor
  // to the daemon on its memory socket (docs/SECURITY.md section 2); sets dataset.handle.
  // An error opening it names the path and the errno, in the client's words.
  absl::Status PassDataset(v1::AttachRequest* request);
  // Sends `mem` (with the descriptor `fd`, or none when -1) on the memory socket, names the
  // handle it gives in `dataset`, and keeps the connection as the lifeline. `what` names the
  // dataset in errors.
  absl::Status HandOver(const v1::MemRequest& mem, int fd, const std::string& what,
                        v1::DatasetSpec* dataset);
  // Maps the ring: host memory or a VMM fd from the memory socket, or a legacy IPC handle.
  absl::Status MapRing();
  // Opens the stream and starts the reader thread.
  absl::Status OpenStream();

  // Re-attaches when the stream ended with UNAVAILABLE (the comment at the top).
  absl::StatusOr<Batch> Next(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns a slot of attachment `link` (mapped as `ring`) to the daemon; from any thread.
  // A slot of an earlier attachment goes nowhere.
  void Release(int32_t slot, uint64_t generation, absl::Duration waited, void* stream,
               RingMapping* ring, uint64_t link) ABSL_LOCKS_EXCLUDED(mu_, release_mu_, write_mu_);
  // Ends the session at the daemon and stops the stream. Idempotent.
  absl::Status Detach() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  // The Session is gone: detach when the core is, that is once the last batch the user still
  // holds is released. The daemon frees an ended ring's pages (docs/SECURITY.md section 3),
  // so detaching earlier would turn a held batch's bytes into zeros.
  // Detaches now if no batch is held (its status), else when the last held one is released
  // (OK now).
  absl::Status DetachWhenUnused() ABSL_LOCKS_EXCLUDED(mu_);
  // A Batch handed out by Next has been released (Batch::Release): counts the held batches.
  void BatchReleased() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Position> DaemonPosition();
  static absl::Status WaitReady(const RingMapping* ring, int32_t slot, void* stream);

  Position position() const ABSL_LOCKS_EXCLUDED(mu_);
  // A blend's segments as the daemon last reported them (AttachResponse.blend_segments).
  std::vector<BlendSegment> blend_segments() const ABSL_LOCKS_EXCLUDED(mu_);
  // A re-attach is under way (Next's thread): Next returned DEADLINE_EXCEEDED while the
  // daemon was away; the next call goes on re-attaching, within reconnect_timeout.
  bool reconnecting() const { return reconnecting_.load(); }
  int64_t rejected() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Event {
    bool end = false;  // the end marker, after the last batch before stop_epoch
    v1::BatchReady batch;
  };

  std::vector<std::string> ReadyEvents() const;
  // Sends `request` (PassDataset first) and takes the reply: the first time (`again` false)
  // it sets the layout, later it checks the daemon came back with the same one.
  absl::StatusOr<SessionInfo> AttachWith(v1::AttachRequest request, bool again);
  // Checks the blend segments of `response` (to `request`) and keeps them: blend_segments_,
  // and request_'s blend_history for a re-attach.
  absl::Status KeepBlendSegments(const v1::AttachRequest& request,
                                 const v1::AttachResponse& response) ABSL_LOCKS_EXCLUDED(mu_);
  // rpc_timeout, or while re-attaching what is left of reconnect_timeout if less.
  absl::Duration CallTimeout() const;
  // One attempt: attach at position_, map the new ring, open its stream (ReattachSteps);
  // closes the attempt's lifeline when it fails.
  absl::Status ReattachOnce() ABSL_LOCKS_EXCLUDED(mu_, write_mu_, release_mu_);
  absl::Status ReattachSteps() ABSL_LOCKS_EXCLUDED(mu_, write_mu_, release_mu_);
  // Until re-attached (OK), the call's `deadline` passed (DEADLINE_EXCEEDED; the next call
  // goes on), reconnect_timeout passed or a hard error (the session's end).
  absl::Status Reconnect(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_, write_mu_, release_mu_);
  // The reader thread: queues batches and rejections until the stream ends, then records why.
  void ReadLoop() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  // Stops the stream and joins the reader. Safe to call twice.
  void Stop() ABSL_LOCKS_EXCLUDED(write_mu_);

  // Replaced by each re-attach attempt (a new connection), on Next's thread.
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Feed::Stub> stub_;
  const std::string socket_;
  const absl::Duration rpc_timeout_;
  const absl::Duration reconnect_timeout_;
  const absl::Duration keepalive_;
  // The first Attach's, dataset handle cleared, blend_history the last attach's segments.
  v1::AttachRequest request_;
  int64_t stop_epoch_ = 0;

  // Set by Attach, MapRing and OpenStream before the reader starts; read-only afterwards,
  // except by a re-attach (Next's thread, the reader joined).
  std::string mem_socket_;
  uint32_t daemon_protocol_ = 0;  // from GetStatus (PassDataset)
  // The open_dataset connection, held open while the session lives (MemRequest.lifeline):
  // should this process die before its stream opens, the daemon frees the ring at once.
  UniqueFd lifeline_;
  uint64_t session_id_ = 0;
  std::string token_;
  int64_t steps_per_epoch_ = 1;
  // Samples per rank per step the session serves (AttachResponse.batch_size; an older daemon
  // sends 0: the request's). A re-attach asks for it, start.fingerprint naming the layout.
  int64_t batch_size_ = 0;
  uint64_t stride_ = 0;
  int32_t ring_slots_ = 0;
  std::vector<Tensor> layout_;
  std::vector<uint64_t> offsets_;
  std::string fingerprint_;  // the feed's
  bool device_ = false;      // device delivery
  GpuTarget gpu_;
  v1::DeviceRing device_reply_;
  std::shared_ptr<RingMapping> ring_;  // this attachment's; freed after its last batch
  uint64_t link_ = 0;                  // this attachment's number, from 1
  // A re-attach under way: from the stream's failure until a new stream is open. Written on
  // Next's thread; atomic, as Session::reconnecting() may be read from any.
  std::atomic<bool> reconnecting_{false};
  // Next's thread only: give_up_ is set (from the first failure until a batch of a new stream
  // is handed out).
  bool bounded_ = false;
  absl::Time give_up_;
  absl::Duration backoff_;
  std::string last_error_;
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  // Once the reader runs, it alone calls Read and Finish; writes happen under write_mu_.
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream_;
  std::thread reader_;

  absl::Mutex write_mu_;  // one writer on the stream at a time
  bool writes_done_ ABSL_GUARDED_BY(write_mu_) = false;
  uint64_t stream_link_ ABSL_GUARDED_BY(write_mu_) = 0;  // the link stream_ belongs to

  absl::Mutex release_mu_;
  v1::StreamRequest releases_ ABSL_GUARDED_BY(release_mu_);  // queued, not yet written
  bool release_writer_active_ ABSL_GUARDED_BY(release_mu_) = false;
  uint64_t release_link_ ABSL_GUARDED_BY(release_mu_) = 0;  // whose releases are queued

  mutable absl::Mutex mu_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  absl::Status end_ ABSL_GUARDED_BY(mu_);  // not OK once the stream is over
  Position position_ ABSL_GUARDED_BY(mu_);
  // A blend's segments from the last attach; each attach also puts them in request_'s
  // blend_history, so that a re-attach resumes the blend the daemon last reported.
  std::vector<BlendSegment> blend_segments_ ABSL_GUARDED_BY(mu_);
  int64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_rejection_ ABSL_GUARDED_BY(mu_);
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
  bool detach_when_unused_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> held_{0};  // batches handed out by Next and not yet released
};

}  // namespace gpufeed::client::internal
