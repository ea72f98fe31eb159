// The openers of the file datasets' two kinds, for OpenFileDataset (dataset.cc), which picks
// one by the spec's kind and form: tokens (token_dataset.cc) and records (record_dataset.cc).
// Private to server/reader/.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/os/file.h"
#include "common/os/peer_cred.h"
#include "server/reader/dataset.h"
#include "server/reader/shards.h"

namespace gpufeed::server {

// The token fields of a spec (token_dtype, seq_len), before anything is opened.
absl::Status CheckTokenSpec(const FileDatasetSpec& spec);
// The shards of a directory, a glob or a Megatron pair named alone (`dir`).
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenShards(const FileDatasetSpec& spec,
                                                         FileSystem* fs, const ShardDir& dir,
                                                         const PeerCred* reader);
// The shards of an explicit list (spec.paths).
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenList(const FileDatasetSpec& spec, FileSystem* fs,
                                                       const PeerCred* reader);
// The token shards an s3:// path names (spec.objects; reader/object_shards.h), with the
// companions listed beside them (a Megatron X.idx; an S.offsets.npy for a packed feed).
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenObjects(const FileDatasetSpec& spec);
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenFile(const FileDatasetSpec& spec,
                                                       std::unique_ptr<RandomAccessFile> file);

// One .npy array (tensor `data`).
absl::StatusOr<std::unique_ptr<Dataset>> OpenRecords(const FileDatasetSpec& spec,
                                                     std::unique_ptr<RandomAccessFile> file);
// The arrays of spec.arrays, one tensor each.
absl::StatusOr<std::unique_ptr<Dataset>> OpenRecordArrays(const FileDatasetSpec& spec,
                                                          FileSystem* fs, const PeerCred* reader);

}  // namespace gpufeed::server
