#include "server/session/elastic.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/feed/fingerprint.h"

namespace gpufeed::server {
namespace {

// The world sizes that split `global` evenly, for a refusal: those up to 1024, enough for
// any node count a job resumes at.
std::string DivisorsOf(uint64_t global) {
  std::vector<uint64_t> divisors;
  constexpr uint64_t kShown = 1024;
  for (uint64_t d = 1; d <= std::min(global, kShown); ++d) {
    if (global % d == 0) divisors.push_back(d);
  }
  return absl::StrCat(absl::StrJoin(divisors, ", "), global > kShown ? ", ..." : "");
}

}  // namespace

absl::StatusOr<std::string> ResolveElastic(AttachSpec& spec) {
  const int64_t batch = spec.feed.batch_size;
  const int32_t world = spec.feed.world_size;
  if (spec.start_samples < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("start.samples: must be >= 0, got ", spec.start_samples));
  }
  // ValidateAttachSpec bounds both sides, so the products below fit.
  const std::optional<SavedLayout> saved = LayoutOf(spec.start_fingerprint);
  const SavedLayout was = saved.value_or(SavedLayout{batch, world});
  if (was.batch_size > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start.fingerprint: a saved layout of batch_size ", was.batch_size, " x world_size ",
        was.world_size, " is past what an Attach may ask"));
  }
  const int64_t saved_global = was.batch_size * was.world_size;
  spec.relaid = was.batch_size != batch || was.world_size != world;
  const std::string saved_text = absl::StrCat("the saved position's global batch of ",
                                              saved_global, " samples (", was.batch_size, " x ",
                                              was.world_size, " ranks)");
  if (spec.relaid && spec.elastic == ElasticMode::kKeepGlobalBatch &&
      batch * world != saved_global) {
    if (saved_global % world != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world_size: ", saved_text, " does not split over ", world,
          " ranks; resume at a world size that divides it (", DivisorsOf(saved_global),
          "), or with elastic=rank_batch to keep ", batch, " samples per rank"));
    }
    if (batch != was.batch_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch_size: ", batch, " x ", world, " ranks is a global batch of ", batch * world,
          ", not ", saved_text, "; resume with batch_size=", saved_global / world,
          " (or the saved ", was.batch_size, ", which then becomes ", saved_global / world,
          "), or with elastic=rank_batch to change the global batch"));
    }
    spec.feed.batch_size = saved_global / world;
  }
  const int64_t global = spec.feed.batch_size * world;
  // Both global batches are below 2^55 (batch_size <= 2^24, world_size < 2^31).
  if (spec.start.step > (int64_t{1} << 62) / std::max(global, saved_global)) {
    return absl::InvalidArgumentError(
        absl::StrCat("start.step: ", spec.start.step, " is past any epoch of this feed"));
  }
  // A cursor of 0 with a step: a position saved before the cursor was (step x the saved
  // global batch), or one at an epoch's start.
  const int64_t cursor = spec.start_samples > 0
                             ? spec.start_samples
                             : spec.start.step * saved_global;
  int64_t base = 0;
  if (global == saved_global) {
    // The saved step numbers the same global batches: its cursor lies inside that step.
    base = cursor - spec.start.step * global;
    if (base < 0 || base >= global) {
      return absl::InvalidArgumentError(absl::StrCat(
          "start.samples: ", cursor, " is not a cursor of step ", spec.start.step,
          " at a global batch of ", global, " (it lies in [", spec.start.step * global, ", ",
          (spec.start.step + 1) * global, "))"));
    }
  } else {
    base = cursor % global;
    spec.start.step = cursor / global;
  }
  if (base != 0) {
    spec.feed.resume_epoch = spec.start.epoch;
    spec.feed.resume_base = static_cast<uint64_t>(base);
  }
  if (!spec.relaid) return std::string();
  return absl::StrCat("elastic resume (keep the ",
                      spec.elastic == ElasticMode::kKeepGlobalBatch ? "global" : "per-rank",
                      " batch) from ", was.batch_size, " x ", was.world_size, " ranks to ",
                      spec.feed.batch_size, " x ", world, " ranks at epoch ", spec.start.epoch,
                      " sample ", cursor, " (step ", spec.start.step, ")");
}

absl::Status SettleElasticStart(AttachSpec& spec, const Sampler& sampler) {
  if (spec.feed.resume_epoch < 0 && !spec.relaid) return absl::OkStatus();
  const uint64_t n = sampler.config().num_samples;
  const uint64_t cursor = sampler.config().resume_base +
                          static_cast<uint64_t>(spec.start.step) * sampler.global_batch();
  if (cursor > n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start.samples: ", cursor, " is past the ", n, " samples of epoch ", spec.start.epoch));
  }
  // What is left of the epoch is its drop_last tail, or nothing: the next epoch begins.
  if (spec.start.step >= sampler.StepsIn(spec.start.epoch)) spec.start = {spec.start.epoch + 1, 0};
  return absl::OkStatus();
}

}  // namespace gpufeed::server
