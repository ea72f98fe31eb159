#include "server/share/share_cache.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace gpufeed::server {

namespace {

void Add(ShareCounters& to, const ShareCounters& from) {
  to.hits += from.hits;
  to.misses += from.misses;
  to.inserts += from.inserts;
  to.bypassed += from.bypassed;
  to.raced += from.raced;
  to.evictions += from.evictions;
  to.read_checks_passed += from.read_checks_passed;
  to.read_checks_refused += from.read_checks_refused;
  to.unshared += from.unshared;
  to.bytes += from.bytes;
  to.entries += from.entries;
}

}  // namespace

bool SharePending::TryStart(uint32_t uid) {
  absl::MutexLock lock(&mu_);
  if (started_) return false;
  started_ = true;
  uid_ = uid;
  return true;
}

uint32_t SharePending::decoder_uid() const {
  absl::MutexLock lock(&mu_);
  return uid_;
}

void SharePending::Finish(std::shared_ptr<const Image> image) {
  absl::MutexLock lock(&mu_);
  image_ = std::move(image);
  done_ = true;
}

std::shared_ptr<const Image> SharePending::Wait(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&done_), timeout);
  return done_ ? image_ : nullptr;
}

std::shared_ptr<const Image> SharePending::image() const {
  absl::MutexLock lock(&mu_);
  return done_ ? image_ : nullptr;
}

bool SharePending::failed() const {
  absl::MutexLock lock(&mu_);
  return done_ && image_ == nullptr;
}

ShareCache::Member& ShareCache::Member::operator=(Member&& other) noexcept {
  if (this != &other) {
    Leave();
    cache_ = std::exchange(other.cache_, nullptr);
    group_ = std::exchange(other.group_, nullptr);
    cursor_ = other.cursor_;
    ahead_ = std::move(other.ahead_);
    options_ = other.options_;
    held_ = std::move(other.held_);
    held_rows_ = std::exchange(other.held_rows_, 0);
  }
  return *this;
}

void ShareCache::Member::Leave() {
  if (cache_ != nullptr) cache_->Remove(*this);
  cache_ = nullptr;
  group_ = nullptr;
}

absl::StatusOr<ShareCache::Member> ShareCache::Join(const std::string& key,
                                                    const std::string& identity, int64_t cursor,
                                                    const ShareMemberOptions& options) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<GroupState>& g = groups_[key];
  if (g == nullptr) {
    g = std::make_unique<GroupState>();
    g->key = key;
    g->identity = identity;
  } else if (g->identity != identity) {
    if (!g->cursors.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the group reads ", g->identity, "; this job reads ", identity,
          ": the jobs of a group read one dataset in one order"));
    }
    // No job is in the group now: its images are of another dataset; the name is free.
    DropAll(*g);
    g->identity = identity;
  }
  Member m;
  m.cache_ = this;
  m.group_ = g.get();
  m.cursor_ = g->cursors.insert(cursor);
  m.options_ = options;
  return m;
}

void ShareCache::Remove(Member& m) {
  absl::MutexLock lock(&mu_);
  GroupState& g = *m.group_;
  // A member that ends with rows still held (its fill cut short) lets go of them now.
  while (!m.held_.empty()) {
    const auto held = m.held_.begin();
    Unhold(m, held->first, held->second);
  }
  g.cursors.erase(m.cursor_);
  if (!g.cursors.empty()) return;
  // The group's last job went: its images stay for the next job of the group (a sweep run one
  // job after another), read by no member now, so the first to go when room is needed.
  g.in_flight.clear();
  if (g.entries.empty()) {
    Add(gone_, g.counters);
    const std::string key = g.key;  // erase destroys g
    groups_.erase(key);
  }
}

void ShareCache::MoveCursor(Member& m, int64_t cursor) {
  if (*m.cursor_ == cursor) return;
  m.group_->cursors.erase(m.cursor_);
  m.cursor_ = m.group_->cursors.insert(cursor);
}

