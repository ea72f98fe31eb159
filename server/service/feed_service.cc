#include "server/service/feed_service.h"

#include <pthread.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/thread_pool.h"
#include "common/version.h"
#include "server/service/convert.h"

namespace gpufeed::server {
namespace {

constexpr size_t kMaxPendingRejections = 64;
constexpr int kMaxBatchesPerMessage = 64;

// One consumer's stream. Reads are opens and releases; writes are batches, rejections and
// the end marker, one in flight at a time. Session notifications arrive on worker threads
// through `Link`, which outlives the reactor and is cut in OnDone.
//
// Lifetime: gRPC calls OnDone last, after Finish completed and no operation is pending. We
// call Finish exactly once and never while a write is in flight, so the reactor is alive
// whenever `write_in_flight_` is set or Finish has not been called.
class StreamReactor final : public grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse> {
 public:
  // `caller`: who opened the stream, or why the call is refused (answered at once, not
  // waiting for a first message). Until its open message comes, the stream counts among
  // `unopened` (capped per uid and in all: past a cap it is answered RESOURCE_EXHAUSTED at
  // once) and is ended with DEADLINE_EXCEEDED once its time is up.
  StreamReactor(SessionManager* sessions, absl::StatusOr<Caller> caller, UnopenedStreams* unopened)
      : sessions_(sessions),
        caller_(std::move(caller)),
        unopened_(unopened),
        link_(std::make_shared<Link>()) {
    link_->reactor = this;
    if (!caller_.ok()) {
      Step(caller_.status());
      return;
    }
    auto time_up = [weak = std::weak_ptr<Link>(link_), timeout = unopened_->timeout()] {
      if (std::shared_ptr<Link> link = weak.lock()) Kick(*link, TimedOut(timeout));
    };
    absl::StatusOr<uint64_t> ticket =
        unopened_->Admit(caller_->uid(), caller_->admin, std::move(time_up));
    if (!ticket.ok()) {
      Step(absl::ResourceExhaustedError(
          absl::StrCat("stream: ", ticket.status().message(), "; send the open message first")));
      return;
    }
    ticket_ = *ticket;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the consumer half-closed or went away
      EndSession(absl::CancelledError("the consumer closed its stream"));
      Step(absl::OkStatus());
      return;
    }
    absl::Status problem;
    if (Opened() == nullptr) {
      // Too late when the open's time is up: that finish is on its way.
      const bool in_time = ticket_.has_value() && unopened_->Remove(*ticket_);
      ticket_.reset();
      problem = in_time ? Open() : TimedOut(unopened_->timeout());
    } else if (request_.has_open()) {
      problem = absl::InvalidArgumentError("stream: open may only be the first message");
    }
    if (problem.ok() && !request_.releases().empty()) problem = Release();
    if (problem.ok()) StartRead(&request_);
    Step(problem);
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&link_->mu);
      write_in_flight_ = false;
      if (!ok && finish_status_.ok()) finish_status_ = absl::CancelledError("write failed");
    }
    Step(absl::OkStatus());
  }

  void OnCancel() override {
    EndSession(absl::CancelledError("the consumer went away"));
    Step(absl::CancelledError("cancelled"));
  }

  void OnDone() override {
    if (ticket_.has_value()) unopened_->Remove(*ticket_);
    EndSession(absl::CancelledError("stream done"));
    // A Kick on another thread may be inside Step right now (a session notification racing
    // the Finish that led here): then the last such Kick deletes the reactor.
    std::shared_ptr<Link> link = link_;
    bool later;
    {
      absl::MutexLock lock(&link->mu);
      link->reactor = nullptr;
      later = link->kicks > 0;
      if (later) link->orphan = this;
    }
    if (const StreamTestHooks& hooks = TestHooksOfStreams(); hooks.on_done) hooks.on_done();
    if (!later) delete this;
  }

 private:
  struct Link {
    absl::Mutex mu;
    StreamReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
    int kicks ABSL_GUARDED_BY(mu) = 0;                 // Kicks inside reactor->Step
    StreamReactor* orphan ABSL_GUARDED_BY(mu) = nullptr;  // done, for the last Kick to delete
  };

  absl::Status Open() {
    if (!caller_.ok()) return caller_.status();
    if (!request_.has_open()) {
      return absl::InvalidArgumentError("stream: the first message must be open");
    }
    absl::StatusOr<std::shared_ptr<Session>> session =
        sessions_->Find(request_.open().session_id(), request_.open().token(), *caller_);
    if (!session.ok()) return session.status();
    std::weak_ptr<Link> weak = link_;
    {
      absl::MutexLock lock(&link_->mu);
      session_ = *session;
    }
    const std::vector<std::string> release_events(request_.open().release_event_handles().begin(),
                                                  request_.open().release_event_handles().end());
    return (*session)->BindStream(
        [weak] {
          if (std::shared_ptr<Link> link = weak.lock()) Kick(*link);
        },
        release_events);
  }

  // Credits every release of the request; refused ones are answered on the stream.
  absl::Status Release() {
    const std::shared_ptr<Session> session = Opened();
    for (const v1::Release& release : request_.releases()) {
      // A client's report, clamped: the counter it feeds must never go backwards.
      const int64_t waited = static_cast<int64_t>(
          std::min<uint64_t>(release.waited_ns(), uint64_t{1} << 62));
      absl::Status s = session->Release(release.slot(), release.generation(),
                                        absl::Nanoseconds(waited));
      if (s.ok()) continue;
      absl::MutexLock lock(&link_->mu);
      if (rejected_.size() >= kMaxPendingRejections) {
        return absl::FailedPreconditionError("too many rejected releases on this stream");
      }
      v1::ReleaseRejected rejection;
      rejection.set_slot(release.slot());
      rejection.set_generation(release.generation());
      rejection.set_code(static_cast<int32_t>(s.code()));
      rejection.set_message(std::string(s.message()));
      rejected_.push_back(std::move(rejection));
    }
    return absl::OkStatus();
  }

  static absl::Status TimedOut(absl::Duration timeout) {
    return absl::DeadlineExceededError(absl::StrCat("stream: no open message within ",
                                                    absl::FormatDuration(timeout),
                                                    " (stream_open_timeout)"));
  }

  // Steps the reactor from another thread, asking it to finish with `problem` if not OK.
  static void Kick(Link& link, const absl::Status& problem = absl::OkStatus()) {
    StreamReactor* reactor;
    {
      absl::MutexLock lock(&link.mu);
      reactor = link.reactor;
      if (reactor == nullptr) return;
      ++link.kicks;  // OnDone leaves the reactor to us while we are in Step
    }
    if (const StreamTestHooks& hooks = TestHooksOfStreams(); hooks.kick_before_step) {
      hooks.kick_before_step();
    }
    reactor->Step(problem);
    StreamReactor* orphan = nullptr;
    {
      absl::MutexLock lock(&link.mu);
      if (--link.kicks == 0) orphan = std::exchange(link.orphan, nullptr);
    }
    delete orphan;
  }

  // The session the stream opened; null before its open message.
  std::shared_ptr<Session> Opened() {
    absl::MutexLock lock(&link_->mu);
    return session_;
  }

  void EndSession(const absl::Status& why) {
    if (std::shared_ptr<Session> session = Opened()) sessions_->End(session->id(), why);
  }

  // Decides the next operation under the lock and performs it outside: a write, the one
  // Finish, or nothing. `problem` (not OK) asks to finish with that status.
  void Step(const absl::Status& problem) {
    enum { kNone, kWrite, kFinish } action = kNone;
    absl::Status finish;
    absl::Status thrown;
    std::shared_ptr<Session> ended;  // a session whose stream threw
    {
      absl::MutexLock lock(&link_->mu);
      if (finished_) return;
      if (!problem.ok() && finish_status_.ok()) finish_status_ = problem;
      if (write_in_flight_) return;
      if (!finish_status_.ok()) {
        finish = finish_status_;
        action = kFinish;
      } else {
        // Gather everything ready into one message: under load this amortises the per-message
        // cost over several batches.
        out_.Clear();
        for (v1::ReleaseRejected& r : rejected_) *out_.add_rejected() = std::move(r);
        rejected_.clear();
        // An exception while gathering (std::bad_alloc copying a batch) ends this stream
        // and its session with that error, never the daemon (SECURITY.md §4).
        try {
          while (session_ != nullptr && out_.batches_size() < kMaxBatchesPerMessage) {
            StreamEvent event = session_->NextEvent();
            if (event.kind == StreamEvent::kBatch) {
              ToProto(event.batch, out_.add_batches());
              continue;
            }
            if (event.kind == StreamEvent::kEnd) {
              ToProto(event.end_position, 0, out_.mutable_end()->mutable_position());
            } else if (event.kind == StreamEvent::kClosed &&
                       out_.batches_size() + out_.rejected_size() == 0) {
              finish = event.status;
              // A consumer that closed its own stream or detached gets a clean end.
              if (absl::IsCancelled(finish)) finish = absl::OkStatus();
              action = kFinish;
            }
            break;  // kNothing, kEnd, or kClosed (sent first what was gathered)
          }
        } catch (...) {
          thrown = StatusOfException(std::current_exception(), "stream");
        }
        if (!thrown.ok()) {
          finish_status_ = thrown;
          finish = thrown;
          action = kFinish;
          ended = session_;
        }
        if (action != kFinish &&
            (out_.batches_size() > 0 || out_.rejected_size() > 0 || out_.has_end())) {
          action = kWrite;
        }
      }
      if (action == kWrite) write_in_flight_ = true;
      if (action == kFinish) finished_ = true;
    }
    if (ended != nullptr) {
      LogCaughtException(thrown);
      sessions_->End(ended->id(), thrown);
    }
    if (action == kWrite) StartWrite(&out_);
    if (action == kFinish) Finish(ToGrpcStatus(finish));
  }

  SessionManager* const sessions_;
  const absl::StatusOr<Caller> caller_;
  UnopenedStreams* const unopened_;
  // Its place among the unopened streams, until its open message came (or its time was up).
  // Touched only by the constructor, OnReadDone and OnDone, which gRPC never runs at once.
  std::optional<uint64_t> ticket_;
  const std::shared_ptr<Link> link_;
  v1::StreamRequest request_;  // owned by the one outstanding read
  v1::StreamResponse out_ ABSL_GUARDED_BY(link_->mu);
  std::shared_ptr<Session> session_ ABSL_GUARDED_BY(link_->mu);
  std::vector<v1::ReleaseRejected> rejected_ ABSL_GUARDED_BY(link_->mu);
  bool write_in_flight_ ABSL_GUARDED_BY(link_->mu) = false;
  bool finished_ ABSL_GUARDED_BY(link_->mu) = false;
  absl::Status finish_status_ ABSL_GUARDED_BY(link_->mu);
};

}  // namespace

