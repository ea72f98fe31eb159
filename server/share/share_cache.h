// The node-wide cache of decoded samples that the jobs of a sharing group fill for each other.
//
// The jobs of a group visit one order (the group's order seed): the sample at order position
// `at` (epoch * samples per epoch + position in the epoch) is the same sample for every job,
// whatever its batch size, world size or pace. Each member (a session) tells the cache where
// it will read next (its cursor), so the cache knows every member's future and can keep what
// is read again soonest. A member's cursor is the first order position it has not claimed; it
// claims a batch (looks up every row, then moves its cursor past the batch) before it decodes
// the misses, so its own decodes lie behind its cursor and count only for the others:
// - a sample decoded at position `at` is next needed by the nearest member behind it (cursor
//   <= at), after (at - that cursor) more positions; with none behind, by no member now (a
//   job that joins later, or resumes at an old position, may still read it);
// - while there is room every decode is kept; when the budget is full, an entry no member
//   will read goes first (the oldest), then the one whose next use is farthest (Belady's
//   rule), or the new one is not kept when it would be the farthest itself;
// - a group's entries outlive its last member (the next job of the group reads them), read by
//   no member, so the first to go.
// Nothing here waits: a miss is the caller's own decode, and a member that stalls only makes
// the entries ahead of it far (evicted first), never blocks another. A member that ends (its
// session ended, killed or not) stops counting at once: what only it would have read is now
// read by no member, and goes first.
//
// Entries are whole decoded images (Image, full size): what each job then does with them
// (crop, resize, flip, normalize, keyed by the job's own augmentation seed) is the job's own,
// so a hit or a miss gives the same bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/decode/image_decoder.h"

namespace gpufeed::server {

// A miss of a group in flight: the rows of every member that claimed the sample before its
// decode was kept share one. The first row to start decodes it; a row that finds it started
// waits for that decode instead of making its own. Only a started decode is waited for, and a
// started decode waits for nothing, so no row waits on a chain (members in lockstep, whose
// batches claim the same samples at once, decode each one once).
class SharePending {
 public:
  explicit SharePending(int64_t id) : id_(id) {}
  int64_t id() const { return id_; }
  // True for the first caller, which decodes (for `uid`, its member's) and must Finish.
  bool TryStart(uint32_t uid = 0);
  // The decode's image, or null where it failed; wakes the rows waiting.
  void Finish(std::shared_ptr<const Image> image);
  // The started decode's image, or null where it failed or took longer than `timeout`.
  std::shared_ptr<const Image> Wait(absl::Duration timeout);
  // Finished with an image (a later claim takes it as found).
  std::shared_ptr<const Image> image() const;
  // Finished without one.
  bool failed() const;
  // The uid whose row started the decode.
  uint32_t decoder_uid() const;

 private:
  const int64_t id_;
  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t uid_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const Image> image_ ABSL_GUARDED_BY(mu_);
};

struct ShareCounters {
  uint64_t hits = 0;       // Find that returned an entry
  uint64_t misses = 0;     // Find that did not: the caller decodes
  uint64_t inserts = 0;    // Offer kept
  uint64_t bypassed = 0;   // Offer not kept: the budget full of entries read sooner
  uint64_t raced = 0;      // Offer of a sample another member had just offered
  uint64_t evictions = 0;  // entries pushed out for a newer one
  // A group across uids: hits on a decode made for another uid, handed out only after the
  // member's own open of the file succeeded (passed) or not (refused: the row's own read).
  uint64_t read_checks_passed = 0;
  uint64_t read_checks_refused = 0;
  // Misses that shared no decode in flight: their member held its cap of rows in flight.
  uint64_t unshared = 0;
  uint64_t bytes = 0;      // held now
  uint64_t entries = 0;    // held now
};

struct ShareGroupInfo {
  std::string key;
  int members = 0;
  std::vector<int64_t> cursors;  // the members', lowest first
  int64_t pending = 0;           // decodes in flight (SharePending) the group's map holds
  ShareCounters counters;
};

// Who a member is, and what it may hold.
struct ShareMemberOptions {
  // Whose rights its rows read with. In a group across uids (the daemon's
  // share_groups_across_uids) a decode made for another uid comes marked check_read.
  uint32_t uid = 0;
  // The most rows of its claims that hold a decode in flight at once: its ring's batches'
  // rows. Past it a miss decodes for itself (and still offers its decode), so no member
  // grows the group's map of decodes in flight past its own batches.
  int64_t max_in_flight = int64_t{1} << 16;
};

class ShareCache {
  struct GroupState;

 public:
  // Bytes an entry costs beyond its pixels (the map, the index, the Image).
  static constexpr uint64_t kEntryOverhead = 128;

  explicit ShareCache(uint64_t budget_bytes) : budget_(budget_bytes) {}
  ShareCache(const ShareCache&) = delete;
  ShareCache& operator=(const ShareCache&) = delete;

