#include <fnmatch.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/shard_list.h"
#include "common/status.h"
#include "server/reader/dataset.h"
#include "server/reader/file_datasets.h"
#include "server/reader/le_bytes.h"
#include "server/reader/object_shards.h"
#include "server/reader/shards.h"
#include "server/reader/token_formats.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// The windows of seq_len + 1 tokens a shard of `tokens` holds (below).
uint64_t WindowsOf(uint64_t tokens, uint64_t seq_len) {
  return tokens > seq_len ? (tokens - 1) / seq_len : 0;
}

// Sample i of a shard is the window of seq_len + 1 tokens starting at token i * seq_len, so
// that the last token of one sample is the first of the next (inputs and shifted targets in
// one row). Windows never cross shards; the dataset's samples are the shards' windows in
// shard order (sorted by name), so one global permutation covers them all.
class TokensDataset final : public Dataset, public TokenShardsView {
 public:
  TokensDataset(std::vector<TokenShard> shards, int64_t seq_len, bool sharded,
                std::vector<DatasetNotice> notices)
      : sharded_(sharded),
        shards_(std::move(shards)),
        notices_(std::move(notices)),
        token_bytes_(DTypeSize(shards_.front().dtype)),
        seq_len_(static_cast<uint64_t>(seq_len)) {
    for (const TokenShard& s : shards_) {
      first_.push_back(num_samples_);
      num_samples_ += WindowsOf(s.tokens, seq_len_);
    }
    const uint64_t width = seq_len_ + 1;
    tensors_.push_back(
        {"tokens", shards_.front().dtype, {static_cast<int64_t>(width)}, width * token_bytes_});
  }

  uint64_t num_samples() const override { return num_samples_; }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }

  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override {
    const size_t k = ShardOf(id);
    const TokenShard& s = shards_[k];
    return s.file->ReadAt(s.data_offset + (id - first_[k]) * seq_len_ * token_bytes_, rows[0]);
  }
  absl::Status CheckNotShrunk() const override {
    for (const TokenShard& s : shards_) GPUFEED_RETURN_IF_ERROR(s.file->CheckNotShrunk());
    return absl::OkStatus();
  }
  bool takes_read_hints() const override { return shards_.front().file->takes_read_hints(); }
  void WillRead(uint64_t id, uint64_t next_use) const override {
    if (id >= num_samples_) return;
    const size_t k = ShardOf(id);
    const TokenShard& s = shards_[k];
    s.file->WillRead(s.data_offset + (id - first_[k]) * seq_len_ * token_bytes_,
                     (seq_len_ + 1) * token_bytes_, next_use);
  }
  // The shards the batch read, each once: at most the batch size of checks, whatever the
  // shard count.
  absl::Status CheckReadNotShrunk(std::span<const int64_t> ids) const override {
    if (shards_.size() == 1) return shards_.front().file->CheckNotShrunk();
    return CheckShardsNotShrunk(
        shards_.size(), ids,
        [this](size_t k) -> const RandomAccessFile& { return *shards_[k].file; },
        [this](int64_t id) { return ShardOf(static_cast<uint64_t>(id)); });
  }
  // Which files, in which order, of which sizes and times (ShardsIdentity; an explicit
  // list's full names are the feed's, FeedSpec::Canonical).
  std::string ContentIdentity() const override {
    if (!sharded_) return "";
    return ShardsIdentity(
        shards_.size(), [this](size_t k) -> const std::string& { return shards_[k].name; },
        [this](size_t k) -> const RandomAccessFile& { return *shards_[k].file; });
  }
  std::vector<DatasetNotice> notices() const override { return notices_; }
  const std::vector<TokenShard>& shards() const override { return shards_; }

 private:
  // The last shard whose first sample is <= id (a shard of no windows shares its first with
  // the next, and upper_bound steps past it).
  size_t ShardOf(uint64_t id) const {
    return static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), id) -
                               first_.begin()) -
           1;
  }

  const bool sharded_;  // a directory or pattern, not one file
  const std::vector<TokenShard> shards_;
  const std::vector<DatasetNotice> notices_;
  std::vector<uint64_t> first_;  // per shard, its first sample's id
  const uint64_t token_bytes_;
  const uint64_t seq_len_;
  uint64_t num_samples_ = 0;
  std::vector<SampleTensor> tensors_;
};

