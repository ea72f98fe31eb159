#include "server/reader/image_folder.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed::server {
namespace {

namespace fs = std::filesystem;

bool IsImage(const fs::path& p) {
  const std::string ext = absl::AsciiStrToLower(p.extension().string());
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

absl::Status FromError(const std::error_code& ec, const std::string& path) {
  return ErrnoToStatus(ec.value(), absl::StrCat("dataset.path: ", path));
}

// Entries of `dir` sorted by name (byte order, as Python's sorted() on str for ASCII names).
absl::StatusOr<std::vector<fs::directory_entry>> Sorted(const fs::path& dir) {
  std::error_code ec;
  fs::directory_iterator it(dir, fs::directory_options::follow_directory_symlink, ec);
  if (ec) return FromError(ec, dir.string());
  std::vector<fs::directory_entry> out;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return FromError(ec, dir.string());
    out.push_back(*it);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.path().filename().string() < b.path().filename().string();
  });
  return out;
}

}  // namespace

absl::StatusOr<ImageFolderIndex> IndexImageFolder(const std::string& root) {
  ImageFolderIndex index;
  GPUFEED_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> top, Sorted(root));
  for (const fs::directory_entry& entry : top) {
    std::error_code ec;
    if (!entry.is_directory(ec)) continue;
    index.classes.push_back(entry.path().filename().string());
  }
  if (index.classes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", root, " holds no class folder (ImageFolder layout: ROOT/CLASS/IMAGE)"));
  }
  for (size_t label = 0; label < index.classes.size(); ++label) {
    // torchvision walks each class folder recursively, files sorted within each folder.
    std::vector<fs::path> files;
    std::error_code ec;
    fs::recursive_directory_iterator it(fs::path(root) / index.classes[label],
                                        fs::directory_options::follow_directory_symlink, ec);
    if (ec) return FromError(ec, (fs::path(root) / index.classes[label]).string());
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) return FromError(ec, it->path().string());
      std::error_code type_ec;
      if (it->is_regular_file(type_ec) && IsImage(it->path())) files.push_back(it->path());
    }
    // As sorted(os.walk(...)) then sorted(fnames): by directory string, then file name (not
    // by path components, which would put a sub-folder's files before its parent's).
    std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
      const std::string da = a.parent_path().string(), db = b.parent_path().string();
      if (da != db) return da < db;
      return a.filename().string() < b.filename().string();
    });
    if (files.empty()) {  // torchvision's ImageFolder refuses such a tree too
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: class folder ", index.classes[label], " under ", root,
          " holds no .jpg, .jpeg or .png file"));
    }
    for (const fs::path& f : files) {
      index.paths.push_back(f.string());
      index.labels.push_back(static_cast<int64_t>(label));
    }
  }
  return index;
}

}  // namespace gpufeed::server
