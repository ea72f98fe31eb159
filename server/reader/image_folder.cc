#include "server/reader/image_folder.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "common/status.h"

namespace gpufeed::server {
namespace {

std::string ExtensionOf(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? "" : absl::AsciiStrToLower(name.substr(dot));
}

bool IsImage(const std::string& name) {
  const std::string ext = ExtensionOf(name);
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

// The rest of torchvision's IMG_EXTENSIONS (datasets/folder.py): files ImageFolder loads.
bool IsOtherImage(const std::string& name) {
  const std::string ext = ExtensionOf(name);
  return ext == ".bmp" || ext == ".ppm" || ext == ".pgm" || ext == ".tif" || ext == ".tiff" ||
         ext == ".webp";
}

struct Entry {
  std::string name;
  unsigned char type = DT_UNKNOWN;  // DT_DIR, DT_REG, DT_LNK, ... (never DT_UNKNOWN once read)
};

class Walker {
 public:
  Walker(int root_fd, const std::string& root, const FolderWalkLimits& limits,
         const PeerCred* reader)
      : root_fd_(root_fd), root_(root), reader_(reader), budget_(limits, root) {}

  // The entries of the directory at `relative` beneath the root ("" for the root itself),
  // unsorted; a directory seen before (by device and inode) gives none.
  absl::StatusOr<std::vector<Entry>> List(const std::string& relative) {
    const std::string display = relative.empty() ? root_ : absl::StrCat(root_, "/", relative);
    UniqueFd fd;
    if (relative.empty()) {
      fd = UniqueFd(::openat(root_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK));
    } else {
      open_how how{};
      how.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
      how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
      fd = UniqueFd(static_cast<int>(
          ::syscall(SYS_openat2, root_fd_, relative.c_str(), &how, sizeof(how))));
    }
    if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", display));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", display));
    }
    std::vector<Entry> out;
    if (!visited_.insert({st.st_dev, st.st_ino}).second) return out;
    // The reader must be able to list (r) and search (x) it, as its own walk would.
    if (reader_ != nullptr && !(ModeLetsRead(st.st_uid, st.st_gid, st.st_mode, *reader_) &&
                                ModeLetsSearch(st.st_uid, st.st_gid, st.st_mode, *reader_))) {
      if (!relative.empty()) {  // skipped, as os.walk skips what it cannot read
        unlisted_.Add(display);
        return out;
      }
      return absl::PermissionDeniedError(absl::StrCat(
          "dataset.path: the mode bits of ", display, " do not let uid ", reader_->uid,
          " list and search it"));
    }
    DIR* dir = ::fdopendir(fd.get());
    if (dir == nullptr) return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", display));
    const int dir_fd = fd.Release();  // the DIR owns it now
    absl::Status status;
    while (true) {
      errno = 0;
      const dirent* d = ::readdir(dir);
      if (d == nullptr) {
        if (errno != 0) status = ErrnoToStatus(errno, absl::StrCat("dataset.path: ", display));
        break;
      }
      const std::string name = d->d_name;
      if (name == "." || name == "..") continue;
      status = budget_.Count();
      if (!status.ok()) break;
      Entry e{name, d->d_type};
      if (e.type == DT_UNKNOWN) {  // some file systems leave it to a stat
        struct stat est {};
        if (::fstatat(dir_fd, d->d_name, &est, AT_SYMLINK_NOFOLLOW) != 0) continue;
        e.type = S_ISDIR(est.st_mode)   ? DT_DIR
                 : S_ISREG(est.st_mode) ? DT_REG
                 : S_ISLNK(est.st_mode) ? DT_LNK
                                        : DT_FIFO;
      }
      out.push_back(std::move(e));
    }
    ::closedir(dir);
    if (!status.ok()) return status;
    return out;
  }

  // The sub-folders List skipped for want of the reader's r and x bits.
  Skipped& unlisted() { return unlisted_; }

 private:
  const int root_fd_;
  const std::string root_;
  const PeerCred* const reader_;
  WalkBudget budget_;
  absl::flat_hash_set<std::pair<dev_t, ino_t>> visited_;
  Skipped unlisted_;
};

}  // namespace

absl::Status WalkBudget::Count() {
  ++entries_;
  if (entries_ > limits_.max_entries) {
    return absl::ResourceExhaustedError(absl::StrCat("dataset.path: ", root_, " holds more than ",
                                                     limits_.max_entries,
                                                     " entries (gpufeedd's max_folder_entries)"));
  }
  return entries_ % 256 == 1 ? Poll() : absl::OkStatus();
}

