// Sharded datasets (token shards, WebDataset tars): how a dataset path names its shards (a
// directory, a glob or a brace pattern in the last component), the directory they are opened
// beneath, and the shard set's identity for the feed's fingerprint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/fd.h"
#include "server/reader/dataset.h"

namespace gpufeed::server {

// At most this many shards in one dataset (and names in one brace expansion).
inline constexpr size_t kMaxShards = size_t{1} << 20;

// Whether a name holds a shell glob (`*`, `?`, `[`).
bool HasGlob(absl::string_view name);

// Expands the braces of `pattern` as the shell (and WebDataset's braceexpand) do:
// `{a,b,c}` gives each alternative, `{000..146}` each integer of the range (either way round),
// zero-padded to the wider bound when a bound has a leading zero; braces nest and several
// expand as their product, left to right. A brace with neither a comma nor a range stays as
// written. INVALID_ARGUMENT for an unmatched brace or past `max_names` names (checked before
// they are made: `{0..999999}{0..999999}` costs nothing).
absl::StatusOr<std::vector<std::string>> ExpandBraces(absl::string_view pattern,
                                                      size_t max_names = kMaxShards);

// Where a sharded dataset's shards lie: the directory to open them beneath (a descriptor,
// owned here or borrowed from the spec), its display path, and the last path component when
// it is a pattern ("" when the path is the directory itself).
struct ShardDir {
  UniqueFd own;  // set when the daemon opened the directory itself (an admin's path)
  int fd = -1;
  std::string dir;
  std::string pattern;
  // `pattern` is one file's name, taken as it is (no glob): a file named alone that is read
  // with a companion beside it (FindPairedFile).
  bool exact = false;
};

// The shard directory of `spec`, or nullopt when its path names one file. The client passes
// the directory (docs/SECURITY.md section 2): the path's own, or, when the last component is
// a pattern (`is_pattern`) and the directory passed is not named so, its parent's. Without a
// descriptor (an admin's attach by path) the daemon opens it with its own rights.
absl::StatusOr<std::optional<ShardDir>> FindShardDir(
    const FileDatasetSpec& spec, const std::function<bool(absl::string_view)>& is_pattern);

// A file read with a companion beside it, named alone (a Megatron-LM `X.bin` and its
// `X.idx`): its directory, to open both beneath, and its name as an exact pattern; nullopt
// when `spec` names no such file. With a descriptor, the client passed the file's directory
// (it saw the companion): the path's last component ends with `suffix`, is no glob, is not
// the passed directory's own name, and is an entry of it (a link too, which the open beneath
// then refuses). Without one (an admin's path): the path is a regular file ending with
// `suffix` and its name with `companion` for `suffix` lies beside it, else nullopt and the
// file is read alone as before.
absl::StatusOr<std::optional<ShardDir>> FindPairedFile(const FileDatasetSpec& spec,
                                                       absl::string_view suffix,
                                                       absl::string_view companion);

// INVALID_ARGUMENT naming the entry ("dataset.paths[3]: ...") unless `spec.paths` is empty
// or is a list for kind tokens or webdataset of at most kMaxListedShards absolute paths
// (kMaxListedShardBytes together), each beneath the directory `spec.path` (absolute) by
// components that are names (not "", "." or ".."; at most 255 bytes; no NUL), none twice.
absl::Status ValidateShardPaths(const FileDatasetSpec& spec);

// An explicit list's directory (the descriptor passed, or, for an admin's attach by path,
// `spec.path` opened here) and each file's name relative to it, in the list's order;
// validated (ValidateShardPaths).
struct ShardList {
  ShardDir dir;
  std::vector<std::string> relative;
};
absl::StatusOr<ShardList> OpenShardList(const FileDatasetSpec& spec);

// "N files, fnv1a64 H" of an explicit list's paths, in order: the feed's key and fingerprint
// name a list by it (a list of 16384 paths would make both megabytes long).
std::string ShardPathsIdentity(const std::vector<std::string>& paths);

// The names of the regular files directly in `dirfd` (not starting with '.') that `keep`
// accepts, sorted by name (byte order); INVALID_ARGUMENT past kMaxShards. `dir` names the
// directory in messages.
absl::StatusOr<std::vector<std::string>> ListShardFiles(
    int dirfd, const std::string& dir, const std::function<bool(const std::string&)>& keep);

// A warning (DatasetNotice reason "warning") when the shard names a directory or glob
// selected mix training files with held-out ones, as llm.c keeps `fineweb_train_000001.bin`
// beside `fineweb_val_000000.bin`: a name is marked by a part of it, split at '_', '-' and
// '.' and compared ignoring case, that is `train`/`training`, or `val`/`valid`/`validation`/
// `test`. The message names the first of each (as `dir`/name) and a glob selecting the
// training files only. nullopt when the names do not mix.
std::optional<DatasetNotice> MixedSplitNotice(const std::string& dir,
                                              const std::vector<std::string>& names);

// "N files, fnv1a64 H, mtimes fnv1a64 M" of `count` shards: H of each shard's name (its last
// component) and size, in order, M of their modification times. A shard added, removed,
// renamed, reordered, resized or rewritten changes it, so a saved position does not resume
// another set; a file beside the shards that is none changes nothing. Positions saved before
// the mtimes part existed hold "N files, fnv1a64 H" (CompareFingerprints takes them).
inline constexpr absl::string_view kShardTimesPart = ", mtimes fnv1a64 ";
std::string ShardsIdentity(size_t count, absl::FunctionRef<const std::string&(size_t)> name,
                           absl::FunctionRef<const RandomAccessFile&(size_t)> file);

// Dataset::CheckReadNotShrunk for a dataset of `count` shards: each shard the rows `ids` read
// (`shard_of(id)`) checked once, or every shard for no ids. Read leases (common/os/
// file_lease.h) make a shard's check one atomic load: where every shard holds one and the
// shards are not many more than the rows, asking every shard is cheaper than finding,
// sorting and checking the ones read.
absl::Status CheckShardsNotShrunk(size_t count, std::span<const int64_t> ids,
                                  absl::FunctionRef<const RandomAccessFile&(size_t)> file,
                                  absl::FunctionRef<size_t(int64_t)> shard_of);

}  // namespace gpufeed::server
