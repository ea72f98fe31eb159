#include "server/reader/dataset.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "server/reader/npy.h"

namespace gpufeed::server {
namespace {

// Sample i is the window of seq_len + 1 tokens starting at token i * seq_len, so that the
// last token of one sample is the first of the next (inputs and shifted targets in one row).
class TokensDataset final : public Dataset {
 public:
  TokensDataset(std::unique_ptr<RandomAccessFile> file, uint64_t data_offset, DType dtype,
                int64_t seq_len, uint64_t num_samples)
      : file_(std::move(file)),
        data_offset_(data_offset),
        token_bytes_(DTypeSize(dtype)),
        seq_len_(static_cast<uint64_t>(seq_len)),
        num_samples_(num_samples) {
    const uint64_t width = seq_len_ + 1;
    tensors_.push_back({"tokens", dtype, {static_cast<int64_t>(width)}, width * token_bytes_});
  }

  uint64_t num_samples() const override { return num_samples_; }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }

  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override {
    return file_->ReadAt(data_offset_ + id * seq_len_ * token_bytes_, rows[0]);
  }
  absl::Status CheckNotShrunk() const override { return file_->CheckNotShrunk(); }

 private:
  const std::unique_ptr<RandomAccessFile> file_;
  const uint64_t data_offset_;  // after a .npy header; 0 for a raw file
  const uint64_t token_bytes_;
  const uint64_t seq_len_;
  const uint64_t num_samples_;
  std::vector<SampleTensor> tensors_;
};

// Row i of a C-order .npy array.
class RecordsDataset final : public Dataset {
 public:
  RecordsDataset(std::unique_ptr<RandomAccessFile> file, const NpyHeader& header,
                 uint64_t row_bytes)
      : file_(std::move(file)),
        data_offset_(header.data_offset),
        row_bytes_(row_bytes),
        num_samples_(static_cast<uint64_t>(header.shape[0])) {
    tensors_.push_back({"data", header.dtype,
                        std::vector<int64_t>(header.shape.begin() + 1, header.shape.end()),
                        row_bytes});
  }

  uint64_t num_samples() const override { return num_samples_; }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }

  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override {
    return file_->ReadAt(data_offset_ + id * row_bytes_, rows[0]);
  }
  absl::Status CheckNotShrunk() const override { return file_->CheckNotShrunk(); }

 private:
  const std::unique_ptr<RandomAccessFile> file_;
  const uint64_t data_offset_;
  const uint64_t row_bytes_;
  const uint64_t num_samples_;
  std::vector<SampleTensor> tensors_;
};

bool IsTokenDType(DType t) { return t == DType::kUInt16 || t == DType::kUInt32; }

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
      uint64_t v = 0;
      if (dtype == DType::kUInt16) {
        uint16_t t;
        std::memcpy(&t, bytes.data() + i * 2, 2);
        v = t;
      } else {
        uint32_t t;
        std::memcpy(&t, bytes.data() + i * 4, 4);
        v = t;
      }
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

