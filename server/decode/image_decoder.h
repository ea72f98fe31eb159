// Decoding JPEG (libjpeg-turbo's TurboJPEG) and PNG (libpng's simplified API) to 8-bit RGB,
// as torchvision's ImageFolder sees images through PIL's convert("RGB"): grayscale, CMYK and
// palette images become RGB, an alpha channel is dropped (not composited).
//
// Bad input never crashes and never allocates beyond the pixel cap (checked from the header,
// before any pixel buffer exists). A failure is DATA_LOSS (truncated, corrupt), or
// INVALID_ARGUMENT (empty, not an image, unsupported format, too large), with the reason in
// a payload that BadImageOf reads back, so the feed can count failures per reason.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/decode/crop_box.h"

namespace gpufeed::server {

enum class BadImage {
  kNone, kEmpty, kNotAnImage, kUnsupported, kTruncated, kCorrupt, kTooLarge, kUnreadable,
  kTooSlow
};
// Every reason but kNone, in the order counters report them.
inline constexpr BadImage kBadImageReasons[] = {
    BadImage::kEmpty,   BadImage::kNotAnImage, BadImage::kUnsupported, BadImage::kTruncated,
    BadImage::kCorrupt, BadImage::kTooLarge,   BadImage::kUnreadable,  BadImage::kTooSlow};
// "empty", "not_an_image", "unsupported_format", "truncated", "corrupt", "too_large",
// "unreadable" (the file could not be opened or read: permissions, I/O error, gone),
// "too_slow" (its decode would cost more than a bound allows: a progressive JPEG of more than
// kMaxJpegScans scans).
const char* BadImageName(BadImage reason);
// The reason of a DecodeImage failure; kNone for OK or a status from elsewhere.
BadImage BadImageOf(const absl::Status& status);
// `status` (not OK) marked as a bad image of `reason`, so that BadImageOf reads it back.
absl::Status MarkBadImage(absl::Status status, BadImage reason);

// A progressive JPEG of more scans is a bad image, too_slow, never decoded past its 500th
// scan: each scan is a pass over the whole image's coefficients, and a few bytes make one
// (an EOB run covers 32767 blocks), so a small file could cost minutes of decode (a "scan
// bomb"). libjpeg-turbo's own bound (TurboJPEG's TJFLAG_LIMITSCANS); real encoders write
// at most ~10 scans (libjpeg's default progression: 10 for YCbCr, 6 for grayscale).
inline constexpr int kMaxJpegScans = 500;

struct Image {
  int height = 0;
  int width = 0;
  std::vector<uint8_t> rgb;  // height x width x 3, row-major (HWC)
  // Where these pixels lie in the whole (scaled) image: 0, 0 but for a region decode
  // (DecodeOptions::region), which returns a window around the region.
  int top = 0;
  int left = 0;
};

struct DecodeOptions {
  uint64_t max_pixels = 64'000'000;  // width x height (of the full-size image)
  // JPEG only: decode at 1/scale_denom of the size (1, 2, 4 or 8) by DCT scaling; the image
  // then has ceil(width / scale_denom) x ceil(height / scale_denom) pixels.
  int scale_denom = 1;
  // JPEG only, where not empty (height and width > 0): the pixels wanted, in the image at
  // 1/scale_denom. The decode then skips the inverse DCT, upsampling and colour conversion of
  // the rows above the box (less a margin) and of the columns beside it, and stops after its
  // last row. The window returned (Image::top, left) holds the box, each pixel in it
  // bit-equal to a whole decode's. A box past the image is clipped to it; one wholly outside
  // it gets the whole image, as do progressive JPEGs. A file that does not end in an EOI
  // marker is decoded whole (so a truncated file is truncated). PNG: ignored (the whole
  // image).
  CropBox region;
  // With a region: entropy-decode the rest of the file too (the rows below are still not
  // converted), so a file damaged anywhere fails as a whole decode fails, for the same
  // reason; without, damage only below the box goes unseen (the box's pixels are the file's
  // own). Costs the Huffman decode of the rows below, a large part of what the region decode
  // saves (measured: docs/benchmarks.md, section The CPU image path).
  bool region_checks_whole_file = false;
};

absl::StatusOr<Image> DecodeImage(std::span<const uint8_t> bytes, const DecodeOptions& options = {});

// What the GPU decoder needs to know of a file before taking it, from its header only.
struct JpegHeader {
  int height = 0;
  int width = 0;
  // A baseline (sequential Huffman) YCbCr JPEG of 4:4:4, 4:2:2, 4:2:0 or 4:4:0 that ends in an
  // EOI marker: what nvJPEG's hardware decoder takes. Anything else is decoded on the CPU.
  bool gpu_decodable = false;
};
// The header of a JPEG file (all zero and false for a file that is no JPEG); the DecodeImage
// error when the header cannot be parsed or exceeds the pixel cap. Cheap: no pixel is decoded.
absl::StatusOr<JpegHeader> InspectJpeg(std::span<const uint8_t> bytes,
                                       const DecodeOptions& options = {});

}  // namespace gpufeed::server
