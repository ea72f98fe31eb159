// The image_folder dataset kind: each sample is a file of the folder's index (reader/
// image_folder.h), opened beneath the folder's descriptor.
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "server/decode/image_decoder.h"
#include "server/images/dataset.h"
#include "server/images/image_source.h"
#include "server/reader/image_folder.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// What the walk left out that a user would otherwise miss (Dataset::notices): files of other
// image types and a caller's links to images (samples torchvision's ImageFolder would have:
// counted by reason), links not followed and folders the caller cannot list (warnings).
std::vector<DatasetNotice> FolderNotices(const ImageFolderIndex& index,
                                         const std::optional<PeerCred>& reader) {
  std::vector<DatasetNotice> out;
  const auto add = [&](const Skipped& left, std::string reason, const std::string& what,
                       const std::string& why) {
    if (left.count == 0) return;
    DatasetNotice n;
    n.reason = std::move(reason);
    n.count = n.reason == "warning" ? 0 : left.count;
    n.example = EscapeForLog(left.first);
    n.message = absl::StrCat(left.count, " ", what, " (first: ", n.example, "): ", why);
    out.push_back(std::move(n));
  };
  const bool one = index.other_images.count == 1;
  add(index.other_images, "other_image_type",
      absl::StrCat(one ? "file" : "files",
                   " of an image type gpufeed does not decode (.bmp .ppm .pgm .tif .tiff .webp) ",
                   one ? "is" : "are", " left out"),
      "torchvision's ImageFolder loads them, so its sample ids would differ from gpufeed's; "
      "convert them to .png or .jpg");
  add(index.links, "link",
      absl::StrCat(index.links.count == 1 ? "symbolic link" : "symbolic links",
                   " named as an image ", index.links.count == 1 ? "is" : "are", " left out"),
      "an attach through the client library follows no link inside an image folder "
      "(docs/SECURITY.md section 2), torchvision does; put the files themselves in the folder");
  add(index.unfollowed_links, "warning",
      absl::StrCat(index.unfollowed_links.count == 1 ? "symbolic link is" : "symbolic links are",
                   " not followed"),
      "a linked folder's images (in the root: a linked class) are not part of the dataset, "
      "unlike torchvision's ImageFolder (docs/SECURITY.md section 4); put the folders "
      "themselves in the tree");
  add(index.unlisted_folders, "warning",
      absl::StrCat(index.unlisted_folders.count == 1 ? "folder is" : "folders are",
                   " skipped, their mode bits not letting uid ",
                   reader.has_value() ? absl::StrCat(reader->uid) : std::string("?"),
                   " list and search them"),
      "their images are not part of the dataset (os.walk skips them too); chmod them a+rx, or "
      "move the images out");
  return out;
}

class FolderSource final : public ImageSource {
 public:
  FolderSource(UniqueFd root, ImageFolderIndex index, const DatasetSpec& spec, FileSystem* fs)
      : root_(std::move(root)),
        reader_(spec.reader),
        index_(std::move(index)),
        notices_(FolderNotices(index_, reader_)),
        fs_(fs) {}

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

  // Opened as Read opens it (beneath the root, with the reader's mode bits), then closed.
  absl::Status CheckReadable(uint64_t id) const override {
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
        fs_->OpenForReadBeneath(root_.get(), index_.Relative(id), index_.paths[id],
                                reader_.has_value() ? &*reader_ : nullptr);
    return file.status();
  }

  std::string SampleName(uint64_t id) const override { return index_.Relative(id); }

  std::vector<DatasetNotice> notices() const override { return notices_; }

 private:
  const UniqueFd root_;                   // the folder's descriptor: every file opens beneath it
  const std::optional<PeerCred> reader_;  // whose mode bits decide what is readable
  const ImageFolderIndex index_;
  const std::vector<DatasetNotice> notices_;
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
  auto source = std::make_unique<FolderSource>(std::move(*root), std::move(*index), spec, fs);
  for (const DatasetNotice& n : source->notices()) {
    spdlog::info("image_folder {}: {}", EscapeForLog(spec.path), n.message);
  }
  return MakeImageDataset(std::move(source), spec);
}

}  // namespace gpufeed::server
