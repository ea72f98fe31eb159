// WebDataset shards (kind webdataset): tar files whose members sharing a key make a sample.
// As WebDataset names them, a member's key is its path up to the first '.' of its last
// component and its extension the rest, lower-cased (`a/b/x01.seg.JPG`: key `a/b/x01`,
// extension `seg.jpg`); members of one key follow each other in the tar. gpufeed takes the
// image from `jpg`, `jpeg` or `png` and the label from `cls` (an ASCII integer, whitespace
// around it ignored) and ignores every other extension.
//
// Unlike WebDataset's shuffle buffer, the shards are indexed when the dataset opens (the
// offset and size of every member, in memory: ~40 bytes a sample plus its member name), so
// the global permutation and exact resume hold as for any dataset: sample ids are the shards
// in name order (byte order), the samples of each in tar order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/file.h"
#include "common/os/peer_cred.h"
#include "server/reader/dataset.h"
#include "server/reader/image_folder.h"

namespace gpufeed::server {

struct WebDatasetShard {
  std::unique_ptr<RandomAccessFile> file;
  std::string name;  // its display path
};

struct WebDatasetSample {
  uint64_t offset = 0;  // the image member's data in its shard
  uint64_t size = 0;
  int64_t label = 0;
  uint64_t name_at = 0;  // the image member's path in WebDatasetIndex::names
  uint32_t name_bytes = 0;
  uint32_t shard = 0;
};

struct WebDatasetIndex {
  std::vector<WebDatasetShard> shards;  // in name order
  std::vector<WebDatasetSample> samples;
  std::string names;          // every image member's path, one after another
  // Keys skipped for want of an image (bad_sample skip), the first as "<shard>:<key>".
  Skipped without_image;
  // Of those, the keys holding a member named as an image after a second dot (img.001.jpg:
  // key `img`, extension `001.jpg`, as WebDataset splits it too), those members, and the
  // first of them: its shard's display path and its member path.
  int64_t dotted_keys = 0;
  int64_t dotted_images = 0;
  std::string first_dotted_shard;
  std::string first_dotted_member;
  // The bytes of `samples` and `names` in max_index_bytes (FolderWalkLimits::index_bytes),
  // returned with the index; null where the walk has no budget.
  std::unique_ptr<ByteBudget::Charge> charge;

  absl::string_view member(uint64_t id) const {
    return absl::string_view(names).substr(samples[id].name_at, samples[id].name_bytes);
  }
  // "<shard path>:<member path>", as messages name a sample.
  std::string display(uint64_t id) const;
};

// Opens and indexes the shards `spec.path` names, beneath the directory the client passed
// (`spec.fd`; docs/SECURITY.md section 2) where `reader`'s mode bits let it read them, or
// with the daemon's rights without a descriptor:
//   - a directory: its `*.tar` files;
//   - a pattern in the last component: a glob (`train-*.tar`), braces (`train-{000..146}.tar`,
//     `{train,extra}-0.tar`: each name must exist, unless it holds a glob itself) or both;
//   - one tar file.
// Errors name the shard, and the member or the header's offset: INVALID_ARGUMENT for a bad
// header, a key with two images or labels, a label that is not an integer, or an image
// without a label (refused whatever the bad-sample policy: a sample's label cannot be
// replaced); DATA_LOSS for a truncated shard. A key with no image (only a .cls, a .json, ...)
// is no sample when `skip_imageless` (the skip policy) and INVALID_ARGUMENT otherwise. Every
// member counts against `walk` (max_folder_entries, folder_walk_timeout, cancel).
absl::StatusOr<WebDatasetIndex> IndexWebDataset(const FileDatasetSpec& spec, FileSystem* fs,
                                                const PeerCred* reader,
                                                const FolderWalkLimits& walk, bool skip_imageless);

// What the attaching client is told (Dataset::notices): the keys without an image, reason
// "no_image", with the first and, where their members' names hold a second dot, how
// WebDataset splits them. None when every key was a sample.
std::vector<DatasetNotice> WebDatasetNotices(const WebDatasetIndex& index);

}  // namespace gpufeed::server
