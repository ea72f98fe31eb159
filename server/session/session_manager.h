// The session manager: admits sessions (Attach), finds them for the stream and the memory
// socket, ends them (Detach, a vanished stream, an expired lease, shutdown), and runs the
// pool of worker threads that fill their slots.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/bounded_queue.h"
#include "common/progress.h"
#include "common/thread_pool.h"
#include "server/augment/pipeline.h"
#include "server/auth/caller.h"
#include "server/feed/feed.h"
#include "server/feed/ids_budget.h"
#include "server/session/admission.h"
#include "server/session/attach_spec.h"
#include "server/session/job_registry.h"
#include "server/session/ring_planner.h"
#include "server/session/session.h"
#include "server/staging/staging_pool.h"

namespace gpufeed::server {

struct Attachment {
  uint64_t session_id = 0;
  std::string token;
  std::string feed_key;
  uint64_t num_samples = 0;
  int64_t steps_per_epoch = 0;
  int32_t ring_slots = 0;
  SlotLayout layout;
  Position start;
  uint64_t start_samples = 0;  // the global cursor at start (Sampler::Cursor)
  int64_t batch_size = 0;      // per rank, as served (an elastic resume may change it)
  std::string fingerprint;  // the feed's (Feed::fingerprint)
  bool device = false;
  DeviceRingExport device_ring;  // when device
  StageMode stage = StageMode::kNone;
  bool image = false;  // an image dataset: stage says where decode and augment run
  std::vector<DatasetNotice> notices;  // the dataset's (Dataset::notices)
  std::vector<BlendSegment> blend_segments;  // a blend's segments in force (LmDataset)
};

struct FeedSnapshot {
  std::string key;
  FeedSpec spec;
  uint64_t num_samples = 0;
  int32_t sessions = 0;
  int64_t batches_produced = 0;
  int64_t samples_produced = 0;
  uint64_t bytes_produced = 0;
  // Samples that could not be used, by reason: the dataset's bad_samples and its notices'
  // counts (samples left out at open; warnings are not samples).
  std::vector<std::pair<std::string, int64_t>> bad_samples;
  // A blend or a packed feed (LmDataset): what its stream packed so far holds, and its
  // sources' names (stats.source_tokens in their order). Empty names: not such a feed.
  LmDataset::Stats lm_stats;
  std::vector<std::string> lm_sources;
  PackMode pack = PackMode::kNone;
};

struct SessionManagerOptions {
  int threads = 4;
  int max_sessions = 256;
  // Ring depth when Attach gives none; 0 = auto: as many slots as fit in auto_ring_bytes,
  // at least 2 and at most 16. Depth is what hides the round trip of a release (measured:
  // docs/benchmarks.md, section Host delivery).
  int32_t default_ring_slots = 0;
  uint64_t auto_ring_bytes = uint64_t{64} << 20;
  int32_t max_ring_slots = 64;
  // decode auto: the CPU pool decodes the share of each batch it keeps up with, nvJPEG the
  // rest (session/decode_share.h); off: nvJPEG for every row it can.
  bool adaptive_decode = false;
  // adaptive_decode: the CPU takes the rows estimated cheapest for it (images/cpu_rows.h);
  // off: its rows are spread evenly by index.
  bool cheapest_cpu_rows = true;
  // One batch's time budget (SessionParams::max_batch_time); zero: none.
  absl::Duration max_batch_time = absl::Seconds(120);
  // A session whose stream is not open this long after Attach is ended.
  absl::Duration attach_timeout = absl::Seconds(10);
  // How often leases are checked.
  absl::Duration reap_interval = absl::Milliseconds(100);
  // docs/SECURITY.md §4: samples per feed and image file bytes (FeedLimits), and the
  // daemon-wide bytes of the sessions' per-slot sample-id arrays.
  FeedLimits feed_limits;
  uint64_t max_ids_bytes = uint64_t{256} << 20;
  uint64_t max_ids_bytes_per_uid = 0;  // of max_ids_bytes, for one non-admin uid; 0: half
  // dataset_roots and the image_folder walk's bounds; handles live attach_timeout.
  FeedAccessOptions access;
  // Per-uid quotas (docs/SECURITY.md section 4): sessions attached at once, and bytes of
  // staging their host rings hold together (0 = no limit of its own; the daemon passes half
  // of --staging_bytes when the config leaves it 0). Admins (Caller::admin) are exempt.
  int max_sessions_per_uid = 64;
  uint64_t max_staging_bytes_per_uid = 0;
  // A host-delivery session whose consumer has held every slot, releasing none, this long is
  // ended with DEADLINE_EXCEEDED; zero: never. Device sessions are exempt.
  absl::Duration idle_lease_timeout = absl::Minutes(5);
  // Sharing groups (docs/ARCHITECTURE.md section 9): the bytes of decoded samples the cache
  // every group of the node shares may hold.
  uint64_t share_cache_bytes = uint64_t{1} << 30;
  // Group names whose members may be of several uids (share_groups_across_uids): one group
  // of every uid's jobs of that name, on proof of the same files (Feed::ShareIdentity with
  // across_uids), each decode made for another uid handed out only to a row whose own open of
  // the file succeeds. Others: each uid's groups are its own.
  std::vector<std::string> share_groups_across_uids;
  // "Now" for the lease decisions (attach_timeout, idle_lease_timeout: the sessions record
  // their times with it) and the dataset handles' lifetime; reap_interval stays real time.
  Clock clock = RealClock();
};

class SessionManager final : public FillScheduler {
 public:
  // `devices` may be null (no GPU support built in): device Attach is then refused.
  SessionManager(const SessionManagerOptions& options, StagingPool* pool, FileSystem* fs,
                 DeviceBackend* devices = nullptr);
  ~SessionManager() override;

