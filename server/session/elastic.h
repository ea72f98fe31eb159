// An elastic resume (docs/sampling.md, "Elastic resume"): a position saved by a job of one
// world layout (per-rank batch B, world size W) resuming a job of another (B', W'). A
// position is the job's global cursor (epoch, and how many places of the epoch's order its
// batches covered), the same on every rank, so it means the same at any layout:
// - keep the global batch (the default): B' = B·W / W', which W' must divide; the global
//   batches are the uninterrupted run's, so the step number carries over;
// - keep the per-rank batch: the global batch becomes B'·W'; the epoch goes on from the
//   cursor, every place not yet read once. Its batches then begin at the cursor: the feed
//   reads that epoch from base = cursor mod B'·W' (FeedSpec::resume_epoch/resume_base), and
//   the job starts at step cursor div B'·W'.
// A position at the layout it was saved at is the same rule with B' = B and W' = W: a
// re-attach inside such a resumed epoch finds the same base (cursor - step·B'·W').
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/session/attach_spec.h"

namespace gpufeed::server {

// Rewrites spec.feed.batch_size (keeping the global batch), spec.start.step and the feed's
// resume fields from spec.start, spec.start_samples, the layout spec.start_fingerprint names
// (none: the request's) and spec.elastic. INVALID_ARGUMENT in one line naming what would
// work: a global batch the new world size does not divide (its divisors), a batch size that
// keeps neither, a cursor outside the step it is saved with. Returns what changed for the
// log (empty when the layout is the saved one).
absl::StatusOr<std::string> ResolveElastic(AttachSpec& spec);

// After the feed opened: a start past the last step of its epoch (an elastic resume in an
// epoch's dropped tail, or at its end) moves to the next epoch's first step; a cursor past
// the epoch's samples is INVALID_ARGUMENT.
absl::Status SettleElasticStart(AttachSpec& spec, const Sampler& sampler);

}  // namespace gpufeed::server