StreamTestHooks& TestHooksOfStreams() {
  static StreamTestHooks hooks;
  return hooks;
}

FeedService::FeedService(SessionManager* sessions, const CallerResolver* callers,
                         std::string mem_socket, int attach_threads, UnopenedStreamLimits unopened)
    : sessions_(sessions),
      callers_(callers),
      mem_socket_(std::move(mem_socket)),
      unopened_(unopened.max_per_uid, unopened.max_total, unopened.open_timeout),
      // One uid runs at most half the attach threads' attaches at once (one of the default
      // two): the others' attaches go first (attach_queue.h).
      attach_work_({.max_queued = 256,
                    .max_queued_per_uid = 64,
                    .max_running_per_uid = std::max(1, attach_threads / 2)}) {
  for (int i = 0; i < attach_threads; ++i) {
    attach_threads_.emplace_back([this, i] {
      const std::string name = absl::StrCat("attach/", i);
      pthread_setname_np(pthread_self(), name.c_str());
      while (true) {
        absl::StatusOr<AttachQueue::Work> work = attach_work_.Pop();
        if (!work.ok()) return;  // closed and drained
        work->run();
        attach_work_.Done(work->uid);
      }
    });
  }
}

FeedService::~FeedService() {
  attach_work_.Close();
  for (std::thread& t : attach_threads_) t.join();
}

