// The jobs of the attached sessions: which ranks of each are attached and the feed they
// share. Every rank of a job must use the same dataset and sampling, and a rank attaches once.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"

namespace gpufeed::server {

// One rank of a job, as Attach places it. Jobs are namespaced by their owner's uid.
struct JobMember {
  uint32_t uid = 0;
  std::string job;
  int32_t rank = 0;
  std::string canonical;  // the feed spec every rank must agree on (FeedSpec::Canonical)
  std::string feed_key;   // and the dataset they opened (Feed::key: spec, device, inode)
};

// Not thread-safe: its owner guards it (SessionManager, under its mutex).
class JobRegistry {
 public:
  // FAILED_PRECONDITION naming the fields that differ when the job is attached with another
  // feed; ALREADY_EXISTS when the rank is attached.
  absl::Status CheckJoin(const JobMember& member) const;
  // Registers the rank (CheckJoin first).
  void Join(const JobMember& member);
  // The rank goes; a job with no rank left is forgotten.
  void Leave(uint32_t uid, const std::string& job, int32_t rank);
  void Clear() { jobs_.clear(); }
  size_t size() const { return jobs_.size(); }

 private:
  struct Job {
    std::string canonical;
    std::string feed_key;
    absl::flat_hash_set<int32_t> ranks;
  };
  using JobKey = std::pair<uint32_t, std::string>;

  absl::flat_hash_map<JobKey, Job> jobs_;
};

}  // namespace gpufeed::server
