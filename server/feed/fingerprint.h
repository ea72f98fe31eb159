// A feed's fingerprint ("name=value;name=value", values %-escaped) compared with the one a
// saved position carries. The daemon is the one place that knows the format and which older
// forms still match: clients show its answer (the refusal's message, whose grammar
// kFingerprintRefusal and DescribeDifference fix) instead of comparing themselves.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace gpufeed::server {

// The fields of a "name=value;name=value" text (a fingerprint, a canonical spec), in order; a
// field without "=" has an empty value.
std::vector<std::pair<std::string, std::string>> ParseFields(absl::string_view text);

// One field that differs between a saved fingerprint and the feed's; a side without the field
// is nullopt. Values stay %-escaped, so none holds ';'.
struct FingerprintDifference {
  std::string field;
  std::optional<std::string> saved;
  std::optional<std::string> current;

  bool operator==(const FingerprintDifference& o) const {
    return field == o.field && saved == o.saved && current == o.current;
  }
};

// The fields that differ, the feed's in its order then those only the saved one has; empty
// when the saved fingerprint resumes the feed, including a form an earlier release saved of
// the same feed.
std::vector<FingerprintDifference> FingerprintDifferences(absl::string_view saved,
                                                          absl::string_view current);

// One difference for people, and one item of the refusal: "NAME was SAVED, is CURRENT",
// "NAME (not in the saved position)" or "NAME (no longer part of the feed)" (the sampler's
// absence says what it means for the sample order).
std::string DescribeDifference(const FingerprintDifference& d);

// The refusal's message is kFingerprintRefusal, the items joined by "; ", then
// kFingerprintRefusalEnd: a client takes the items back by splitting on "; " (no item holds
// one) and may put them in its own words.
inline constexpr absl::string_view kFingerprintRefusal =
    "start.fingerprint: the position was saved from another feed: ";
inline constexpr absl::string_view kFingerprintRefusalEnd =
    ". Resume with the settings and data it was saved with, or start without it";

// The items of a fingerprint that name the world layout a position was saved at (the
// per-rank batch and the world size), not the feed: never compared, since a resume at
// another layout is an elastic one (session/elastic.h; docs/sampling.md).
inline constexpr absl::string_view kLayoutFields[] = {"batch_size", "world_size"};

struct SavedLayout {
  int64_t batch_size = 0;
  int32_t world_size = 0;
  bool operator==(const SavedLayout&) const = default;
};
// The layout a fingerprint names; nullopt where it lacks either item or one is not a
// positive number of its range.
std::optional<SavedLayout> LayoutOf(absl::string_view fingerprint);

// OK when a position saved with fingerprint `saved` may resume the feed of `current`;
// FAILED_PRECONDITION naming every field that differs otherwise.
absl::Status CompareFingerprints(absl::string_view saved, absl::string_view current);

}  // namespace gpufeed::server
