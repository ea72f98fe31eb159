#include "server/reader/file_datasets.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/os/fd.h"
#include "common/status.h"
#include "server/reader/dataset.h"
#include "server/reader/npy.h"

namespace gpufeed::server {
namespace {

// One .npy array of a records dataset: where its rows start and how long each is.
struct RecordArray {
  std::unique_ptr<RandomAccessFile> file;
  std::string file_name;  // its name in the directory (several arrays); "" for one file
  uint64_t data_offset = 0;
  uint64_t row_bytes = 0;
  uint64_t rows = 0;
};

// Row i of one C-order .npy array (tensor `data`), or row i of every array of several, each
// its own tensor in the order given.
class RecordsDataset final : public Dataset {
 public:
  RecordsDataset(std::vector<RecordArray> arrays, std::vector<SampleTensor> tensors)
      : arrays_(std::move(arrays)),
        num_samples_(arrays_.front().rows),
        tensors_(std::move(tensors)) {}

  uint64_t num_samples() const override { return num_samples_; }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }

  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override {
    for (size_t t = 0; t < arrays_.size(); ++t) {
      const RecordArray& a = arrays_[t];
      GPUFEED_RETURN_IF_ERROR(a.file->ReadAt(a.data_offset + id * a.row_bytes, rows[t]));
    }
    return absl::OkStatus();
  }
  absl::Status CheckNotShrunk() const override {
    for (const RecordArray& a : arrays_) GPUFEED_RETURN_IF_ERROR(a.file->CheckNotShrunk());
    return absl::OkStatus();
  }
  // Several arrays: each one's name, file, size and modification time, so a position saved
  // with one set of files (or one file since rewritten) does not resume another. One file:
  // the path's own size and time say it (Feed::Create).
  std::string ContentIdentity() const override {
    if (arrays_.front().file_name.empty()) {
      // An object store's object: its size and version (ETag) say it (no path to stat).
      const RandomAccessFile& f = *arrays_.front().file;
      return f.version().empty() ? "" : absl::StrCat(f.size(), " bytes:etag ", f.version());
    }
    std::vector<std::string> parts;
    for (size_t t = 0; t < arrays_.size(); ++t) {
      const RecordArray& a = arrays_[t];
      parts.push_back(absl::StrCat(RecordArraysText({{tensors_[t].name, a.file_name}}), ":",
                                   a.file->size(), " bytes:mtime_ns ", a.file->modified_ns()));
    }
    return absl::StrJoin(parts, ",");
  }

 private:
  const std::vector<RecordArray> arrays_;
  const uint64_t num_samples_;
  const std::vector<SampleTensor> tensors_;
};

// A .npy array's header, checked: C order, a fixed-size numeric dtype, rows of at most
// 1 TiB, some data, and a file long enough for its shape. `field` and `name` word the errors.
absl::StatusOr<std::pair<RecordArray, SampleTensor>> ProbeRecordArray(
    std::unique_ptr<RandomAccessFile> file, const std::string& field, const std::string& name) {
  std::string prefix(std::min<uint64_t>(file->size(), kNpyMaxHeaderBytes), '\0');
  GPUFEED_RETURN_IF_ERROR(file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(prefix.data()), prefix.size())));
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(prefix);
  if (!header.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", name, ": ", header.status().message()));
  }
  // Row bytes = itemsize x product of the trailing dimensions, overflow-checked.
  __uint128_t row = DTypeSize(header->dtype);
  for (size_t i = 1; i < header->shape.size(); ++i) {
    row *= static_cast<uint64_t>(header->shape[i]);
    if (row > (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", name, ": rows larger than 1 TiB"));
    }
  }
  const uint64_t rows = static_cast<uint64_t>(header->shape[0]);
  if (rows == 0 || row == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", name, ": array of shape (",
                                                   absl::StrJoin(header->shape, ", "),
                                                   ") has no data"));
  }
  const __uint128_t need = header->data_offset + static_cast<__uint128_t>(rows) * row;
  if (need > file->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", name, " is truncated: shape (", absl::StrJoin(header->shape, ", "), ") needs ",
        static_cast<uint64_t>(need), " bytes, the file has ", file->size()));
  }
  RecordArray array;
  array.file = std::move(file);
  array.data_offset = header->data_offset;
  array.row_bytes = static_cast<uint64_t>(row);
  array.rows = rows;
  SampleTensor tensor{"data", header->dtype,
                      std::vector<int64_t>(header->shape.begin() + 1, header->shape.end()),
                      array.row_bytes};
  return std::make_pair(std::move(array), std::move(tensor));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> OpenRecords(const FileDatasetSpec& spec,
                                                     std::unique_ptr<RandomAccessFile> file) {
  GPUFEED_ASSIGN_OR_RETURN(auto probed,
                           ProbeRecordArray(std::move(file), "dataset.path", spec.path));
  std::vector<RecordArray> arrays;
  arrays.push_back(std::move(probed.first));
  return std::make_unique<RecordsDataset>(std::move(arrays),
                                          std::vector<SampleTensor>{std::move(probed.second)});
}

