#include "server/feed/fingerprint.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/reader/shards.h"

namespace gpufeed::server {

std::vector<std::pair<std::string, std::string>> ParseFields(absl::string_view text) {
  std::vector<std::pair<std::string, std::string>> out;
  for (absl::string_view field : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    const size_t eq = field.find('=');
    if (eq == absl::string_view::npos) {
      out.emplace_back(std::string(field), "");
    } else {
      out.emplace_back(std::string(field.substr(0, eq)), std::string(field.substr(eq + 1)));
    }
  }
  return out;
}

namespace {

using Fields = std::vector<std::pair<std::string, std::string>>;

Fields::const_iterator Find(const Fields& fields, absl::string_view name) {
  return std::find_if(fields.begin(), fields.end(),
                      [name](const auto& p) { return p.first == name; });
}

// A position saved by a gpufeedd from before 2026-12-02 read as one saved now, where that
// release's fingerprint of the same feed differs only in form: for a directory of shards it
// held the directory's time (`mtime_ns` without `bytes`) and a `shards` item without its
// files' times. Both are taken as matching: the shard set must still be the same, only its
// files' times (which that release did not record) go unchecked.
void UpgradeSaved(Fields& saved, const Fields& current) {
  const auto shards = Find(current, "shards");
  if (shards == current.end()) return;
  if (Find(saved, "bytes") == saved.end() && Find(current, "mtime_ns") == current.end()) {
    saved.erase(std::remove_if(saved.begin(), saved.end(),
                               [](const auto& p) { return p.first == "mtime_ns"; }),
                saved.end());
  }
  const absl::string_view now = shards->second;
  for (auto& [name, value] : saved) {
    if (name == "shards" && !absl::StrContains(value, kShardTimesPart) &&
        now.substr(0, now.find(kShardTimesPart)) == value) {
      value = shards->second;
    }
  }
}

bool IsLayout(absl::string_view name) {
  return std::find(std::begin(kLayoutFields), std::end(kLayoutFields), name) !=
         std::end(kLayoutFields);
}

}  // namespace

std::optional<SavedLayout> LayoutOf(absl::string_view fingerprint) {
  const Fields fields = ParseFields(fingerprint);
  const auto batch = Find(fields, "batch_size");
  const auto world = Find(fields, "world_size");
  SavedLayout layout;
  if (batch == fields.end() || world == fields.end() ||
      !absl::SimpleAtoi(batch->second, &layout.batch_size) ||
      !absl::SimpleAtoi(world->second, &layout.world_size) || layout.batch_size < 1 ||
      layout.world_size < 1) {
    return std::nullopt;
  }
  return layout;
}

std::vector<FingerprintDifference> FingerprintDifferences(absl::string_view saved,
                                                          absl::string_view current) {
  std::vector<FingerprintDifference> out;
  if (saved == current) return out;
  Fields a = ParseFields(saved);
  const Fields b = ParseFields(current);
  UpgradeSaved(a, b);
  for (const auto& [name, value] : b) {
    if (IsLayout(name)) continue;
    const auto it = Find(a, name);
    if (it == a.end()) {
      out.push_back({name, std::nullopt, value});
    } else if (it->second != value) {
      out.push_back({name, it->second, value});
    }
  }
  for (const auto& [name, value] : a) {
    if (!IsLayout(name) && Find(b, name) == b.end()) out.push_back({name, value, std::nullopt});
  }
  return out;
}

std::string DescribeDifference(const FingerprintDifference& d) {
  if (!d.saved && d.field == "sampler") {
    return absl::StrCat("sampler (the position was saved by a gpufeedd before ",
                        d.current.value_or(""),
                        ", whose sample order differs: the same (epoch, step) names other "
                        "samples now)");
  }
  if (!d.saved) return absl::StrCat(d.field, " (not in the saved position)");
  if (!d.current) return absl::StrCat(d.field, " (no longer part of the feed)");
  return absl::StrCat(d.field, " was ", *d.saved, ", is ", *d.current);
}

absl::Status CompareFingerprints(absl::string_view saved, absl::string_view current) {
  const std::vector<FingerprintDifference> differ = FingerprintDifferences(saved, current);
  if (differ.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      kFingerprintRefusal,
      absl::StrJoin(differ, "; ",
                    [](std::string* out, const FingerprintDifference& d) {
                      out->append(DescribeDifference(d));
                    }),
      kFingerprintRefusalEnd));
}

}  // namespace gpufeed::server
