#include "server/session/job_registry.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/feed/feed.h"

namespace gpufeed::server {
namespace {

// The fields of two FeedSpec::Canonical strings that differ, as "name=asked (the job's:
// had)"; "the dataset file" when only the opened file differs (same text, another inode).
std::string SpecDifference(const std::string& had, const std::string& asked) {
  const auto a = ParseFields(had);
  const auto b = ParseFields(asked);
  std::vector<std::string> differ;
  for (const auto& [name, value] : b) {
    std::string theirs = "(none)";
    for (const auto& [n, v] : a) {
      if (n == name) theirs = v;
    }
    if (theirs != value)
      differ.push_back(absl::StrCat(name, "=", value, " (the job's: ", theirs, ")"));
  }
  return differ.empty() ? std::string("another dataset file under the same path")
                        : absl::StrJoin(differ, ", ");
}

}  // namespace

absl::Status JobRegistry::CheckJoin(const JobMember& member) const {
  auto it = jobs_.find(JobKey(member.uid, member.job));
  if (it == jobs_.end()) return absl::OkStatus();
  // The spec as shown, and the dataset as opened (its device and inode, and for an image
  // folder its reader: the feed's key): two ranks passing different files under one display
  // path are not one job.
  if (it->second.canonical != member.canonical || it->second.feed_key != member.feed_key) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", member.job,
        "' is attached with another feed: ", SpecDifference(it->second.canonical, member.canonical),
        "; rank ", member.rank, " asked for {", member.canonical,
        "}: every rank of a job must use the same dataset and sampling; to run another "
        "job beside it, give that one another name (job=)"));
  }
  if (it->second.ranks.contains(member.rank)) {
    return absl::AlreadyExistsError(
        absl::StrCat("job '", member.job, "' rank ", member.rank,
                     " is already attached; to run another "
                     "job beside it, give that one another name (job=)"));
  }
  return absl::OkStatus();
}

void JobRegistry::Join(const JobMember& member) {
  Job& job = jobs_[JobKey(member.uid, member.job)];
  job.canonical = member.canonical;
  job.feed_key = member.feed_key;
  job.ranks.insert(member.rank);
}

void JobRegistry::Leave(uint32_t uid, const std::string& job, int32_t rank) {
  auto it = jobs_.find(JobKey(uid, job));
  if (it == jobs_.end()) return;
  it->second.ranks.erase(rank);
  if (it->second.ranks.empty()) jobs_.erase(it);
}

}  // namespace gpufeed::server
