// Where an image dataset's samples come from (an ImageFolder's files, a WebDataset's tar
// members). The decoding, augmenting and staging over them is one (image_dataset.cc), so
// every kind of image dataset takes the same CPU, staged-kernel and nvJPEG paths.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/images/dataset.h"

namespace gpufeed::server {

class ImageSource {
 public:
  virtual ~ImageSource() = default;
  virtual uint64_t size() const = 0;
  virtual int64_t label(uint64_t id) const = 0;
  // How messages and logs name sample `id`: a file's path, a shard's path and member.
  virtual std::string name(uint64_t id) const = 0;
  // The sample's encoded bytes. A sample that cannot be read is a bad image (MarkBadImage:
  // unreadable; too_large past `max_bytes`, checked before anything is allocated or read),
  // which the bad-sample policy decides; an error that is not the sample's own (a shard that
  // shrank: DATA_LOSS) ends the fill. Thread-safe.
  virtual absl::StatusOr<std::vector<uint8_t>> Read(uint64_t id, uint64_t max_bytes) const = 0;
  // Dataset::CheckReadNotShrunk for the samples of a batch (all of them for an empty span).
  virtual absl::Status CheckReadNotShrunk(std::span<const int64_t> ids) const {
    (void)ids;
    return absl::OkStatus();
  }
  // Dataset::ContentIdentity.
  virtual std::string ContentIdentity() const { return ""; }
  // Read hints (Dataset::WillRead): image `id` will be read at `next_use`.
  virtual bool takes_read_hints() const { return false; }
  virtual void WillRead(uint64_t id, uint64_t next_use) const {}
  // OK where the dataset's reader may read sample `id` now, the way Read would open it,
  // reading nothing; else Read's error. A sharing group across uids hands a decode made for
  // another uid to a row only then. The default (a source whose files were all opened with
  // the reader's rights when it was indexed, as a webdataset's shards, held open): OK.
  virtual absl::Status CheckReadable(uint64_t id) const {
    (void)id;
    return absl::OkStatus();
  }
  // The sample's name as the dataset itself knows it, the same whoever opened it by whatever
  // display path (an ImageFolder's path beneath its root): a sharing group across uids
  // compares two uids' sample lists by these names. Default: name(id).
  virtual std::string SampleName(uint64_t id) const { return name(id); }
  // Dataset::notices: what the index left out at open.
  virtual std::vector<DatasetNotice> notices() const { return {}; }
};

// The images of `source` through the spec's pipeline and bad-sample policy.
absl::StatusOr<std::unique_ptr<ImageDataset>> MakeImageDataset(std::unique_ptr<ImageSource> source,
                                                               const DatasetSpec& spec);

}  // namespace gpufeed::server
