// Caps on what a client may hold before it does any work (docs/SECURITY.md section 4): the
// gRPC socket's connections, and Stream calls whose open message has not come yet. Each is
// capped per uid (admins exempt, but counted) and in total; an unopened stream also has a
// deadline. Past a cap the answer is RESOURCE_EXHAUSTED naming the config field.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/os/peer_cred.h"

namespace gpufeed::server {

// Counts of things held per uid and in total, against two caps. Not thread-safe: its owner
// locks.
class UidCaps {
 public:
  // `what`: the things counted, for messages ("connections"); `per_uid_field` and
  // `total_field`: the config fields the caps come from, named in every refusal.
  UidCaps(std::string what, int max_per_uid, std::string per_uid_field, int max_total,
          std::string total_field);

  // Counts one more of `uid`'s, or RESOURCE_EXHAUSTED naming the cap (nothing counted).
  // `exempt` (an admin): not capped per uid, still counted, and capped in total.
  absl::Status Acquire(uint32_t uid, bool exempt);
  // Counts one of `uid`'s less (one Acquire'd before).
  void Release(uint32_t uid);

  int total() const { return total_; }
  int of(uint32_t uid) const;

 private:
  const std::string what_;
  const int max_per_uid_;
  const std::string per_uid_field_;
  const int max_total_;
  const std::string total_field_;
  int total_ = 0;
  absl::flat_hash_map<uint32_t, int> per_uid_;
};

// The connections the gRPC socket's listener handed to gRPC: their peers (looked up by fd
// number for every call) and their count, capped per uid and in total.
//
// gRPC owns a connection's fd once handed over and says nothing when it closes it, so the
// table learns of closes itself: each entry keeps the socket's inode with the fd number, and
// an entry whose fd number no longer refers to that inode (fstat fails, or shows another
// file) is a connection gRPC closed. That is exact: a socket's inode number is unique among
// open sockets, and a descriptor number that gRPC closed and the process reused for anything
// else shows that other file's inode. (A dup of the fd would keep the socket open; polling
// the fd for a hang-up would race gRPC's own use of it.) Entries are checked only when an
// admission would pass a cap (Sweep), so the cost of a check is paid only near the caps.
class ConnectionTable {
 public:
  // Whether fd `fd` still refers to the socket whose inode is `inode`.
  using StillOpen = std::function<bool(int fd, uint64_t inode)>;
  // `still_open` defaults to an fstat of `fd` (tests pass a fake).
  ConnectionTable(int max_per_uid, int max_total, StillOpen still_open = nullptr);

  // Records a connection just accepted on `fd` (its socket's inode `inode`) from `cred`, or
  // RESOURCE_EXHAUSTED naming max_connections_per_uid or max_connections (nothing recorded).
  // Past a cap it first forgets the connections closed since (Sweep). An entry of the same fd
  // number is replaced: that connection was closed, its number reused.
  absl::Status Admit(int fd, uint64_t inode, const PeerCred& cred, bool exempt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The peer of the connection on `fd`; nullopt for an fd not admitted here.
  std::optional<PeerCred> Lookup(int fd) const ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the connections whose fds no longer refer to their sockets; returns how many.
  int Sweep() ABSL_LOCKS_EXCLUDED(mu_);

  int size() const ABSL_LOCKS_EXCLUDED(mu_);
  int of(uint32_t uid) const ABSL_LOCKS_EXCLUDED(mu_);

  // fstat(fd): a socket with inode `inode`.
  static bool FstatStillOpen(int fd, uint64_t inode);

 private:
  struct Entry {
    uint64_t inode = 0;
    PeerCred cred;
  };
  void ForgetLocked(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StillOpen still_open_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Entry> entries_ ABSL_GUARDED_BY(mu_);
  UidCaps caps_ ABSL_GUARDED_BY(mu_);
};

// Stream calls whose open message has not come yet: capped per uid and in total, and each
// given `timeout` for its open. A thread ("stream/open") runs a stream's on_timeout once
// its time is up; Remove before then (the open came, or the stream ended) cancels it.
class UnopenedStreams {
 public:
  UnopenedStreams(int max_per_uid, int max_total, absl::Duration timeout);
  ~UnopenedStreams();  // joins the thread; no on_timeout runs after

  // Counts a new stream of `uid` (`exempt`: an admin, not capped per uid) and returns its id,
  // or RESOURCE_EXHAUSTED naming max_connections_per_uid or max_connections.
  absl::StatusOr<uint64_t> Admit(uint32_t uid, bool exempt, std::function<void()> on_timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Uncounts stream `id`: true when its time was not up yet (its on_timeout will not run);
  // false when it timed out already (its on_timeout has run or is running) or is unknown.
  bool Remove(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Duration timeout() const { return timeout_; }
  int size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    uint32_t uid = 0;
    absl::Time deadline;
    std::function<void()> on_timeout;
  };
  void Loop();

  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  // By id: ids and deadlines grow together (one timeout for all), so the first is the next due.
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  UidCaps caps_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace gpufeed::server