grpc::ServerUnaryReactor* FeedService::Attach(grpc::CallbackServerContext* ctx,
                                              const v1::AttachRequest* request,
                                              v1::AttachResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = callers_->IdentifyConsumer(ctx->peer());
  if (!caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller.status()));
    return reactor;
  }
  // The request and response live until the reactor finishes.
  const uint32_t uid = caller->uid();
  const bool capped = !caller->admin;
  absl::Status queued = attach_work_.TryPush(uid, capped, [this, reactor, request, response,
                                                          caller = *std::move(caller)] {
    // An exception (std::bad_alloc) fails this Attach, never the daemon (SECURITY.md §4).
    absl::StatusOr<Attachment> attached = CallCatching(
        "attach",
        [&]() -> absl::StatusOr<Attachment> {
          absl::StatusOr<AttachSpec> spec = AttachSpecFromProto(*request);
          if (!spec.ok()) return spec.status();
          spec->caller = caller;
          return sessions_->Attach(*spec);
        },
        /*log=*/true);
    if (attached.ok()) {
      ToProto(*attached, response);
      response->set_mem_socket(mem_socket_);
    }
    reactor->Finish(ToGrpcStatus(attached.status()));
  });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(queued));
  return reactor;
}

grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* FeedService::Stream(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(sessions_, callers_->IdentifyConsumer(ctx->peer()), &unopened_);
}

grpc::ServerUnaryReactor* FeedService::GetPosition(grpc::CallbackServerContext* ctx,
                                                   const v1::GetPositionRequest* request,
                                                   v1::GetPositionResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = callers_->IdentifyConsumer(ctx->peer());
  absl::StatusOr<std::shared_ptr<Session>> session =
      caller.ok() ? sessions_->Find(request->session_id(), request->token(), *caller)
                  : caller.status();
  if (session.ok()) {
    const Position delivered = (*session)->delivered();
    ToProto(delivered, (*session)->feed().sampler().Cursor(delivered),
            response->mutable_delivered());
    response->mutable_delivered()->set_fingerprint((*session)->feed().fingerprint());
  }
  reactor->Finish(ToGrpcStatus(session.status()));
  return reactor;
}

grpc::ServerUnaryReactor* FeedService::Detach(grpc::CallbackServerContext* ctx,
                                              const v1::DetachRequest* request,
                                              v1::DetachResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = callers_->IdentifyConsumer(ctx->peer());
  reactor->Finish(ToGrpcStatus(
      caller.ok() ? sessions_->Detach(request->session_id(), request->token(), *caller)
                  : caller.status()));
  return reactor;
}

}  // namespace gpufeed::server
