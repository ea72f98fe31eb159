// The torchvision ImageFolder layout: ROOT/<class>/<file>, one sub-folder a class. Classes
// sorted by name get labels 0..C-1; files with an image extension (.jpg .jpeg .png, any case)
// sorted by name within each class, classes in label order, give the sample ids, so ids
// equal the indices of torchvision's ImageFolder(ROOT).samples as long as the tree holds no
// other image type torchvision accepts (.bmp .ppm .pgm .tif .tiff .webp), which are skipped,
// and no symbolic link to a directory: unlike torchvision (os.walk(followlinks=True)), the
// walk never follows one (docs/SECURITY.md section 4), so a linked class or sub-folder is not
// part of the dataset. A symbolic link to a file is a sample, opened beneath ROOT.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/byte_budget.h"
#include "common/os/peer_cred.h"

namespace gpufeed::server {

// What an attach-time scan left out that a user would otherwise miss (nothing is skipped
// silently): how many, and the first, as messages name it.
struct Skipped {
  int64_t count = 0;
  std::string first;
  void Add(std::string what) {
    if (count++ == 0) first = std::move(what);
  }
};

struct ImageFolderIndex {
  std::string root;                  // the display path of ROOT
  std::vector<std::string> classes;  // label -> class name
  std::vector<std::string> paths;    // sample id -> display path, root + "/" + relative
  std::vector<int64_t> labels;       // sample id -> label
  // The bytes of `paths` and `labels` in max_index_bytes (FolderWalkLimits::index_bytes),
  // returned with the index; null where the walk has no budget.
  std::unique_ptr<ByteBudget::Charge> charge;
  // Left out, each with its first display path. Files (and entries) torchvision's walk
  // ignores too are not counted: other extensions, files directly in ROOT.
  //   other_images: files of an image type torchvision's ImageFolder loads and gpufeed does
  //     not decode (.bmp .ppm .pgm .tif .tiff .webp), so ids differ from ImageFolder's;
  //   links: a caller's walk (`reader`): symbolic links named as images, never opened;
  //   unfollowed_links: symbolic links the walk did not follow (in ROOT, a possible class;
  //     elsewhere one not named as an image, a possible folder), which torchvision follows;
  //   unlisted_folders: a caller's walk: sub-folders its mode bits do not let it list.
  Skipped other_images;
  Skipped links;
  Skipped unfollowed_links;
  Skipped unlisted_folders;

  // The sample's path relative to ROOT, for opening it beneath ROOT's descriptor.
  std::string Relative(uint64_t id) const { return paths[id].substr(root.size() + 1); }
};

// What bounds a walk, and every other attach-time scan of a dataset (docs/SECURITY.md
// section 4): every directory entry seen counts; the time and the cancel flag bound a scan of
// a Megatron .idx too.
struct FolderWalkLimits {
  int64_t max_entries = 10'000'000;          // max_folder_entries
  absl::Duration timeout = absl::Seconds(120);  // folder_walk_timeout
  // Polled during the walk: true ends it with CANCELLED (the daemon is shutting down).
  const std::atomic<bool>* cancel = nullptr;
  // The bytes an index kept past the walk may hold (max_index_bytes), charged to
  // `charge_uid`'s share (nullopt: an admin's attach). Null: not bounded (tests).
  std::shared_ptr<ByteBudget> index_bytes;
  std::optional<uint32_t> charge_uid;
};

// What a walk (or a tar's indexing) has spent of its FolderWalkLimits.
class WalkBudget {
 public:
  // `root` names the dataset in messages; `verb` what is spent ("walking", "indexing").
  WalkBudget(const FolderWalkLimits& limits, std::string root, std::string verb = "walking")
      : limits_(limits),
        root_(std::move(root)),
        verb_(std::move(verb)),
        deadline_(absl::Now() + limits.timeout) {}

  // One more entry seen (a directory entry, a tar member): RESOURCE_EXHAUSTED past
  // max_entries; every 256 entries, Poll().
  absl::Status Count();
  // CANCELLED on the cancel flag, DEADLINE_EXCEEDED past the timeout: for scans that count
  // no entries (a Megatron .idx's sizes), between chunks of work.
  absl::Status Poll() const;

 private:
  const FolderWalkLimits limits_;
  const std::string root_;
  const std::string verb_;
  const absl::Time deadline_;
  int64_t entries_ = 0;
};

// An empty charge of limits.index_bytes for an index about to be built, to GrowTo as it
// grows; null where the limits have no budget.
absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> TakeIndexCharge(const FolderWalkLimits& limits);

// Walks the tree beneath the directory descriptor `root_fd` (borrowed); `root` is its
// display path. Sub-folders are opened beneath root_fd without following any symbolic link
// (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), each (device, inode) once. NOT_FOUND /
// PERMISSION_DENIED naming the path; INVALID_ARGUMENT when the root holds no class folder or
// a class folder holds no image (as ImageFolder raises); RESOURCE_EXHAUSTED past
// limits.max_entries, DEADLINE_EXCEEDED past limits.timeout, CANCELLED on limits.cancel.
//
// With `reader` (a caller who passed root_fd), the walk sees what that caller could: the root
// must let it list and search (PERMISSION_DENIED otherwise), and a sub-folder whose mode bits
// would not is skipped, as os.walk skips one it cannot read.
absl::StatusOr<ImageFolderIndex> IndexImageFolder(int root_fd, const std::string& root,
                                                  const FolderWalkLimits& limits = {},
                                                  const PeerCred* reader = nullptr);

// As above, opening `root` with the daemon's own rights (an admin's attach by path).
absl::StatusOr<ImageFolderIndex> IndexImageFolder(const std::string& root,
                                                  const FolderWalkLimits& limits = {});

}  // namespace gpufeed::server
