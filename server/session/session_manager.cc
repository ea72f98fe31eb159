#include "server/session/session_manager.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// Constant-time comparison: the token is a capability.
bool TokenEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// FeedSnapshot::bad_samples: the dataset's counts by reason, plus each notice's samples left
// out at open under its reason (what Attach reports is counted too, so the two agree). A
// "warning" is no sample.
std::vector<std::pair<std::string, int64_t>> BadSamplesOf(const Dataset& dataset) {
  std::vector<std::pair<std::string, int64_t>> out = dataset.bad_samples();
  for (const DatasetNotice& n : dataset.notices()) {
    if (n.reason == "warning" || n.count <= 0) continue;
    auto same =
        std::find_if(out.begin(), out.end(), [&](const auto& r) { return r.first == n.reason; });
    if (same == out.end()) {
      out.emplace_back(n.reason, n.count);
    } else {
      same->second += n.count;
    }
  }
  return out;
}

}  // namespace

SessionManager::SessionManager(const SessionManagerOptions& options, StagingPool* pool,
                               FileSystem* fs, DeviceBackend* devices)
    : options_(options),
      pool_(pool),
      devices_(devices),
      ids_budget_(CreateIdsBudget(options.max_ids_bytes, options.max_ids_bytes_per_uid)),
      feeds_(fs,
             [&options] {
               FeedAccessOptions access = options.access;
               access.handles.lifetime = options.attach_timeout;
               return access;
             }(),
             options.feed_limits, options.clock),
      share_cache_(options.share_cache_bytes),
      // Submitted work: each session is queued at most once at a time (closed ones linger
      // until popped, under 3 x max_sessions of them: CheckGoneFills' 2 x max_sessions at
      // the last admit, then the live ones removed), and each slot in flight to a GPU has at
      // most one CPU redo of rows nvJPEG refused. ParallelFor's helpers, which outlive the
      // calls that queued them until a worker pops them (about sessions x threads of them
      // when every worker is busy: more than threads^2 on a many-core node), take at most as
      // much again: the pool keeps half of its queue for submitted work (common/thread_pool.h).
      workers_("read", options.threads,
               2 * (static_cast<size_t>(options.max_sessions) * (4 + options.max_ring_slots) +
                    16)),
      admission_(AdmissionLimits{options.max_sessions, options.max_sessions_per_uid,
                                 options.max_staging_bytes_per_uid}) {
  reaper_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "lease");
    ReaperLoop();
  });
}

SessionManager::~SessionManager() {
  Shutdown(absl::UnavailableError("gpufeedd is shutting down"));
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(uint64_t id,
                                                              absl::string_view token) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session ", id, " (detached or expired)"));
  }
  if (!TokenEquals(it->second->token(), token)) {
    return absl::PermissionDeniedError(absl::StrCat("wrong token for session ", id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(uint64_t id,
                                                              absl::string_view token,
                                                              const Caller& caller) const {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    // Another uid's session answers exactly as a missing one: ids are no oracle.
    if (it == sessions_.end() || it->second->owner_uid() != caller.uid()) {
      return absl::NotFoundError(absl::StrCat("no session ", id, " (detached or expired)"));
    }
  }
  return Find(id, token);
}

absl::Status SessionManager::Detach(uint64_t id, absl::string_view token, const Caller& caller) {
  // An admin may end any session by its id alone (gpufeedctl sessions shows ids, never
  // tokens); everyone else needs the session's token and must own it.
  absl::StatusOr<std::shared_ptr<Session>> session;
  if (caller.admin) {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("no session ", id, " (detached or expired)"));
    }
    session = it->second;
  } else {
    session = Find(id, token, caller);
  }
  if (!session.ok()) return session.status();
  Remove(id, absl::CancelledError("session detached"),
         (*session)->owner_uid() == caller.uid() ? "detach" : "detach by an admin");
  return absl::OkStatus();
}

absl::Status SessionManager::Detach(uint64_t id, absl::string_view token) {
  absl::StatusOr<std::shared_ptr<Session>> session = Find(id, token);
  if (!session.ok()) return session.status();
  Remove(id, absl::CancelledError("session detached"), "detach");
  return absl::OkStatus();
}

void SessionManager::End(uint64_t id, const absl::Status& why) { Remove(id, why, "stream ended"); }