  // One row of a claimed batch: the group's decode of the sample (`check_read`: made for
  // another uid), or (a miss) whether the caller should offer its decode (the cache keeps
  // decodes: a budget above zero) and the decode in flight it shares with the group's other
  // rows of that sample (null past the member's max_in_flight).
  struct Row {
    std::shared_ptr<const Image> found;
    bool check_read = false;
    bool wanted = false;
    std::shared_ptr<SharePending> pending;
  };

  // How the rows of one fill ended: its decodes in flight to let go of, and the read checks
  // its rows made (Row::check_read).
  struct FillEnd {
    std::vector<std::shared_ptr<SharePending>> pending;
    uint64_t read_checks_passed = 0;
    uint64_t read_checks_refused = 0;
  };

  // One session's place in a group. Move-only; its destruction leaves the group.
  class Member {
   public:
    Member() = default;
    Member(Member&& other) noexcept { *this = std::move(other); }
    Member& operator=(Member&& other) noexcept;
    ~Member() { Leave(); }

    // Claims the batch that reads order positions [first, end): looks up each row's sample,
    // then moves the cursor past the batch, as one step. A session fills several batches at
    // once, so claims may come out of order: the cursor moves past a batch only once every
    // batch before it is claimed.
    std::vector<Row> Claim(std::span<const int64_t> ids, int64_t first, int64_t end);
    // Moves the cursor without reading (a resume at another position), forgetting claims.
    void Advance(int64_t cursor);
    // Once a fill of claimed rows ended, done or not (a deadline, an error): lets go of their
    // decodes in flight (one the group no longer shares with any row leaves its map, started
    // or not) and counts their read checks.
    void EndFill(const FillEnd& end);
    // `image`, a whole decode by this member of sample `id` at order position `at`, for the
    // others.
    void Offer(int64_t id, int64_t at, std::shared_ptr<const Image> image);
    void Leave();
    uint32_t uid() const { return options_.uid; }

   private:
    friend class ShareCache;
    ShareCache* cache_ = nullptr;
    GroupState* group_ = nullptr;
    std::multiset<int64_t>::iterator cursor_;
    std::map<int64_t, int64_t> ahead_;  // claimed batches past the cursor: first -> end
    ShareMemberOptions options_;
    // The decodes in flight its rows hold (each with its rows' count), until EndFill.
    absl::flat_hash_map<std::shared_ptr<SharePending>, int64_t> held_;
    int64_t held_rows_ = 0;
  };

  // Joins the group `key` (made on first use) at `cursor`. Every member of a group reads one
  // dataset in one order, `identity`: FAILED_PRECONDITION naming both when the group's members
  // read another (a group without members takes the new one, dropping its images).
  absl::StatusOr<Member> Join(const std::string& key, const std::string& identity,
                              int64_t cursor, const ShareMemberOptions& options = {});

  uint64_t budget_bytes() const { return budget_; }
  // All groups together.
  ShareCounters counters() const;
  std::vector<ShareGroupInfo> Groups() const;

 private:
  struct Entry {
    std::shared_ptr<const Image> image;
    int64_t at = 0;
    uint64_t bytes = 0;
    uint32_t uid = 0;  // whose member decoded it
  };
  // A decode in flight and the rows of the group's claims that share it.
  struct InFlight {
    std::shared_ptr<SharePending> pending;
    int64_t rows = 0;
  };
  struct GroupState {
    std::string key;
    std::string identity;
    std::multiset<int64_t> cursors;
    absl::flat_hash_map<int64_t, Entry> entries;  // by sample id
    // Misses of fills in progress, by sample id: at most every member's max_in_flight rows.
    absl::flat_hash_map<int64_t, InFlight> in_flight;
    std::set<std::pair<int64_t, int64_t>> by_at;  // (at, id) of every entry
    ShareCounters counters;
  };
  void MoveCursor(Member& m, int64_t cursor) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Order positions until the next use of position `at`; kNever when no member is behind it.
  static constexpr int64_t kNever = INT64_MAX;
  static int64_t NextUse(const GroupState& g, int64_t at);
  // The entry of `g` used farthest ahead: (distance, id); distance -1 when `g` has none.
  static std::pair<int64_t, int64_t> Farthest(const GroupState& g);
  void Erase(GroupState& g, int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops every entry of `g` and moves its counters to the ended groups'.
  void DropAll(GroupState& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remove(Member& m);
  // Lets go of `rows` of `m`'s rows holding `pending`.
  void Unhold(Member& m, std::shared_ptr<SharePending> pending, int64_t rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t budget_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, std::unique_ptr<GroupState>> groups_ ABSL_GUARDED_BY(mu_);
  ShareCounters gone_ ABSL_GUARDED_BY(mu_);  // the counters of groups that ended
};

}  // namespace gpufeed::server
