#include "server/service/conn_limits.h"

#include <pthread.h>
#include <sys/stat.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace gpufeed::server {

UidCaps::UidCaps(std::string what, int max_per_uid, std::string per_uid_field, int max_total,
                 std::string total_field)
    : what_(std::move(what)),
      max_per_uid_(max_per_uid),
      per_uid_field_(std::move(per_uid_field)),
      max_total_(max_total),
      total_field_(std::move(total_field)) {}

absl::Status UidCaps::Acquire(uint32_t uid, bool exempt) {
  if (total_ >= max_total_) {
    return absl::ResourceExhaustedError(absl::StrCat(total_field_, ": ", total_, " ", what_,
                                                     " are held, the most gpufeedd allows (",
                                                     total_field_, "); retry shortly"));
  }
  int& mine = per_uid_[uid];
  if (!exempt && mine >= max_per_uid_) {
    const int held = mine;
    if (held == 0) per_uid_.erase(uid);
    return absl::ResourceExhaustedError(absl::StrCat(per_uid_field_, ": uid ", uid, " holds ", held,
                                                     " ", what_, ", the most one uid may (",
                                                     per_uid_field_, ")"));
  }
  ++mine;
  ++total_;
  return absl::OkStatus();
}

void UidCaps::Release(uint32_t uid) {
  auto it = per_uid_.find(uid);
  if (it == per_uid_.end()) return;
  --total_;
  if (--it->second <= 0) per_uid_.erase(it);
}

int UidCaps::of(uint32_t uid) const {
  auto it = per_uid_.find(uid);
  return it == per_uid_.end() ? 0 : it->second;
}

// ---- ConnectionTable ----

bool ConnectionTable::FstatStillOpen(int fd, uint64_t inode) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && static_cast<uint64_t>(st.st_ino) == inode;
}

ConnectionTable::ConnectionTable(int max_per_uid, int max_total, StillOpen still_open)
    : still_open_(still_open != nullptr ? std::move(still_open) : StillOpen(&FstatStillOpen)),
      caps_("connections", max_per_uid, "max_connections_per_uid", max_total, "max_connections") {}

void ConnectionTable::ForgetLocked(int fd) {
  auto it = entries_.find(fd);
  if (it == entries_.end()) return;
  caps_.Release(it->second.cred.uid);
  entries_.erase(it);
}

absl::Status ConnectionTable::Admit(int fd, uint64_t inode, const PeerCred& cred, bool exempt) {
  {
    absl::MutexLock lock(&mu_);
    ForgetLocked(fd);  // its number was reused: gRPC closed that connection
    if (caps_.Acquire(cred.uid, exempt).ok()) {
      entries_[fd] = Entry{inode, cred};
      return absl::OkStatus();
    }
  }
  // Past a cap: some of the connections counted may have been closed by gRPC since.
  Sweep();
  absl::MutexLock lock(&mu_);
  absl::Status admitted = caps_.Acquire(cred.uid, exempt);
  if (admitted.ok()) entries_[fd] = Entry{inode, cred};
  return admitted;
}

std::optional<PeerCred> ConnectionTable::Lookup(int fd) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(fd);
  if (it == entries_.end()) return std::nullopt;
  return it->second.cred;
}

int ConnectionTable::Sweep() {
  std::vector<std::pair<int, uint64_t>> all;
  {
    absl::MutexLock lock(&mu_);
    all.reserve(entries_.size());
    for (const auto& [fd, entry] : entries_) all.emplace_back(fd, entry.inode);
  }
  // fstat outside the lock: calls look their peers up meanwhile.
  std::vector<std::pair<int, uint64_t>> closed;
  for (const auto& [fd, inode] : all) {
    if (!still_open_(fd, inode)) closed.emplace_back(fd, inode);
  }
  absl::MutexLock lock(&mu_);
  int forgotten = 0;
  for (const auto& [fd, inode] : closed) {
    // Only the entry that was checked: Admit may have replaced it since.
    auto it = entries_.find(fd);
    if (it == entries_.end() || it->second.inode != inode) continue;
    ForgetLocked(fd);
    ++forgotten;
  }
  return forgotten;
}

int ConnectionTable::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

int ConnectionTable::of(uint32_t uid) const {
  absl::MutexLock lock(&mu_);
  return caps_.of(uid);
}

// ---- UnopenedStreams ----

UnopenedStreams::UnopenedStreams(int max_per_uid, int max_total, absl::Duration timeout)
    : timeout_(timeout),
      caps_("streams waiting for their open message", max_per_uid, "max_connections_per_uid",
            max_total, "max_connections") {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "stream/open");
    Loop();
  });
}

UnopenedStreams::~UnopenedStreams() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

absl::StatusOr<uint64_t> UnopenedStreams::Admit(uint32_t uid, bool exempt,
                                                std::function<void()> on_timeout) {
  absl::MutexLock lock(&mu_);
  absl::Status admitted = caps_.Acquire(uid, exempt);
  if (!admitted.ok()) return admitted;
  const uint64_t id = next_id_++;
  entries_[id] = Entry{uid, absl::Now() + timeout_, std::move(on_timeout)};
  return id;
}

bool UnopenedStreams::Remove(uint64_t id) {
  std::function<void()> dropped;  // destroyed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  caps_.Release(it->second.uid);
  dropped = std::move(it->second.on_timeout);
  entries_.erase(it);
  return true;
}

int UnopenedStreams::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

void UnopenedStreams::Loop() {
  while (true) {
    std::vector<std::function<void()>> due;
    {
      absl::MutexLock lock(&mu_);
      // Sleeps until the first entry's deadline, or until another entry is first (one
      // admitted into an empty map, or the first removed), then looks again.
      const auto first_id = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return entries_.empty() ? uint64_t{0} : entries_.begin()->first;
      };
      const uint64_t first = first_id();
      const auto wake = [this, first, &first_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || first_id() != first;
      };
      mu_.AwaitWithDeadline(absl::Condition(&wake), entries_.empty()
                                                        ? absl::InfiniteFuture()
                                                        : entries_.begin()->second.deadline);
      if (stopping_) return;
      const absl::Time now = absl::Now();
      while (!entries_.empty() && entries_.begin()->second.deadline <= now) {
        caps_.Release(entries_.begin()->second.uid);
        due.push_back(std::move(entries_.begin()->second.on_timeout));
        entries_.erase(entries_.begin());
      }
    }
    for (std::function<void()>& f : due) f();
  }
}

}  // namespace gpufeed::server
