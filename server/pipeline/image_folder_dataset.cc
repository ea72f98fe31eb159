// The image_folder dataset kind: each sample is a file of the folder's index (reader/
// image_folder.h), opened beneath the folder's descriptor.
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "server/decode/image_decoder.h"
#include "server/pipeline/dataset.h"
#include "server/pipeline/image_source.h"
#include "server/reader/image_folder.h"

namespace gpufeed::server {
namespace {

class FolderSource final : public ImageSource {
 public:
  FolderSource(UniqueFd root, ImageFolderIndex index, const DatasetSpec& spec, FileSystem* fs)
      : root_(std::move(root)), reader_(spec.reader), index_(std::move(index)), fs_(fs) {}

  uint64_t size() const override { return index_.paths.size(); }
  int64_t label(uint64_t id) const override { return index_.labels[id]; }
  std::string name(uint64_t id) const override { return index_.paths[id]; }

  // A file that cannot be opened or read (permissions, its mode bits not letting the
  // attaching caller read it, a link out of the folder, an I/O error, removed since the index
  // was built) is a bad sample too, "unreadable", and one larger than max_bytes is
  // "too_large" (never read): the policy decides, as for a corrupt file, rather than one file
  // ending every session of the feed. Opened beneath the root's descriptor only
  // (docs/SECURITY.md section 2).
  absl::StatusOr<std::vector<uint8_t>> Read(uint64_t id, uint64_t max_bytes) const override {
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
        fs_->OpenForReadBeneath(root_.get(), index_.Relative(id), index_.paths[id],
                                reader_.has_value() ? &*reader_ : nullptr);
    if (!file.ok()) return MarkBadImage(file.status(), BadImage::kUnreadable);
    // Checked before any byte is allocated or read: a sparse 16 GiB .jpg must cost nothing.
    if ((*file)->size() > max_bytes) {
      return MarkBadImage(absl::InvalidArgumentError(
                              absl::StrCat("the file holds ", (*file)->size(),
                                           " bytes, more than max_image_bytes (", max_bytes, ")")),
                          BadImage::kTooLarge);
    }
    std::vector<uint8_t> bytes((*file)->size());
    absl::Status read = (*file)->ReadAt(0, std::as_writable_bytes(std::span<uint8_t>(bytes)));
    if (!read.ok()) return MarkBadImage(read, BadImage::kUnreadable);
    return bytes;
  }

 private:
  const UniqueFd root_;                   // the folder's descriptor: every file opens beneath it
  const std::optional<PeerCred> reader_;  // whose mode bits decide what is readable
  const ImageFolderIndex index_;
  FileSystem* const fs_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ImageDataset>> OpenImageFolder(const DatasetSpec& spec,
                                                              FileSystem* fs) {
  // Refused before the walk: a bad pipeline costs no file system work.
  if (absl::StatusOr<PipelinePlan> plan = CompilePipeline(spec.pipeline); !plan.ok()) {
    return plan.status();
  }
  // The caller's descriptor (a dup: the dataset keeps it), else the path with the daemon's
  // rights; a directory either way, checked before anything is read.
  absl::StatusOr<UniqueFd> root = spec.fd >= 0 ? DupFd(spec.fd)
                                               : OpenChecked(spec.path, FileKind::kDirectory);
  if (!root.ok()) return root.status();
  if (absl::Status s = CheckFileKind(root->get(), FileKind::kDirectory, spec.path).status();
      !s.ok()) {
    return s;
  }
  absl::StatusOr<ImageFolderIndex> index = IndexImageFolder(
      root->get(), spec.path, spec.walk, spec.reader.has_value() ? &*spec.reader : nullptr);
  if (!index.ok()) return index.status();
  return MakeImageDataset(
      std::make_unique<FolderSource>(std::move(*root), std::move(*index), spec, fs), spec);
}

}  // namespace gpufeed::server
