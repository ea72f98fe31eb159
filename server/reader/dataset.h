// Datasets: a source of fixed-size samples read with pread straight into staging memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/os/file.h"
#include "common/os/peer_cred.h"
#include "server/reader/image_folder.h"

namespace gpufeed::objstore {
class ObjectSource;  // server/objstore/object_store.h
}  // namespace gpufeed::objstore

namespace gpufeed::server {

enum class DatasetKind {
  kUnspecified = 0,
  kTokens = 1,
  kRecords = 2,
  kImageFolder = 3,
  kWebDataset = 4,
};

// The kinds whose samples are images through a pipeline (`image` and `label` tensors).
inline bool IsImageKind(DatasetKind kind) {
  return kind == DatasetKind::kImageFolder || kind == DatasetKind::kWebDataset;
}

// One array of a records dataset of several (DatasetSpec.arrays in the proto): the tensor's
// name and its .npy file, a name directly in the dataset's directory.
struct RecordArraySpec {
  std::string name;
  std::string file;
};

// Bounds on a request's arrays (the socket is a trust boundary).
inline constexpr size_t kMaxRecordArrays = 32;
inline constexpr size_t kMaxArrayNameBytes = 64;
inline constexpr size_t kMaxArrayFileBytes = 255;  // NAME_MAX

// INVALID_ARGUMENT naming the entry ("dataset.arrays[1].name: ...") unless there are at most
// kMaxRecordArrays, every name is 1-64 characters of [A-Za-z0-9_] not starting with a digit
// and unique, and every file is 1-255 bytes, one path component (no '/', no NUL, not "." or
// "..").
absl::Status ValidateRecordArrays(const std::vector<RecordArraySpec>& arrays);

// "name:file,..." in order, a file's '%' and ',' %-escaped so that no two lists give one
// text (the feed's key; the fingerprint's `files` item names arrays so too).
std::string RecordArraysText(const std::vector<RecordArraySpec>& arrays);

// What a reader needs to open a file dataset (tokens, records). The feed's full spec, with an
// image dataset's pipeline, is DatasetSpec (images/dataset.h), which extends this.
struct FileDatasetSpec {
  DatasetKind kind = DatasetKind::kUnspecified;
  std::string path;
  DType token_dtype = DType::kUnspecified;  // tokens: unset = the .npy header's, or uint16
  int64_t seq_len = 0;                      // tokens
  uint64_t vocab_size = 0;                  // tokens: checked on a sample at open; 0 = not
  // records: several arrays in the directory `path`, in this order; empty: `path` is one
  // .npy file (tensor `data`).
  std::vector<RecordArraySpec> arrays;
  // tokens, webdataset: an explicit list of shard files, read in this order, each an
  // absolute path beneath the directory `path` (the descriptor passed); empty: `path` names
  // the dataset (DatasetSpec.paths in the proto; ValidateShardPaths in shards.h).
  std::vector<std::string> paths;
  // The request's DatasetSpec.handle: a descriptor the caller opened, passed on the memory
  // socket (docs/SECURITY.md section 2). Not part of the feed's key or fingerprint.
  std::string handle;
  // Set by the feed registry from the handle, never from a request: the descriptor to read
  // through (borrowed for the open; readers keep a dup); -1: open `path` with the daemon's
  // rights (an admin's attach by path). `path` is then the display name only.
  int fd = -1;
  // Set by a feed that packs documents (feed/lm_dataset.h), never from a request: keep a
  // Megatron .idx's sequence sizes (TokenShard::sequences), the documents it packs, and
  // take shards of fewer than seq_len + 1 tokens (a row packs documents of several).
  bool for_packing = false;
  // Set by the feed registry from the handle, never from a request: for an s3:// path, the
  // objects as the caller's own access reads them (docs/howto/object-storage.md); null for
  // files.
  std::shared_ptr<const objstore::ObjectSource> objects;
  // Set by the feed registry, never from a request: the bounds of every attach-time scan
  // (an image folder's walk, a tar's index, a Megatron .idx's sizes) and of the index kept.
  FolderWalkLimits walk;
};

// What a sample's random augmentation depends on, besides its id.
struct SampleContext {
  uint64_t seed = 0;
  int64_t epoch = 0;
};

// One tensor of a sample: its element type and per-sample shape (no batch dimension).
struct SampleTensor {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  uint64_t byte_size = 0;  // per sample
};

// One thing a client is told at Attach about its dataset (Dataset::notices).
struct DatasetNotice {
  // A sample-level reason ("no_image": a WebDataset key without an image) for samples left
  // out at open, or "warning" for a dataset-level caution (`count` 0).
  std::string reason;
  int64_t count = 0;
  std::string example;  // the first such sample (or file), as messages name it
  std::string message;  // one line a user reads: what, how many, and what to do
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual uint64_t num_samples() const = 0;
  virtual const std::vector<SampleTensor>& tensors() const = 0;
  // Writes sample `id` (< num_samples) into rows[t] for each tensor t; rows[t] has exactly
  // tensors()[t].byte_size bytes. One copy from the page cache, no more. Thread-safe.
  virtual absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const = 0;
  // As ReadSample, for the sample's augmentation as of `context`; returns the id actually
  // written: a dataset whose policy skips bad samples writes a replacement instead.
  virtual absl::StatusOr<uint64_t> ReadSampleAt(uint64_t id, const SampleContext& context,
                                                std::span<const std::span<std::byte>> rows) const {
    absl::Status s = ReadSample(id, rows);
    if (!s.ok()) return s;
    return id;
  }
  // DATA_LOSS when the files read shrank since they were opened; called after each batch.
  virtual absl::Status CheckNotShrunk() const = 0;
  // As CheckNotShrunk, for a batch of the samples `ids` (every id < num_samples): a dataset
  // of many files checks only those the batch read.
  virtual absl::Status CheckReadNotShrunk(std::span<const int64_t> ids) const {
    (void)ids;
    return CheckNotShrunk();
  }
  // For the feed's fingerprint, what the path alone does not say (a sharded dataset: its
  // files, order, sizes and mtimes; several arrays: each file's); "" when the path and its
  // size do.
  virtual std::string ContentIdentity() const { return ""; }
  // Read hints (RandomAccessFile::WillRead): sample `id` will be read at `next_use`, passed to
  // the files it reads; and whether they take hints at all (the feed works out its hints only
  // then: an object store's files behind the node's cache). Default: none.
  virtual bool takes_read_hints() const { return false; }
  virtual void WillRead(uint64_t id, uint64_t next_use) const {}
  // Samples that could not be used, by reason ("truncated", ...), since the dataset opened.
  virtual std::vector<std::pair<std::string, int64_t>> bad_samples() const { return {}; }
  // What the attaching client must hear about the dataset as opened (nothing is skipped or
  // guessed silently): samples left out at open, and warnings. Fixed once the
  // dataset is open.
  virtual std::vector<DatasetNotice> notices() const { return {}; }
};

// Opens and validates a tokens or records file (records: or, with `arrays`, the arrays of
// the directory `path`, opened beneath it where `reader`'s mode bits allow, every one of the
// same row count): NOT_FOUND / PERMISSION_DENIED naming the
// path, and INVALID_ARGUMENT naming the field ("dataset.seq_len: ...") for what cannot be
// served. Tokens may also be sharded: `path` a directory (its regular files, sorted by name)
// or a glob in its last component (`/data/train_*.bin`), each shard raw, .npy, llm.c or a
// Megatron .bin with its .idx; or an explicit list (`paths`), in its order; the shard files
// are opened beneath the directory where the mode bits let `reader` read them (null: no such
// check). Every kind, images included:
// OpenDataset (images/dataset.h).
absl::StatusOr<std::unique_ptr<Dataset>> OpenFileDataset(const FileDatasetSpec& spec,
                                                         FileSystem* fs,
                                                         const PeerCred* reader = nullptr);

}  // namespace gpufeed::server
