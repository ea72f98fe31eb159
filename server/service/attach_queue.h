// The attaches waiting for the attach threads, fair between uids (docs/SECURITY.md §4).
//
// An Attach may walk a folder, index tar shards or sum a Megatron .idx: up to
// folder_walk_timeout (120 s) of one attach thread each. With one FIFO, a uid that sent a few
// such attaches would hold every attach thread and every other uid's Attach would time out
// behind them. Here each uid has its own FIFO; a thread takes the oldest attach of the next uid
// in turn (round robin over uids with work) among those running fewer than
// `max_running_per_uid` attaches, so one uid holds at most that many threads and the others
// go first. Admins are not capped (but take their turn). Bounded: at most `max_queued` waiting
// in all and `max_queued_per_uid` of one uid; past them TryPush is RESOURCE_EXHAUSTED.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace gpufeed::server {

class AttachQueue {
 public:
  struct Limits {
    size_t max_queued = 256;
    size_t max_queued_per_uid = 64;
    int max_running_per_uid = 1;
  };
  // What a thread runs: the attach, and whose it is (for Done).
  struct Work {
    uint32_t uid = 0;
    std::function<void()> run;
  };

  explicit AttachQueue(Limits limits) : limits_(limits) {}
  AttachQueue(const AttachQueue&) = delete;
  AttachQueue& operator=(const AttachQueue&) = delete;

  // Never blocks: RESOURCE_EXHAUSTED naming the bound that is full, UNAVAILABLE once closed.
  // `capped`: the uid's running attaches count against max_running_per_uid (not an admin).
  absl::Status TryPush(uint32_t uid, bool capped, std::function<void()> run) {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("gpufeedd is shutting down");
    if (queued_ >= limits_.max_queued) {
      return absl::ResourceExhaustedError(
          absl::StrCat(limits_.max_queued, " attaches are waiting already; retry later"));
    }
    std::deque<Item>& mine = waiting_[uid];
    if (mine.size() >= limits_.max_queued_per_uid) {
      return absl::ResourceExhaustedError(
          absl::StrCat("uid ", uid, " has ", mine.size(),
                       " attaches waiting already (at most ", limits_.max_queued_per_uid,
                       " a uid); retry later"));
    }
    if (mine.empty()) turn_.push_back(uid);
    mine.push_back(Item{capped, std::move(run)});
    ++queued_;
    return absl::OkStatus();
  }

  // Blocks until an attach may run and returns it; its thread calls Done(work.uid) after.
  // Once closed, returns the attaches still waiting, then UNAVAILABLE.
  absl::StatusOr<Work> Pop() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &AttachQueue::CanPop));
    const std::optional<size_t> at = NextTurn();
    if (!at.has_value()) return absl::UnavailableError("gpufeedd is shutting down");
    const uint32_t uid = turn_[*at];
    std::deque<Item>& mine = waiting_[uid];
    Item item = std::move(mine.front());
    mine.pop_front();
    --queued_;
    turn_.erase(turn_.begin() + static_cast<std::ptrdiff_t>(*at));
    if (!mine.empty()) {
      turn_.push_back(uid);  // its next attach waits for the others' turns
    } else {
      waiting_.erase(uid);
    }
    if (item.capped) ++running_[uid];
    return Work{uid, std::move(item.run)};
  }

  // The attach of `uid` that Pop returned has finished (whether capped or not).
  void Done(uint32_t uid) {
    absl::MutexLock lock(&mu_);
    auto it = running_.find(uid);
    if (it != running_.end() && --it->second == 0) running_.erase(it);
  }

  // Later pushes fail; Pop drains what waits, then fails. Wakes every waiter.
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

  size_t queued() const {
    absl::MutexLock lock(&mu_);
    return queued_;
  }

 private:
  struct Item {
    bool capped = true;
    std::function<void()> run;
  };

  // Where in turn_ the first uid whose next attach may run now stands.
  std::optional<size_t> NextTurn() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = 0; i < turn_.size(); ++i) {
      const uint32_t uid = turn_[i];
      const Item& front = waiting_.at(uid).front();
      const auto running = running_.find(uid);
      if (!front.capped || running == running_.end() ||
          running->second < limits_.max_running_per_uid) {
        return i;
      }
    }
    return std::nullopt;
  }
  bool CanPop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return NextTurn().has_value() || (closed_ && queued_ == 0);
  }

  const Limits limits_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  size_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  // Uids with attaches waiting, in the order they get their next turn.
  std::deque<uint32_t> turn_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, std::deque<Item>> waiting_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, int> running_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpufeed::server