// The arrays of spec.arrays, each a file directly in the directory `spec.path` (the
// descriptor the client passed, or, for an admin's attach by path, opened here), opened
// beneath it where `reader`'s mode bits allow; every array of the first one's row count.
absl::StatusOr<std::unique_ptr<Dataset>> OpenRecordArrays(const FileDatasetSpec& spec,
                                                          FileSystem* fs, const PeerCred* reader) {
  GPUFEED_RETURN_IF_ERROR(ValidateRecordArrays(spec.arrays));
  UniqueFd own;
  int dirfd = spec.fd;
  if (dirfd < 0) {
    GPUFEED_ASSIGN_OR_RETURN(own, OpenChecked(spec.path, FileKind::kDirectory));
    dirfd = own.get();
  } else {
    GPUFEED_RETURN_IF_ERROR(CheckFileKind(dirfd, FileKind::kDirectory, spec.path).status());
  }
  std::vector<RecordArray> arrays;
  std::vector<SampleTensor> tensors;
  for (size_t i = 0; i < spec.arrays.size(); ++i) {
    const RecordArraySpec& a = spec.arrays[i];
    const std::string display = absl::StrCat(spec.path, "/", a.file);
    const std::string field = absl::StrCat("dataset.arrays[", i, "] (", a.name, ")");
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
        fs->OpenForReadBeneath(dirfd, a.file, display, reader);
    if (!file.ok()) return Annotate(file.status(), field);
    GPUFEED_ASSIGN_OR_RETURN(auto probed, ProbeRecordArray(std::move(*file), field, display));
    probed.first.file_name = a.file;
    probed.second.name = a.name;
    if (!arrays.empty() && probed.first.rows != arrays.front().rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.arrays: ", spec.path, "/", spec.arrays.front().file, " (",
                       spec.arrays.front().name, ") has ", arrays.front().rows, " rows but ",
                       display, " (", a.name, ") has ", probed.first.rows,
                       ": every array must hold one row per sample (equal first dimensions)"));
    }
    arrays.push_back(std::move(probed.first));
    tensors.push_back(std::move(probed.second));
  }
  return std::make_unique<RecordsDataset>(std::move(arrays), std::move(tensors));
}

std::string RecordArraysText(const std::vector<RecordArraySpec>& arrays) {
  std::string out;
  for (const RecordArraySpec& a : arrays) {
    absl::StrAppend(&out, out.empty() ? "" : ",", a.name, ":");
    for (char c : a.file) {
      if (c == '%') {
        out += "%25";
      } else if (c == ',') {
        out += "%2C";
      } else {
        out += c;
      }
    }
  }
  return out;
}

absl::Status ValidateRecordArrays(const std::vector<RecordArraySpec>& arrays) {
  if (arrays.size() > kMaxRecordArrays) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.arrays: ", arrays.size(), " arrays, at most ", kMaxRecordArrays));
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    const RecordArraySpec& a = arrays[i];
    const std::string at = absl::StrCat("dataset.arrays[", i, "]");
    const bool identifier = !a.name.empty() && a.name.size() <= kMaxArrayNameBytes &&
                            !absl::ascii_isdigit(a.name[0]) &&
                            std::all_of(a.name.begin(), a.name.end(),
                                        [](char c) { return absl::ascii_isalnum(c) || c == '_'; });
    if (!identifier) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".name: '", absl::CHexEscape(a.name.substr(0, kMaxArrayNameBytes)),
          a.name.size() > kMaxArrayNameBytes ? "...'" : "'", " is not a tensor name: 1-",
          kMaxArrayNameBytes, " characters of [A-Za-z0-9_], not starting with a digit"));
    }
    if (a.file.empty() || a.file.size() > kMaxArrayFileBytes || a.file == "." || a.file == ".." ||
        a.file.find_first_of(std::string("/\0", 2)) != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".file (", a.name, "): '", absl::CHexEscape(a.file.substr(0, kMaxArrayFileBytes)),
          "' is not a file name: 1-", kMaxArrayFileBytes,
          " bytes, no '/', not '.' or '..' (a file directly in dataset.path)"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (arrays[j].name == a.name) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".name: '", a.name,
                                                       "' names dataset.arrays[", j,
                                                       "] too; every tensor needs its own name"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace gpufeed::server