// A raw file of uint16/uint32 tokens (token_dtype given, uint16 when unset), or a .npy file
// written by np.save, read through its header: its dtype is the token type, and a token_dtype
// that contradicts it is refused.
absl::StatusOr<std::unique_ptr<Dataset>> OpenTokens(const FileDatasetSpec& spec,
                                                    std::unique_ptr<RandomAccessFile> file) {
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
  if (file->size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", spec.path, " is empty"));
  }
  std::string prefix(std::min<uint64_t>(file->size(), kNpyMaxHeaderBytes), '\0');
  GPUFEED_RETURN_IF_ERROR(file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(prefix.data()), prefix.size())));
  DType dtype = spec.token_dtype == DType::kUnspecified ? DType::kUInt16 : spec.token_dtype;
  uint64_t offset = 0, tokens = 0;
  if (absl::StartsWith(prefix, kNpyMagic)) {
    absl::StatusOr<NpyHeader> header = ParseNpyHeader(prefix);
    if (!header.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.path: ", spec.path, ": ", header.status().message()));
    }
    if (!IsTokenDType(header->dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", spec.path, " is a .npy array of ", DTypeName(header->dtype),
          "; tokens must be uint16 or uint32"));
    }
    if (spec.token_dtype != DType::kUnspecified && spec.token_dtype != header->dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.token_dtype: ", DTypeName(spec.token_dtype), ", but ", spec.path,
          " is a .npy array of ", DTypeName(header->dtype),
          " (its header says so); leave token_dtype unset or set it to ",
          DTypeName(header->dtype)));
    }
    dtype = header->dtype;
    __uint128_t count = 1;
    for (int64_t d : header->shape) count *= static_cast<uint64_t>(d);
    const __uint128_t need = header->data_offset + count * DTypeSize(dtype);
    if (need > file->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", spec.path, " is truncated: its .npy header promises ",
          static_cast<uint64_t>(count), " tokens, the file holds ",
          (file->size() - header->data_offset) / DTypeSize(dtype)));
    }
    offset = header->data_offset;
    tokens = static_cast<uint64_t>(count);
  } else {
    const uint64_t token_bytes = DTypeSize(dtype);
    if (file->size() % token_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", spec.path, " holds ", file->size(), " bytes, not a whole number of ",
          DTypeName(dtype), " tokens"));
    }
    tokens = file->size() / token_bytes;
  }
  if (tokens < 2 || (tokens - 1) / static_cast<uint64_t>(spec.seq_len) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.seq_len: ", spec.seq_len, " needs at least ",
        static_cast<uint64_t>(spec.seq_len) + 1, " tokens, but ", spec.path, " holds ", tokens));
  }
  GPUFEED_RETURN_IF_ERROR(CheckVocabulary(spec, *file, offset, dtype, tokens));
  const uint64_t num_samples = (tokens - 1) / static_cast<uint64_t>(spec.seq_len);
  return std::make_unique<TokensDataset>(std::move(file), offset, dtype, spec.seq_len,
                                         num_samples);
}

absl::StatusOr<std::unique_ptr<Dataset>> OpenRecords(const FileDatasetSpec& spec,
                                                     std::unique_ptr<RandomAccessFile> file) {
  std::string prefix(std::min<uint64_t>(file->size(), kNpyMaxHeaderBytes), '\0');
  GPUFEED_RETURN_IF_ERROR(file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(prefix.data()), prefix.size())));
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(prefix);
  if (!header.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", spec.path, ": ", header.status().message()));
  }
  // Row bytes = itemsize x product of the trailing dimensions, overflow-checked.
  __uint128_t row = DTypeSize(header->dtype);
  for (size_t i = 1; i < header->shape.size(); ++i) {
    row *= static_cast<uint64_t>(header->shape[i]);
    if (row > (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.path: ", spec.path, ": rows larger than 1 TiB"));
    }
  }
  const uint64_t rows = static_cast<uint64_t>(header->shape[0]);
  if (rows == 0 || row == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", spec.path, ": array of shape (", absl::StrJoin(header->shape, ", "),
        ") has no data"));
  }
  const __uint128_t need = header->data_offset + static_cast<__uint128_t>(rows) * row;
  if (need > file->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", spec.path, " is truncated: shape (", absl::StrJoin(header->shape, ", "),
        ") needs ", static_cast<uint64_t>(need), " bytes, the file has ", file->size()));
  }
  return std::make_unique<RecordsDataset>(std::move(file), *header, static_cast<uint64_t>(row));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> OpenFileDataset(const FileDatasetSpec& spec,
                                                         FileSystem* fs) {
  GPUFEED_ASSIGN_OR_RETURN(
      std::unique_ptr<RandomAccessFile> file,
      spec.fd >= 0 ? fs->OpenFromFd(spec.fd, spec.path) : fs->OpenForRead(spec.path));
  if (spec.kind == DatasetKind::kTokens) return OpenTokens(spec, std::move(file));
  return OpenRecords(spec, std::move(file));
}

}  // namespace gpufeed::server