void SessionManager::Remove(uint64_t id, const absl::Status& why, const char* verb) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    session = std::move(it->second);
    sessions_.erase(it);
    jobs_.Leave(session->owner_uid(), session->job(), session->rank());
    admission_.Remove(session->owner_uid(), session->quota_bytes());
  }
  session->Close(why);
  // A fill of it still queued stays until a worker pops it: counted until then, so that
  // Attach can refuse before such fills fill the queue (CheckGoneFills).
  if (session->MarkQueuedFillGone()) CountGoneFill(session->owner_uid(), 1);
  spdlog::info("{}: session {} uid {} job '{}' rank {} feed {} ({})", verb, id,
               session->owner_uid(), EscapeForLog(session->job()), session->rank(),
               session->feed().key(), EscapeForLog(why.ToString()));
}

std::vector<SessionSnapshot> SessionManager::ListSessions() const {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
  }
  std::vector<SessionSnapshot> out;
  for (const auto& session : sessions) out.push_back(session->Snapshot());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

std::vector<SessionSnapshot> SessionManager::ListSessions(const Caller& caller) const {
  std::vector<SessionSnapshot> out = ListSessions();
  if (caller.admin) return out;
  out.erase(std::remove_if(out.begin(), out.end(),
                           [&](const SessionSnapshot& s) { return s.owner_uid != caller.uid(); }),
            out.end());
  return out;
}

std::vector<FeedSnapshot> SessionManager::ListFeeds() const {
  return ListFeedsWhere(nullptr);
}

std::vector<FeedSnapshot> SessionManager::ListFeeds(const Caller& caller) const {
  if (caller.admin) return ListFeeds();
  // A non-admin sees the feeds its own sessions use; `sessions` counts its own only.
  return ListFeedsWhere(
      [uid = caller.uid()](const Session& s) { return s.owner_uid() == uid; });
}

std::vector<FeedSnapshot> SessionManager::ListFeedsWhere(
    const std::function<bool(const Session&)>& visible) const {
  absl::flat_hash_map<std::string, int32_t> counts;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (visible == nullptr || visible(*session)) ++counts[session->feed().key()];
    }
  }
  std::vector<FeedSnapshot> out;
  for (const std::shared_ptr<Feed>& feed : feeds_.List()) {
    // Filtered: only the feeds the visible sessions use.
    if (visible != nullptr && !counts.contains(feed->key())) continue;
    FeedSnapshot f;
    f.key = feed->key();
    f.spec = feed->spec();
    f.num_samples = feed->dataset().num_samples();
    f.sessions = counts[feed->key()];
    f.batches_produced = feed->batches_produced();
    f.samples_produced = feed->samples_produced();
    f.bytes_produced = feed->bytes_produced();
    f.bad_samples = BadSamplesOf(feed->dataset());
    if (const LmDataset* lm = feed->lm(); lm != nullptr) {
      f.lm_stats = lm->stats();
      f.lm_sources = lm->source_names();
      f.pack = feed->spec().lm.pack;
    }
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  return out;
}

int SessionManager::num_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

void SessionManager::BeginDrain() {
  absl::MutexLock lock(&mu_);
  if (admission_.BeginDrain()) {
    spdlog::info("draining: new sessions are refused, {} run on", sessions_.size());
  }
}

bool SessionManager::draining() const {
  absl::MutexLock lock(&mu_);
  return admission_.draining();
}

void SessionManager::Schedule(std::shared_ptr<Session> session) {
  const uint64_t id = session->id();
  absl::Status s;
  try {
    s = workers_.TrySubmit([this, session] {
      if (session->FillOne()) CountGoneFill(session->owner_uid(), -1);
    });
  } catch (const std::exception& e) {  // the entry's allocation: as a full queue
    s = absl::ResourceExhaustedError(e.what());
  }
  if (s.ok()) return;
  // No entry: the session must not count as one queued (nor as a gone fill once removed);
  // removed meanwhile (between the mark and here), its count comes back now, no worker will.
  if (session->DropQueued()) CountGoneFill(session->owner_uid(), -1);
  if (!workers_.closed()) {
    // Cannot happen while the capacity bound holds; never leave a session silently stuck.
    spdlog::error("session {}: fill queue full ({}); ending the session", id, s.ToString());
    Remove(id, absl::InternalError("gpufeedd fill queue overflow"), "abort");
  }
}