absl::Status WalkBudget::Poll() const {
  if (limits_.cancel != nullptr && limits_.cancel->load(std::memory_order_relaxed)) {
    return absl::CancelledError("gpufeedd is shutting down");
  }
  if (absl::Now() > deadline_) {
    return absl::DeadlineExceededError(
        absl::StrCat("dataset.path: ", verb_, " ", root_, " took longer than ",
                     absl::FormatDuration(limits_.timeout), " (gpufeedd's folder_walk_timeout)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> TakeIndexCharge(const FolderWalkLimits& limits) {
  if (limits.index_bytes == nullptr) return nullptr;
  return limits.index_bytes->Take(limits.charge_uid, 0, "");
}

absl::StatusOr<ImageFolderIndex> IndexImageFolder(int root_fd, const std::string& root,
                                                  const FolderWalkLimits& limits,
                                                  const PeerCred* reader) {
  Walker walker(root_fd, root, limits, reader);
  ImageFolderIndex index;
  index.root = root;
  GPUFEED_ASSIGN_OR_RETURN(index.charge, TakeIndexCharge(limits));
  uint64_t path_bytes = 0;  // the paths' characters (their heap, for paths past the SSO)
  // What the index holds so far, charged after each class folder.
  const auto charge_index = [&]() -> absl::Status {
    if (index.charge == nullptr) return absl::OkStatus();
    return index.charge->GrowTo(index.paths.capacity() * sizeof(std::string) + path_bytes +
                                    index.labels.capacity() * sizeof(int64_t),
                                absl::StrCat("the index of ", root, " (", index.paths.size(),
                                             " images so far)"));
  };
  GPUFEED_ASSIGN_OR_RETURN(std::vector<Entry> top, walker.List(""));
  for (const Entry& e : top) {
    if (e.type == DT_DIR) index.classes.push_back(e.name);  // a link to one is not a class
  }
  // ... which torchvision's find_classes would take (entry.is_dir() follows it).
  std::vector<std::string> top_links;
  for (const Entry& e : top) {
    if (e.type == DT_LNK) top_links.push_back(e.name);
  }
  std::sort(top_links.begin(), top_links.end());
  for (const std::string& name : top_links) {
    index.unfollowed_links.Add(absl::StrCat(root, "/", name));
  }
  // Byte order, as Python's sorted() on str for ASCII names.
  std::sort(index.classes.begin(), index.classes.end());
  if (index.classes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", root, " holds no class folder (ImageFolder layout: ROOT/CLASS/IMAGE)",
        top_links.empty() ? ""
                          : absl::StrCat("; its ", top_links.size(), " symbolic links (e.g. ",
                                         top_links[0], ") are not followed")));
  }
  for (size_t label = 0; label < index.classes.size(); ++label) {
    // torchvision walks each class folder recursively, files sorted within each folder:
    // (directory relative to ROOT, file name).
    std::vector<std::pair<std::string, std::string>> files;
    // What is left out, (directory, name) as `files`, counted in their order once sorted.
    std::vector<std::pair<std::string, std::string>> other_images, links, unfollowed;
    std::deque<std::string> pending = {index.classes[label]};
    while (!pending.empty()) {
      const std::string dir = std::move(pending.front());
      pending.pop_front();
      GPUFEED_ASSIGN_OR_RETURN(std::vector<Entry> entries, walker.List(dir));
      // By name: sub-folders are walked in one order whatever readdir's, so that the first
      // of what is left out (a folder the caller cannot list) is the same every time.
      std::sort(entries.begin(), entries.end(),
                [](const Entry& a, const Entry& b) { return a.name < b.name; });
      for (Entry& e : entries) {
        if (e.type == DT_DIR) {
          pending.push_back(absl::StrCat(dir, "/", e.name));
        } else if ((e.type == DT_REG || (e.type == DT_LNK && reader == nullptr)) &&
                   IsImage(e.name)) {
          // A caller's walk (reader) takes no links: one inside the folder could lead through
          // a directory the caller cannot search (docs/SECURITY.md section 2).
          files.emplace_back(dir, std::move(e.name));
        } else if (e.type == DT_LNK) {
          (IsImage(e.name)        ? links
           : IsOtherImage(e.name) ? other_images
                                  : unfollowed)
              .emplace_back(dir, std::move(e.name));
        } else if (e.type == DT_REG && IsOtherImage(e.name)) {
          other_images.emplace_back(dir, std::move(e.name));
        }
      }
    }
    const auto left_out = [&](std::vector<std::pair<std::string, std::string>>& entries,
                              Skipped& into) {
      std::sort(entries.begin(), entries.end());
      for (const auto& [dir, name] : entries) into.Add(absl::StrCat(root, "/", dir, "/", name));
    };
    left_out(other_images, index.other_images);
    left_out(links, index.links);
    left_out(unfollowed, index.unfollowed_links);
    // As sorted(os.walk(...)) then sorted(fnames): by directory string, then file name (not
    // by path components, which would put a sub-folder's files before its parent's).
    std::sort(files.begin(), files.end());
    if (files.empty()) {  // torchvision's ImageFolder refuses such a tree too
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: class folder ", index.classes[label], " under ", root,
          " holds no .jpg, .jpeg or .png file",
          other_images.empty()
              ? ""
              : absl::StrCat(" (its ", other_images.size(),
                             " .bmp/.ppm/.pgm/.tif/.tiff/.webp "
                             "files, e.g. ",
                             other_images[0].second,
                             ", are images gpufeed does not decode: convert them to .png)")));
    }
    for (const auto& [dir, name] : files) {
      index.paths.push_back(absl::StrCat(root, "/", dir, "/", name));
      index.labels.push_back(static_cast<int64_t>(label));
      path_bytes += index.paths.back().capacity() + 1;
    }
    GPUFEED_RETURN_IF_ERROR(charge_index());
  }
  index.unlisted_folders = std::move(walker.unlisted());
  return index;
}

absl::StatusOr<ImageFolderIndex> IndexImageFolder(const std::string& root,
                                                  const FolderWalkLimits& limits) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd fd, OpenChecked(root, FileKind::kDirectory));
  return IndexImageFolder(fd.get(), root, limits);
}

}  // namespace gpufeed::server