  // The session is owned by spec.caller's uid. RESOURCE_EXHAUSTED naming the quota past
  // max_sessions_per_uid or max_staging_bytes_per_uid (a non-admin caller's). The steps:
  // the spec's rules (attach_spec.h), admission (admission.h), the feed opened or shared,
  // the ring placed (ring_planner.h), the job joined (job_registry.h), the session started.
  absl::StatusOr<Attachment> Attach(const AttachSpec& request);
  // The open session with this id; NOT_FOUND when there is none, PERMISSION_DENIED when the
  // token does not match.
  absl::StatusOr<std::shared_ptr<Session>> Find(uint64_t id, absl::string_view token) const;
  // As Find, for a request from `caller`: a session of another uid answers exactly as one
  // that does not exist (NOT_FOUND, same message), so ids are no oracle; then the token is
  // checked (PERMISSION_DENIED). Admins get no exception here. The memory socket and the Feed
  // service use this.
  absl::StatusOr<std::shared_ptr<Session>> Find(uint64_t id, absl::string_view token,
                                                const Caller& caller) const;
  // Ends the session. The token is always required; the owner check is Find's, except that
  // an admin may detach a session of any uid.
  absl::Status Detach(uint64_t id, absl::string_view token, const Caller& caller);
  absl::Status Detach(uint64_t id, absl::string_view token);
  // Ends a session whose stream is gone (cancelled, closed, finished).
  void End(uint64_t id, const absl::Status& why);

  // The memory socket's open_dataset (FeedRegistry::AddDatasetHandle).
  absl::StatusOr<std::string> AddDatasetHandle(UniqueFd fd, const PeerCred& from,
                                               UniqueFd lifeline = UniqueFd()) {
    return feeds_.AddDatasetHandle(std::move(fd), from, std::move(lifeline));
  }
  // The same for an s3:// dataset (FeedRegistry::AddObjectStoreHandle).
  absl::StatusOr<std::string> AddObjectStoreHandle(objstore::ObjectStoreAccess access,
                                                   const PeerCred& from,
                                                   UniqueFd lifeline = UniqueFd()) {
    return feeds_.AddObjectStoreHandle(std::move(access), from, std::move(lifeline));
  }
  // Attaches that resumed a client's stream (AttachSpec::resume_gap > 0), and sessions
  // ended because their consumer's lifeline closed before the stream opened.
  uint64_t resumed_sessions() const { return resumed_.load(std::memory_order_relaxed); }
  uint64_t lifeline_reclaims() const { return lifeline_reclaims_.load(std::memory_order_relaxed); }

  std::vector<SessionSnapshot> ListSessions() const;
  std::vector<FeedSnapshot> ListFeeds() const;
  // What `caller` may see: everything for an admin, else only its own sessions and the feeds
  // they use (docs/SECURITY.md section 1).
  std::vector<SessionSnapshot> ListSessions(const Caller& caller) const;
  std::vector<FeedSnapshot> ListFeeds(const Caller& caller) const;
  int num_sessions() const;
  // Bytes of max_ids_bytes held by sessions that still exist.
  uint64_t ids_bytes_in_use() const { return ids_budget_->used(); }
  // Tasks waiting for a worker (session fills and chunks of parallel fills).
  size_t queue_depth() const { return workers_.queue_depth(); }

