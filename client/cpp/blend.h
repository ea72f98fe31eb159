// Internal to the client: a blend of token sources and a pack mode (AttachOptions::blend,
// pack, eos_id, pack_lookahead, blend_history) -> DatasetSpec.sources and its neighbours,
// each source's name expanded here to the explicit list of files the daemon reads
// (docs/howto/blends-and-packing.md). A bad option is INVALID_ARGUMENT naming the field, a
// source by its index and name: "blend[1] '/data/code/*.bin': no files match".
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.pb.h"

namespace gpufeed::client::internal {

// Sources in one blend, at most (DatasetSpec.sources).
inline constexpr size_t kMaxBlendSources = 256;

// The files source `index` of a blend, named `name`, stands for, as absolute real paths in
// name order: a regular file itself; of a directory, its regular files (links followed) whose
// names do not start with '.'; of a glob in the last component, those of its directory's
// names that fnmatch(FNM_PERIOD) matches. Of a directory or a glob, an X.idx whose X.bin is
// among them is left out (the daemon reads it beside the .bin). Errors name the source; none
// is a source of no file.
absl::StatusOr<std::vector<std::string>> ExpandBlendSource(size_t index, const std::string& name);

// Checks `o`'s blend and pack options and sets them in `d` (DatasetSpec.sources with each
// source's files, pack, eos_id, pack_lookahead, blend_history). Called after `d`'s kind is
// set; `d.path` stays empty for a blend (the files' common directory, set when they are
// opened and passed).
absl::Status BlendInto(const AttachOptions& o, v1::DatasetSpec* d);

// `mode` as AttachOptions.pack names it ("none", "concat", "best_fit"; "unknown" otherwise).
const char* PackModeName(v1::PackMode mode);

// The segments an AttachResponse reported for a request of `sources` sources, checked as
// everything taken from the socket is: each of `sources` weights and ledger entries, at most
// one more than the request's history (`history`). INTERNAL otherwise.
absl::StatusOr<std::vector<BlendSegment>> BlendSegmentsFromReply(
    const google::protobuf::RepeatedPtrField<v1::BlendSegment>& reply, int sources, int history);

// `segments` as DatasetSpec.blend_history.
void BlendHistoryInto(const std::vector<BlendSegment>& segments, v1::DatasetSpec* d);

}  // namespace gpufeed::client::internal