// With a declared vocab_size: every token of a sample of the file (64 spans of 4 KiB spread
// over it, the first and the last included) must be below it. A uint16 file read as uint32,
// or float data read as tokens, shows values far beyond any vocabulary.
absl::Status CheckVocabulary(const FileDatasetSpec& spec, const RandomAccessFile& file,
                             uint64_t data_offset, DType dtype, uint64_t tokens) {
  if (spec.vocab_size == 0) return absl::OkStatus();
  const uint64_t token_bytes = DTypeSize(dtype);
  constexpr uint64_t kSpans = 64, kSpanTokens = 4096 / 4;
  std::vector<std::byte> buffer(kSpanTokens * token_bytes);
  for (uint64_t k = 0; k < kSpans; ++k) {
    const uint64_t span = std::min(kSpanTokens, tokens);
    const uint64_t first = (tokens - span) * k / (kSpans - 1);
    std::span<std::byte> bytes(buffer.data(), span * token_bytes);
    GPUFEED_RETURN_IF_ERROR(file.ReadAt(data_offset + first * token_bytes, bytes));
    for (uint64_t i = 0; i < span; ++i) {
      const uint64_t v = TokenAt(bytes.data(), i, token_bytes);
      if (v >= spec.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dataset.vocab_size: ", spec.path, " holds token ", v, " at index ", first + i,
            ", not below vocab_size ", spec.vocab_size, " (read as ", DTypeName(dtype),
            "): is token_dtype right? A uint16 file read as uint32, or float data, looks so"));
      }
    }
  }
  return absl::OkStatus();
}

// The shards, probed: every one the same token type; at least one window in all; the
// vocabulary checked on up to 8 of them, spread over the list.
absl::StatusOr<std::unique_ptr<Dataset>> MakeTokens(const FileDatasetSpec& spec,
                                                    std::vector<TokenShard> shards, bool sharded,
                                                    std::vector<DatasetNotice> notices = {}) {
  uint64_t windows = 0, tokens = 0;
  for (const TokenShard& s : shards) {
    if (s.dtype != shards.front().dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", shards.front().name, " holds ", DTypeName(shards.front().dtype),
          " tokens (", shards.front().format, ") but ", s.name, " holds ", DTypeName(s.dtype), " (",
          s.format, "): every shard must hold one token type"));
    }
    windows += WindowsOf(s.tokens, static_cast<uint64_t>(spec.seq_len));
    tokens += s.tokens;
  }
  if (windows == 0 && !spec.for_packing) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.seq_len: ", spec.seq_len, " needs at least ",
        static_cast<uint64_t>(spec.seq_len) + 1, " tokens", sharded ? " in one shard" : "",
        ", but ", sharded ? spec.path : shards.front().name, " holds ", tokens,
        sharded ? absl::StrCat(" in ", shards.size(), " shards") : ""));
  }
  const size_t checks = std::min<size_t>(shards.size(), 8);
  for (size_t i = 0; i < checks; ++i) {
    const TokenShard& s = shards[checks == 1 ? 0 : i * (shards.size() - 1) / (checks - 1)];
    if (s.tokens > 0) {
      GPUFEED_RETURN_IF_ERROR(CheckVocabulary(spec, *s.file, s.data_offset, s.dtype, s.tokens));
    }
  }
  return std::make_unique<TokensDataset>(std::move(shards), spec.seq_len, sharded,
                                         std::move(notices));
}

// "dataset.path: ..." said of entry `field` of a list: "dataset.paths[3]: ...".
absl::Status OfEntry(const absl::Status& status, const std::string& field) {
  if (status.ok()) return status;
  constexpr absl::string_view kPath = "dataset.path: ";
  const absl::string_view m = status.message();
  return absl::Status(status.code(), absl::StartsWith(m, kPath)
                                         ? absl::StrCat(field, ": ", m.substr(kPath.size()))
                                         : absl::StrCat(field, ": ", m));
}

}  // namespace