  // Refuses new sessions (UNAVAILABLE); those attached run on. Idempotent.
  void BeginDrain();
  bool draining() const;

  // Ends every session with `reason`, refuses new ones, joins the workers. Idempotent.
  void Shutdown(const absl::Status& reason);

  void Schedule(std::shared_ptr<Session> session) override;
  void Submit(std::function<void()> work) override;
  void ParallelFor(int n, const std::function<void(int)>& fn) override;
  // The workers' progress marks, for the liveness check (common/progress.h).
  std::vector<const BusyMark*> busy_marks() const { return workers_.busy_marks(); }
  // Rounds the lease reaper has completed (every reap_interval): a test that moves the clock
  // waits for a round to pass instead of sleeping.
  int64_t reap_rounds() const { return reap_rounds_.load(std::memory_order_acquire); }

  // The sharing groups' cache of decoded samples (its counters, per group, for metrics).
  const ShareCache& share_cache() const { return share_cache_; }

 private:
  // A ring as placed for a new session: its depth, the stride of its slots, the host staging
  // and, for device delivery, the GPU ring.
  struct PlacedRing {
    int32_t slots = 0;
    uint64_t stride = 0;
    StagingRegion host;
    std::unique_ptr<DeviceRing> device;
  };

  // The feeds, with their sessions counted; `visible` (null: every session) filters both.
  std::vector<FeedSnapshot> ListFeedsWhere(
      const std::function<bool(const Session&)>& visible) const;

  // Removes the session from the maps and closes it.
  void Remove(uint64_t id, const absl::Status& why, const char* verb);
  void ReaperLoop();
  // Attach's checks before the dataset is opened: the spec, the GPU, shutdown, drain, the
  // session count and the caller's quota.
  absl::Status Admit(const AttachSpec& spec) const;
  // The consumer's lifeline (FeedRegistry::TakeLifeline), when it attaches by a handle.
  std::shared_ptr<const UniqueFd> TakeLifeline(const AttachSpec& spec);
  // The deepest ring of RingDepths that fits now (AllocateRing at each depth).
  absl::StatusOr<PlacedRing> PlaceRing(const AttachSpec& spec, const Feed& feed,
                                       StageMode stage);
  // RESOURCE_EXHAUSTED while the fills queued for sessions already gone reach twice
  // max_sessions_per_uid of the caller's uid (admins: not capped) or twice max_sessions in all:
  // sessions attached and detached faster than busy fill threads pop their entries would
  // otherwise fill workers_' queue, where a fill that cannot be queued ends a live session.
  absl::Status CheckGoneFills(const Caller& caller) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts n fills queued for sessions of `uid` already removed (Remove: +1; the worker that
  // pops one: -1).
  void CountGoneFill(uint32_t uid, int64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // A ring of `slots` within the caller's quota now (checked again, authoritatively, where
  // the session is inserted): the host ring, then the device ring; nothing kept on a refusal.
  absl::StatusOr<PlacedRing> AllocateRing(const AttachSpec& spec, const Feed& feed,
                                          StageMode stage, uint64_t stride, int32_t slots);

  const SessionManagerOptions options_;
  StagingPool* const pool_;
  DeviceBackend* const devices_;
  const std::shared_ptr<ByteBudget> ids_budget_;
  FeedRegistry feeds_;
  ShareCache share_cache_;
  // The fill workers ("read/N"): fills of sessions, chunks of a parallel fill, CPU redos.
  ThreadPool workers_;
  absl::Notification stop_reaper_;
  std::atomic<int64_t> reap_rounds_{0};
  std::atomic<uint64_t> resumed_{0};
  std::atomic<uint64_t> lifeline_reclaims_{0};

  mutable absl::Mutex mu_;
  Admission admission_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // Fills queued for sessions already removed, not yet popped (CheckGoneFills): in all and
  // by owner uid.
  int64_t gone_fills_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint32_t, int64_t> gone_fills_by_uid_ ABSL_GUARDED_BY(mu_);
  JobRegistry jobs_ ABSL_GUARDED_BY(mu_);

  std::thread reaper_;
};

}  // namespace gpufeed::server
