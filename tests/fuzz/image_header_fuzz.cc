// JPEG/PNG inspection and decoding: the bytes of an image_folder dataset's file. InspectJpeg
// reads the header only (the GPU decoder's check); DecodeImage decodes under the pixel cap.
#include <cstdint>
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
    absl::StatusOr<server::Image> image = server::DecodeImage(span, options);
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