void ShareCache::Member::Advance(int64_t cursor) {
  absl::MutexLock lock(&cache_->mu_);
  ahead_.clear();
  cache_->MoveCursor(*this, cursor);
}

std::vector<ShareCache::Row> ShareCache::Member::Claim(std::span<const int64_t> ids,
                                                       int64_t first, int64_t end) {
  std::vector<Row> rows(ids.size());
  absl::MutexLock lock(&cache_->mu_);
  GroupState& g = *group_;
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto it = g.entries.find(ids[i]);
    if (it != g.entries.end()) {
      ++g.counters.hits;
      rows[i].found = it->second.image;
      rows[i].check_read = it->second.uid != options_.uid;
      continue;
    }
    // In flight: decoded and not offered yet (found), or claimed by another row (shared).
    auto flight = g.in_flight.find(ids[i]);
    if (flight != g.in_flight.end()) {
      const std::shared_ptr<SharePending>& pending = flight->second.pending;
      if ((rows[i].found = pending->image()) != nullptr) {
        rows[i].check_read = pending->decoder_uid() != options_.uid;
        ++g.counters.hits;
        continue;
      }
    }
    ++g.counters.misses;
    if (held_rows_ >= options_.max_in_flight) {
      ++g.counters.unshared;  // decoded by this row alone
      continue;
    }
    if (flight == g.in_flight.end() || flight->second.pending->failed()) {
      // None, or its decode failed: claimed anew (the failed one's rows let go of it alone).
      flight = g.in_flight.insert_or_assign(
          ids[i], InFlight{std::make_shared<SharePending>(ids[i]), 0}).first;
    }
    ++flight->second.rows;
    ++held_[flight->second.pending];
    ++held_rows_;
    rows[i].pending = flight->second.pending;
  }
  // Past the batch once every batch before it is claimed: then past those claimed after it.
  int64_t cursor = *cursor_;
  if (first <= cursor) {
    cursor = std::max(cursor, end);
    for (auto a = ahead_.begin(); a != ahead_.end() && a->first <= cursor; a = ahead_.erase(a)) {
      cursor = std::max(cursor, a->second);
    }
  } else {
    ahead_[first] = std::max(ahead_[first], end);
  }
  cache_->MoveCursor(*this, cursor);
  for (size_t i = 0; i < ids.size(); ++i) {
    rows[i].wanted = rows[i].found == nullptr && cache_->budget_ > 0;
  }
  return rows;
}

void ShareCache::Member::EndFill(const FillEnd& end) {
  if (cache_ == nullptr) return;
  absl::MutexLock lock(&cache_->mu_);
  for (const std::shared_ptr<SharePending>& pending : end.pending) {
    if (pending != nullptr && held_.contains(pending)) cache_->Unhold(*this, pending, 1);
  }
  group_->counters.read_checks_passed += end.read_checks_passed;
  group_->counters.read_checks_refused += end.read_checks_refused;
}

// `pending` by value: the caller may pass the held map's own key, which the erase below frees.
void ShareCache::Unhold(Member& m, std::shared_ptr<SharePending> pending, int64_t rows) {
  const auto held = m.held_.find(pending);
  m.held_rows_ -= rows;
  if ((held->second -= rows) == 0) m.held_.erase(held);
  // The group's map may hold another decode of the sample by now (this one failed and the
  // sample was claimed anew, or the group was emptied): that one is not this row's.
  GroupState& g = *m.group_;
  const auto flight = g.in_flight.find(pending->id());
  if (flight == g.in_flight.end() || flight->second.pending != pending) return;
  if ((flight->second.rows -= rows) == 0) g.in_flight.erase(flight);
}

