// The torchvision ImageFolder layout: ROOT/<class>/<file>, one sub-folder a class. Classes
// sorted by name get labels 0..C-1; files with an image extension (.jpg .jpeg .png, any case)
// sorted by name within each class, classes in label order, give the sample ids, so ids
// equal the indices of torchvision's ImageFolder(ROOT).samples as long as the tree holds no
// other image type torchvision accepts (.bmp .ppm .pgm .tif .tiff .webp), which are skipped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gpufeed::server {

struct ImageFolderIndex {
  std::vector<std::string> classes;  // label -> class name
  std::vector<std::string> paths;    // sample id -> absolute path
  std::vector<int64_t> labels;       // sample id -> label
};

// NOT_FOUND / PERMISSION_DENIED naming the path; INVALID_ARGUMENT when the root holds no class
// folder or a class folder holds no image (as ImageFolder raises).
absl::StatusOr<ImageFolderIndex> IndexImageFolder(const std::string& root);

}  // namespace gpufeed::server
