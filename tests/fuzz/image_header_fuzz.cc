// JPEG/PNG inspection and decoding: the bytes of an image_folder dataset's file. InspectJpeg
// reads the header only (the GPU decoder's check); DecodeImage decodes under the pixel cap,
// whole and (a random resized crop's way) a region: the region decode succeeds where the
// whole decode does, with the same pixels in the region; where it fails, the whole decode
// fails for the same reason; and checking the whole file, it fails wherever that does.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "server/decode/image_decoder.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {
namespace {

using server::BadImage;
using server::BadImageOf;

// A failure is a bad image with a reason (counted per reason by the feed), never an
// internal error or an unmarked status.
void CheckBad(const absl::Status& status) {
  FUZZ_CHECK(!status.ok());
  FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
             status.code() == absl::StatusCode::kDataLoss);
  FUZZ_CHECK(BadImageOf(status) != BadImage::kNone);
}

}  // namespace

int FuzzImageHeader(const uint8_t* data, size_t size) {
  // An exact-size copy, so ASan sees a read past the end.
  const std::vector<uint8_t> bytes(data, data + size);
  const std::span<const uint8_t> span(bytes);
  // A small cap keeps a decode cheap; the header check is the same at any cap.
  server::DecodeOptions options;
  options.max_pixels = 1 << 20;

  absl::StatusOr<server::JpegHeader> header = server::InspectJpeg(span, options);
  if (!header.ok()) {
    CheckBad(header.status());
  } else if (header->width != 0) {
    FUZZ_CHECK(header->height >= 1);
    FUZZ_CHECK(static_cast<uint64_t>(header->width) * header->height <= options.max_pixels);
  }

  for (int scale_denom : {1, 8}) {
    options.scale_denom = scale_denom;
    options.region = {};
    absl::StatusOr<server::Image> image = server::DecodeImage(span, options);
    // Regions of the image the whole decode gave (or of a guess when it failed), their
    // place drawn from the input's last bytes: a corner, a strip, the middle.
    const int h = image.ok() ? image->height : 64, w = image.ok() ? image->width : 64;
    const uint8_t a = size > 0 ? data[size - 1] : 0, b = size > 1 ? data[size - 2] : 0;
    const server::CropBox regions[] = {{h * a / 256, w * b / 256, h - h * a / 256, w - w * b / 256},
                                       {h / 2, 0, 1, w},
                                       {h * b / 512, w * a / 512, (h + 1) / 2, (w + 1) / 2}};
    for (int k = 0; k < 2 * static_cast<int>(std::size(regions)); ++k) {
      const server::CropBox& r = regions[k / 2];
      options.region = r;
      options.region_checks_whole_file = k % 2 == 1;
      absl::StatusOr<server::Image> window = server::DecodeImage(span, options);
      options.region_checks_whole_file = false;
      if (image.ok()) FUZZ_CHECK(window.ok());  // a file that decodes whole decodes in part
      if (k % 2 == 1) FUZZ_CHECK(window.ok() == image.ok());
      if (!window.ok()) {
        CheckBad(window.status());
        FUZZ_CHECK(BadImageOf(window.status()) == BadImageOf(image.status()));
        continue;
      }
      FUZZ_CHECK(window->rgb.size() == static_cast<size_t>(window->width) * window->height * 3);
      if (!image.ok() || !header.ok() || header->width == 0) continue;  // PNG: the whole image
      FUZZ_CHECK(window->top >= 0 && window->left >= 0 && window->top <= r.top &&
                 window->left <= r.left);
      FUZZ_CHECK(window->top + window->height <= image->height &&
                 window->left + window->width <= image->width);
      const int rows = std::min(r.top + r.height, window->top + window->height) - r.top;
      const int cols = std::min(r.left + r.width, window->left + window->width) - r.left;
      FUZZ_CHECK(rows == std::min(r.height, image->height - r.top) &&
                 cols == std::min(r.width, image->width - r.left));
      for (int y = r.top; y < r.top + rows; ++y) {
        FUZZ_CHECK(std::memcmp(&image->rgb[(static_cast<size_t>(y) * image->width + r.left) * 3],
                               &window->rgb[(static_cast<size_t>(y - window->top) * window->width +
                                             (r.left - window->left)) *
                                            3],
                               static_cast<size_t>(cols) * 3) == 0);
      }
    }
    if (!image.ok()) {
      CheckBad(image.status());
      // What the header said too large, the decode says too large.
      if (!header.ok() && BadImageOf(header.status()) == BadImage::kTooLarge) {
        FUZZ_CHECK(BadImageOf(image.status()) == BadImage::kTooLarge);
      }
      continue;
    }
    FUZZ_CHECK(image->height >= 1 && image->width >= 1);
    FUZZ_CHECK(static_cast<uint64_t>(image->width) * image->height <= options.max_pixels);
    FUZZ_CHECK(image->rgb.size() == static_cast<size_t>(image->width) * image->height * 3);
    if (header.ok() && header->width != 0) {
      // The header InspectJpeg read is the image's full size; DCT scaling divides it, rounding up.
      FUZZ_CHECK(image->width == (header->width + scale_denom - 1) / scale_denom);
      FUZZ_CHECK(image->height == (header->height + scale_denom - 1) / scale_denom);
    }
  }
  return 0;
}

}  // namespace gpufeed::fuzz

GPUFEED_FUZZ_TARGET(FuzzImageHeader)