absl::Status CheckTokenSpec(const FileDatasetSpec& spec) {
  if (spec.token_dtype != DType::kUnspecified && !IsTokenDType(spec.token_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.token_dtype: tokens must be uint16 or uint32, got ",
        DTypeName(spec.token_dtype)));
  }
  if (spec.seq_len == 0) {
    return absl::InvalidArgumentError(
        "dataset.seq_len: required for kind tokens (tokens per sample: each row holds "
        "seq_len + 1 tokens, the inputs and the shifted targets)");
  }
  if (spec.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.seq_len: must be >= 1, got ", spec.seq_len));
  }
  return absl::OkStatus();
}

// The shards of a directory (every regular file in it, not below, whose name does not start
// with '.'), of a glob (`dir.pattern`: the directory's names it matches) or of one name
// (`dir.exact`: a Megatron .bin named alone), sorted by name. A Megatron `X.idx` goes with
// its `X.bin`, found among all the directory's names whatever selected the .bin, and is not a
// shard itself (one a glob selects without its .bin is probed, and refused as an index).
// Opened beneath `dir.fd` where `reader`'s mode bits allow. A directory or glob that mixes
// training and held-out names opens with a warning (MixedSplitNotice).
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenShards(const FileDatasetSpec& spec,
                                                         FileSystem* fs, const ShardDir& dir,
                                                         const PeerCred* reader) {
  const std::string& pattern = dir.pattern;
  const auto selected = [&](const std::string& name) {
    return pattern.empty() ||
           (dir.exact ? name == pattern
                      : ::fnmatch(pattern.c_str(), name.c_str(), FNM_PERIOD) == 0);
  };
  const auto bin_of = [](const std::string& idx) {  // "X.idx" -> "X.bin"
    return absl::StrCat(idx.substr(0, idx.size() - 4), ".bin");
  };
  // Every offsets file is listed too: the shard it goes with may be selected (which one is
  // known only once all the names are).
  GPUFEED_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                           ListShardFiles(dir.fd, dir.dir, [&](const std::string& name) {
                             return selected(name) ||
                                    (absl::EndsWith(name, ".idx") && selected(bin_of(name))) ||
                                    absl::EndsWith(name, kOffsetsSuffix);
                           }));
  std::vector<TokenShard> shards;
  std::vector<std::string> shard_names;
  const WalkBudget walk(spec.walk, spec.path, "indexing");
  const std::string prefix = dir.dir == "/" ? "/" : absl::StrCat(dir.dir, "/");
  for (const std::string& name : names) {
    if (absl::EndsWith(name, ".idx") &&
        (pattern.empty() || std::binary_search(names.begin(), names.end(), bin_of(name)))) {
      continue;
    }
    // An offsets file goes with its shard; one the selection did not name is no concern.
    if (absl::EndsWith(name, kOffsetsSuffix) && (!selected(name) || IsCompanionIn(name, names))) {
      continue;
    }
    const std::string display = absl::StrCat(prefix, name);
    GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs->OpenForReadBeneath(dir.fd, name, display, reader));
    std::unique_ptr<RandomAccessFile> idx_file;
    MegatronIdx idx;
    if (absl::EndsWith(name, ".bin")) {
      const std::string idx_name = absl::StrCat(name.substr(0, name.size() - 4), ".idx");
      if (std::binary_search(names.begin(), names.end(), idx_name)) {
        idx.name = absl::StrCat(prefix, idx_name);
        GPUFEED_ASSIGN_OR_RETURN(idx_file,
                                 fs->OpenForReadBeneath(dir.fd, idx_name, idx.name, reader));
        idx.file = idx_file.get();
      }
    }
    std::unique_ptr<RandomAccessFile> offsets_file;
    DocumentOffsets offsets;
    if (const std::string o = OffsetsFileOf(name);
        spec.for_packing && std::binary_search(names.begin(), names.end(), o)) {
      offsets.name = absl::StrCat(prefix, o);
      GPUFEED_ASSIGN_OR_RETURN(offsets_file,
                               fs->OpenForReadBeneath(dir.fd, o, offsets.name, reader));
      offsets.file = offsets_file.get();
    }
    GPUFEED_ASSIGN_OR_RETURN(TokenShard shard,
                             ProbeTokenShard(spec, std::move(file), display, idx, walk,
                                             dir.exact ? "" : dir.dir, offsets));
    shards.push_back(std::move(shard));
    shard_names.push_back(name);
  }
  if (shards.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", spec.path, dir.exact ? ": no such file" : ": no token files",
                     dir.exact         ? ""
                     : pattern.empty() ? " in the directory"
                                       : " match the pattern"));
  }
  std::vector<DatasetNotice> notices;
  if (!dir.exact) {
    if (std::optional<DatasetNotice> mixed = MixedSplitNotice(dir.dir, shard_names)) {
      spdlog::warn("{}", EscapeForLog(mixed->message));
      notices.push_back(std::move(*mixed));
    }
  }
  return MakeTokens(spec, std::move(shards), /*sharded=*/true, std::move(notices));
}