void ShareCache::Member::Offer(int64_t id, int64_t at, std::shared_ptr<const Image> image) {
  const uint64_t bytes = image->rgb.size() + kEntryOverhead;
  ShareCache& c = *cache_;
  absl::MutexLock lock(&c.mu_);
  GroupState& g = *group_;
  if (g.entries.contains(id)) {  // another member's decode came first
    ++g.counters.raced;
    return;
  }
  const int64_t next_use = NextUse(g, at);
  if (bytes > c.budget_) {
    ++g.counters.bypassed;
    return;
  }
  while (c.used_ + bytes > c.budget_) {
    // The entry of every group used farthest ahead; kept over this one when no farther.
    GroupState* victim_group = nullptr;
    std::pair<int64_t, int64_t> victim{-1, 0};
    for (auto& [key, other] : c.groups_) {
      const std::pair<int64_t, int64_t> far = Farthest(*other);
      if (far.first > victim.first) {
        victim = far;
        victim_group = other.get();
      }
    }
    if (victim_group == nullptr || victim.first <= next_use) {
      ++g.counters.bypassed;
      return;
    }
    c.Erase(*victim_group, victim.second);
    ++victim_group->counters.evictions;
    if (victim_group != &g && victim_group->cursors.empty() && victim_group->entries.empty()) {
      Add(c.gone_, victim_group->counters);  // an ended group's last image went
      const std::string key = victim_group->key;
      c.groups_.erase(key);
    }
  }
  g.entries[id] = Entry{std::move(image), at, bytes, options_.uid};
  g.by_at.emplace(at, id);
  c.used_ += bytes;
  ++g.counters.inserts;
  ++g.counters.entries;
  g.counters.bytes += bytes;
}

int64_t ShareCache::NextUse(const GroupState& g, int64_t at) {
  auto behind = g.cursors.upper_bound(at);  // the first cursor past `at`
  if (behind == g.cursors.begin()) return kNever;
  return at - *std::prev(behind);
}

std::pair<int64_t, int64_t> ShareCache::Farthest(const GroupState& g) {
  if (g.by_at.empty()) return {-1, 0};
  if (g.cursors.empty() || g.by_at.begin()->first < *g.cursors.begin()) {
    return {kNever, g.by_at.begin()->second};
  }
  // Between two neighbouring cursors (and past the last), the entry farthest from the lower
  // cursor is the last one before the upper: one lookup per distinct cursor.
  std::pair<int64_t, int64_t> best{-1, 0};
  for (auto c = g.cursors.begin(); c != g.cursors.end(); c = g.cursors.upper_bound(*c)) {
    const auto upper = g.cursors.upper_bound(*c);
    auto last = upper == g.cursors.end() ? g.by_at.end()
                                         : g.by_at.lower_bound({*upper, int64_t{0}});
    if (last == g.by_at.begin()) continue;
    --last;
    if (last->first < *c) continue;
    if (last->first - *c > best.first) best = {last->first - *c, last->second};
  }
  return best;
}

void ShareCache::Erase(GroupState& g, int64_t id) {
  const auto it = g.entries.find(id);
  g.by_at.erase({it->second.at, id});
  used_ -= it->second.bytes;
  g.counters.bytes -= it->second.bytes;
  --g.counters.entries;
  g.entries.erase(it);
}

void ShareCache::DropAll(GroupState& g) {
  g.in_flight.clear();
  while (!g.by_at.empty()) Erase(g, g.by_at.begin()->second);
  Add(gone_, g.counters);  // bytes and entries are 0 now
  g.counters = ShareCounters{};
}

ShareCounters ShareCache::counters() const {
  absl::MutexLock lock(&mu_);
  ShareCounters all = gone_;
  for (const auto& [key, g] : groups_) Add(all, g->counters);
  return all;
}

std::vector<ShareGroupInfo> ShareCache::Groups() const {
  absl::MutexLock lock(&mu_);
  std::vector<ShareGroupInfo> out;
  for (const auto& [key, g] : groups_) {
    out.push_back({key, static_cast<int>(g->cursors.size()),
                   std::vector<int64_t>(g->cursors.begin(), g->cursors.end()),
                   static_cast<int64_t>(g->in_flight.size()), g->counters});
  }
  return out;
}

}  // namespace gpufeed::server
