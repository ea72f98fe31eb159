// A crop window in image coordinates: what the decoder may decode (a region) and what the
// augment ops cut. Here, below both, so the decoder needs nothing of augment/.
#pragma once

namespace gpufeed::server {

// A crop: top row, left column, height, width (torchvision's i, j, h, w).
struct CropBox {
  int top = 0;
  int left = 0;
  int height = 0;
  int width = 0;
  bool operator==(const CropBox&) const = default;
};

}  // namespace gpufeed::server