// The shards of an explicit list (spec.paths), in its order, each opened beneath the
// directory passed where `reader`'s mode bits allow. A listed Megatron `X.bin` is read with
// the `X.idx` beside it, listed or not (a listed one is then no shard itself); an `X.idx`
// listed without its `.bin` is probed, and refused as an index. Two names of one file are
// refused, as a name twice is (ValidateShardPaths).
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenList(const FileDatasetSpec& spec, FileSystem* fs,
                                                       const PeerCred* reader) {
  GPUFEED_ASSIGN_OR_RETURN(const ShardList list, OpenShardList(spec));
  const absl::flat_hash_set<std::string> listed(list.relative.begin(), list.relative.end());
  std::vector<std::string> sorted_listed = list.relative;
  std::sort(sorted_listed.begin(), sorted_listed.end());
  std::vector<TokenShard> shards;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, size_t> seen;
  const WalkBudget walk(spec.walk, spec.path, "indexing");
  for (size_t i = 0; i < list.relative.size(); ++i) {
    const std::string& name = list.relative[i];
    const std::string& display = spec.paths[i];
    const std::string field = absl::StrCat("dataset.paths[", i, "]");
    const std::string stem = name.substr(0, name.size() - 4);
    if (absl::EndsWith(name, ".idx") && listed.contains(absl::StrCat(stem, ".bin"))) continue;
    if (IsCompanionIn(name, sorted_listed)) continue;  // an offsets file of a listed shard
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
        fs->OpenForReadBeneath(list.dir.fd, name, display, reader);
    if (!file.ok()) return OfEntry(file.status(), field);
    if (const auto id = (*file)->identity(); id.has_value()) {
      const auto [it, fresh] = seen.emplace(*id, i);
      if (!fresh) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": ", display, " is the same file as dataset.paths[", it->second,
                         "] (", spec.paths[it->second], "): each file may appear once"));
      }
    }
    std::unique_ptr<RandomAccessFile> idx_file;
    MegatronIdx idx;
    if (absl::EndsWith(name, ".bin")) {
      const std::string idx_name = absl::StrCat(stem, ".idx");
      idx.name = absl::StrCat(display.substr(0, display.size() - 4), ".idx");
      absl::StatusOr<std::unique_ptr<RandomAccessFile>> opened =
          fs->OpenForReadBeneath(list.dir.fd, idx_name, idx.name, reader);
      if (opened.ok()) {
        idx_file = std::move(*opened);
        idx.file = idx_file.get();
      } else if (!absl::IsNotFound(opened.status())) {
        return OfEntry(opened.status(), field);
      }
    }
    // Its offsets file beside it, listed or not, for a packing feed.
    std::unique_ptr<RandomAccessFile> offsets_file;
    DocumentOffsets offsets;
    if (spec.for_packing) {
      offsets.name = OffsetsFileOf(display);
      absl::StatusOr<std::unique_ptr<RandomAccessFile>> opened =
          fs->OpenForReadBeneath(list.dir.fd, OffsetsFileOf(name), offsets.name, reader);
      if (opened.ok()) {
        offsets_file = std::move(*opened);
        offsets.file = offsets_file.get();
      } else if (!absl::IsNotFound(opened.status())) {
        return OfEntry(opened.status(), field);
      }
    }
    absl::StatusOr<TokenShard> shard =
        ProbeTokenShard(spec, std::move(*file), display, idx, walk, "", offsets);
    if (!shard.ok()) return OfEntry(shard.status(), field);
    shards.push_back(std::move(*shard));
  }
  if (shards.empty()) {
    return absl::InvalidArgumentError(
        "dataset.paths: no token files (every entry is the .idx of another)");
  }
  return MakeTokens(spec, std::move(shards), /*sharded=*/true);
}

absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenObjects(const FileDatasetSpec& spec) {
  const objstore::ObjectSource& source = *spec.objects;
  GPUFEED_ASSIGN_OR_RETURN(
      const ObjectSelection selection,
      SelectObjects(
          spec, source, [](const std::string&) { return true; }, /*braces=*/false));
  const std::vector<std::string>& listed = selection.listed;
  // A companion (a Megatron .idx, an offsets file): from the listing, or, for one object named
  // alone, by its own HEAD (not there: none), as a local file named alone finds its own.
  const auto companion =
      [&](const std::string& name) -> absl::StatusOr<std::unique_ptr<RandomAccessFile>> {
    if (!selection.one_object) {
      if (!std::binary_search(listed.begin(), listed.end(), name)) return nullptr;
      return OpenSelected(selection, source, name);
    }
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> f =
        source.Open(selection.bucket, absl::StrCat(selection.dir, name));
    if (absl::IsNotFound(f.status())) return nullptr;
    return f;
  };
  std::vector<TokenShard> shards;
  const WalkBudget walk(spec.walk, spec.path, "indexing");
  for (const std::string& name : selection.names) {
    // A companion goes with its shard (listed: a directory or a glob that selected both).
    if (!listed.empty() && IsCompanionIn(name, listed) && !selection.one_object) continue;
    GPUFEED_RETURN_IF_ERROR(walk.Poll());
    GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             OpenSelected(selection, source, name));
    std::unique_ptr<RandomAccessFile> idx_file, offsets_file;
    MegatronIdx idx;
    DocumentOffsets offsets;
    if (absl::EndsWith(name, ".bin")) {
      const std::string idx_name = absl::StrCat(name.substr(0, name.size() - 4), ".idx");
      GPUFEED_ASSIGN_OR_RETURN(idx_file, companion(idx_name));
      idx.name = selection.display(idx_name);
      idx.file = idx_file.get();
    }
    if (spec.for_packing) {
      const std::string o = OffsetsFileOf(name);
      GPUFEED_ASSIGN_OR_RETURN(offsets_file, companion(o));
      offsets.name = selection.display(o);
      offsets.file = offsets_file.get();
    }
    GPUFEED_ASSIGN_OR_RETURN(
        TokenShard shard,
        ProbeTokenShard(spec, std::move(file), selection.display(name), idx, walk,
                        selection.one_object ? "" : selection.display(""), offsets));
    shards.push_back(std::move(shard));
  }
  if (shards.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", spec.path, ": no token objects (only companions)"));
  }
  // Sharded even for one object: its name, size, time and ETag are the feed's fingerprint
  // (there is no path for Feed::Create to stat).
  return MakeTokens(spec, std::move(shards), /*sharded=*/true);
}

// One file of tokens, not a shard of several: its only shard.
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokenFile(const FileDatasetSpec& spec,
                                                       std::unique_ptr<RandomAccessFile> file) {
  std::vector<TokenShard> one;
  GPUFEED_ASSIGN_OR_RETURN(TokenShard shard,
                           ProbeTokenShard(spec, std::move(file), spec.path, MegatronIdx(),
                                           WalkBudget(spec.walk, spec.path, "indexing")));
  one.push_back(std::move(shard));
  return MakeTokens(spec, std::move(one), /*sharded=*/false);
}

}  // namespace gpufeed::server
