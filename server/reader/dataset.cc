#include "server/reader/dataset.h"

#include "absl/strings/match.h"
#include "common/shard_list.h"
#include "common/status.h"
#include "server/reader/file_datasets.h"
#include "server/reader/object_shards.h"
#include "server/reader/shards.h"

namespace gpufeed::server {

// Records of several arrays, tokens of shards (a list, a directory, a glob, a Megatron pair)
// or of one file, records of one file: the kind and the spec's form pick the opener.
absl::StatusOr<std::unique_ptr<Dataset>> OpenFileDataset(const FileDatasetSpec& spec,
                                                         FileSystem* fs, const PeerCred* reader) {
  if (spec.objects != nullptr && !spec.arrays.empty()) {
    return absl::InvalidArgumentError(
        "dataset.arrays: not for an s3:// dataset (records from an object store are one .npy)");
  }
  if (!spec.arrays.empty()) {
    if (spec.kind != DatasetKind::kRecords) {
      return absl::InvalidArgumentError(
          "dataset.arrays: only for kind records (several .npy arrays, one tensor each)");
    }
    return OpenRecordArrays(spec, fs, reader);
  }
  GPUFEED_RETURN_IF_ERROR(ValidateShardPaths(spec));
  if (spec.objects != nullptr) {  // s3:// (docs/howto/object-storage.md)
    if (!spec.paths.empty()) {
      return absl::InvalidArgumentError(
          "dataset.paths: not for an s3:// dataset (name a directory, a glob or one object)");
    }
    if (spec.kind == DatasetKind::kTokens) {
      GPUFEED_RETURN_IF_ERROR(CheckTokenSpec(spec));
      return OpenTokenObjects(spec);
    }
    GPUFEED_ASSIGN_OR_RETURN(const ObjectSelection one,
                             SelectObjects(spec, *spec.objects, nullptr, /*braces=*/false));
    if (!one.one_object) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", spec.path, ": records from an object store are one .npy object"));
    }
    GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             OpenSelected(one, *spec.objects, one.names.front()));
    return OpenRecords(spec, std::move(file));
  }
  if (spec.kind == DatasetKind::kTokens) {
    GPUFEED_RETURN_IF_ERROR(CheckTokenSpec(spec));
    if (!spec.paths.empty()) return OpenTokenList(spec, fs, reader);
    // A Megatron X.bin named alone, read with its X.idx: its directory (the descriptor the
    // client passed is that directory when it saw the .idx).
    GPUFEED_ASSIGN_OR_RETURN(std::optional<ShardDir> dir, FindPairedFile(spec, ".bin", ".idx"));
    // The same for a token file with its document offsets (S.offsets.npy) beside it.
    if (!dir.has_value() && !absl::EndsWith(spec.path, kOffsetsSuffix)) {
      const absl::string_view base = absl::string_view(spec.path).substr(spec.path.rfind('/') + 1);
      const size_t dot = base.rfind('.');
      const absl::string_view ext = dot == absl::string_view::npos || dot == 0 ? "" : base.substr(dot);
      GPUFEED_ASSIGN_OR_RETURN(dir, FindPairedFile(spec, ext, kOffsetsSuffix));
    }
    // A directory of shards, or a glob in the last component (its directory's files that
    // match; only where no file of that name exists): the descriptor the client passed is
    // that directory. A passed directory is the pattern's when its own name is not the
    // path's last component (the client opened the parent).
    if (!dir.has_value()) {
      GPUFEED_ASSIGN_OR_RETURN(dir, FindShardDir(spec, HasGlob));
    }
    if (dir.has_value()) return OpenTokenShards(spec, fs, *dir, reader);
  }
  GPUFEED_ASSIGN_OR_RETURN(
      std::unique_ptr<RandomAccessFile> file,
      spec.fd >= 0 ? fs->OpenFromFd(spec.fd, spec.path) : fs->OpenForRead(spec.path));
  if (spec.kind == DatasetKind::kTokens) return OpenTokenFile(spec, std::move(file));
  return OpenRecords(spec, std::move(file));
}

}  // namespace gpufeed::server