absl::Status SessionManager::CheckGoneFills(const Caller& caller) const {
  auto refuse = [&](int64_t gone, int most, absl::string_view whose, absl::string_view bound) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gpufeedd: ", gone, " fills of ", whose,
        " sessions already gone wait for a fill thread, at most ", most, " may (", bound,
        "): sessions were attached and detached faster than the busy fill threads "
        "(--threads ",
        options_.threads, ") get through them; retry when they have"));
  };
  // Twice the sessions one may hold: a uid (the daemon) detaching all its sessions and
  // attaching them again while their fills wait is not refused; only churn past that is.
  if (!caller.admin) {
    auto it = gone_fills_by_uid_.find(caller.uid());
    if (it != gone_fills_by_uid_.end() && options_.max_sessions_per_uid > 0 &&
        it->second >= 2 * int64_t{options_.max_sessions_per_uid}) {
      return refuse(it->second, 2 * options_.max_sessions_per_uid, "this uid's",
                    "2 x max_sessions_per_uid");
    }
  }
  if (gone_fills_ >= 2 * int64_t{options_.max_sessions}) {
    return refuse(gone_fills_, 2 * options_.max_sessions, "all", "2 x max_sessions");
  }
  return absl::OkStatus();
}

void SessionManager::CountGoneFill(uint32_t uid, int64_t n) {
  absl::MutexLock lock(&mu_);
  gone_fills_ += n;
  // A fill may be popped before its removal counted it: the uid's count passes through -1.
  if ((gone_fills_by_uid_[uid] += n) == 0) gone_fills_by_uid_.erase(uid);
}

void SessionManager::Submit(std::function<void()> work) {
  absl::Status s = workers_.TrySubmit(work);
  if (s.ok()) return;
  if (!workers_.closed()) {
    // Cannot happen while the capacity bound holds.
    spdlog::error("fill queue full ({}): running a task on the caller's thread", s.ToString());
  }
  work();
}

void SessionManager::ParallelFor(int n, const std::function<void(int)>& fn) {
  workers_.ParallelFor(n, fn);
}

void SessionManager::ReaperLoop() {
  while (!stop_reaper_.WaitForNotificationWithTimeout(options_.reap_interval)) {
    std::vector<uint64_t> expired;
    std::vector<uint64_t> orphaned;  // the consumer went before opening its stream
    std::vector<uint64_t> idle;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = options_.clock();
      for (const auto& [id, session] : sessions_) {
        if (!session->streaming() && now - session->attached_at() > options_.attach_timeout) {
          expired.push_back(id);
        } else if (!session->streaming() && session->LifelineClosed()) {
          orphaned.push_back(id);
        } else if (options_.idle_lease_timeout > absl::ZeroDuration() &&
                   !session->device_delivery() &&
                   now - session->all_leased_since() >= options_.idle_lease_timeout) {
          // all_leased_since is InfiniteFuture unless every slot is held: now - it < 0.
          idle.push_back(id);
        }
      }
    }
    for (uint64_t id : expired) {
      Remove(id,
             absl::DeadlineExceededError(absl::StrCat(
                 "no stream opened within ", absl::FormatDuration(options_.attach_timeout),
                 " of Attach")),
             "lease expired");
    }
    for (uint64_t id : orphaned) {
      lifeline_reclaims_.fetch_add(1, std::memory_order_relaxed);
      Remove(id,
             absl::CancelledError(
                 "the consumer closed its connection (exited or was killed) before opening its "
                 "stream"),
             "consumer gone before its stream");
    }
    for (uint64_t id : idle) {
      Remove(id,
             absl::DeadlineExceededError(absl::StrCat(
                 "idle lease: the consumer held every slot of its ring and released none for ",
                 absl::FormatDuration(options_.idle_lease_timeout),
                 " (idle_lease_timeout); the session is ended")),
             "idle lease");
    }
    reap_rounds_.fetch_add(1, std::memory_order_release);
  }
}

void SessionManager::Shutdown(const absl::Status& reason) {
  feeds_.CancelOpens();  // an attach walking a folder ends now, not after the walk
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    if (!admission_.Shutdown()) return;
    for (auto& [id, session] : sessions_) sessions.push_back(std::move(session));
    sessions_.clear();
    jobs_.Clear();
  }
  for (const auto& session : sessions) {
    session->KeepRingPagesForConsumer();  // held batches keep their bytes across a restart
    session->Close(reason);
  }
  workers_.Shutdown(reason);
  stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
}

}  // namespace gpufeed::server
