#include "server/decode/image_decoder.h"

// clang-format off
#include <csetjmp>
#include <cstdio>   // jpeglib.h needs FILE and size_t first
#include <jpeglib.h>
// clang-format on
#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace gpufeed::server {
namespace {

constexpr char kPayload[] = "type.gpufeed/bad_image";

absl::Status Bad(BadImage reason, absl::string_view message) {
  return MarkBadImage((reason == BadImage::kTruncated || reason == BadImage::kCorrupt)
                          ? absl::DataLossError(message)
                          : absl::InvalidArgumentError(message),
                      reason);
}

absl::Status CheckSize(int64_t width, int64_t height, const DecodeOptions& o) {
  if (width <= 0 || height <= 0) return Bad(BadImage::kCorrupt, "image has no pixels");
  if (static_cast<uint64_t>(width) * static_cast<uint64_t>(height) > o.max_pixels) {
    return Bad(BadImage::kTooLarge,
               absl::StrCat("image of ", width, "x", height, " exceeds the cap of ", o.max_pixels,
                            " pixels"));
  }
  return absl::OkStatus();
}

// Whether the file ends in an EOI marker (FF D9): else it is truncated, most likely.
bool EndsWithEoi(std::span<const uint8_t> bytes) {
  return bytes.size() >= 2 && bytes[bytes.size() - 2] == 0xFF && bytes.back() == 0xD9;
}

struct TjDeleter {
  void operator()(void* h) const { tjDestroy(h); }
};

// The decoded pixels as RGB: as they are, or from CMYK. Adobe CMYK JPEGs store inverted ink
// values; PIL reads them as "CMYK;I" and converts with r = clip((255 - k) - c) on the
// uninverted values, i.e. clip(raw_c + raw_k - 255).
Image FinishJpeg(int height, int width, bool cmyk, std::vector<uint8_t> pixels) {
  Image image{height, width, {}};
  if (!cmyk) {
    image.rgb = std::move(pixels);
    return image;
  }
  image.rgb.resize(static_cast<size_t>(width) * height * 3);
  for (size_t p = 0, n = static_cast<size_t>(width) * height; p < n; ++p) {
    const int k = pixels[4 * p + 3];
    for (int c = 0; c < 3; ++c) {
      image.rgb[3 * p + c] = static_cast<uint8_t>(std::max(0, pixels[4 * p + c] + k - 255));
    }
  }
  return image;
}

absl::StatusOr<Image> DecodeJpeg(std::span<const uint8_t> bytes, const DecodeOptions& o) {
  // One decompressor per thread: TurboJPEG handles are not thread-safe, and creating one per
  // image costs an allocation we need not pay.
  thread_local std::unique_ptr<void, TjDeleter> handle(tjInitDecompress());
  if (handle == nullptr) return absl::InternalError("tjInitDecompress failed");
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(handle.get(), bytes.data(), bytes.size(), &width, &height, &subsamp,
                          &colorspace) != 0) {
    const std::string why = tjGetErrorStr2(handle.get());
    return Bad(absl::StrContains(why, "Premature end") || bytes.size() < 128 ? BadImage::kTruncated
                                                                            : BadImage::kCorrupt,
               absl::StrCat("JPEG header: ", why));
  }
  if (absl::Status s = CheckSize(width, height, o); !s.ok()) return s;
  const bool cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  if (o.scale_denom != 1) {
    // TurboJPEG's scaled size (ceil(size * 1/denom)); the IDCT works at that size.
    const tjscalingfactor factor{1, o.scale_denom};
    width = TJSCALED(width, factor);
    height = TJSCALED(height, factor);
  }
  std::vector<uint8_t> pixels(static_cast<size_t>(width) * height * (cmyk ? 4 : 3));
  // Stop on warnings: libjpeg "recovers" from a truncated or damaged scan by filling grey,
  // which would train on garbage silently. Limit scans: a progressive file of more than 500
  // (kMaxJpegScans) is refused at its 501st.
  if (tjDecompress2(handle.get(), bytes.data(), bytes.size(), pixels.data(), width, 0, height,
                    cmyk ? TJPF_CMYK : TJPF_RGB, TJFLAG_STOPONWARNING | TJFLAG_LIMITSCANS) != 0) {
    const std::string why = tjGetErrorStr2(handle.get());
    if (absl::StrContains(why, "more than 500 scans")) {
      return Bad(BadImage::kTooSlow,
                 absl::StrCat("JPEG: a progressive image of more than ", kMaxJpegScans,
                              " scans (the decoder's bound): ", why));
    }
    const bool truncated = absl::StrContains(why, "Premature end");
    return Bad(truncated ? BadImage::kTruncated : BadImage::kCorrupt, absl::StrCat("JPEG: ", why));
  }
  return FinishJpeg(height, width, cmyk, std::move(pixels));
}

// Rows and columns decoded beyond a region on each side it is cut from the image: libjpeg's
// fancy upsampling reads chroma one sample past each output pixel (two pixels at 2x
// subsampling), and treats the edges of a cropped scanline as image edges, so the pixels
// next to them differ from a whole decode's (image_decoder_test finds them without a margin).
// 16 is one iMCU row or column at 4:2:0, far more than that reach at any DCT scale, and in
// case the first rows after a skip lack their context; the tests pass with 8. The margin costs
// decode time (docs/benchmarks.md, section The CPU image path), so no more than that.
constexpr int kRegionMargin = 16;

// The scaling factor tjDecompress2 picks for a decode to TJSCALED(size, 1/denom): the first
// of TurboJPEG's factors (2/1 down to 1/8) that fits. For tiny images that is a larger
// factor than 1/denom with the same size but other pixels (a 4x4 image at 1/8 is decoded at
// 1/4), so the region decode must pick it the same way.
tjscalingfactor TjFactor(int height, int width, int denom) {
  const tjscalingfactor wanted{1, denom};
  const int max_w = TJSCALED(width, wanted), max_h = TJSCALED(height, wanted);
  int n = 0;
  const tjscalingfactor* factors = tjGetScalingFactors(&n);
  for (int i = 0; factors != nullptr && i < n; ++i) {
    if (TJSCALED(width, factors[i]) <= max_w && TJSCALED(height, factors[i]) <= max_h) {
      return factors[i];
    }
  }
  return wanted;
}

// A region decode through libjpeg's own API: TurboJPEG 2.1 has no cropped decode (3.0's
// tj3SetCroppingRegion is newer than Debian's), but libjpeg-turbo's jpeg_skip_scanlines and
// jpeg_crop_scanline are there. Set up as tjDecompress2 sets up for TJPF_RGB / TJPF_CMYK
// (its scaling factor, the accurate integer IDCT, fancy upsampling, a warning is an error as
// under TJFLAG_STOPONWARNING), so the pixels equal DecodeJpeg's; image_decoder_test and the
// image_header fuzz target compare them.
//
// libjpeg reports errors by longjmp: each step that calls into it sets its own jump point,
// and no object with a destructor lives in those frames. (Abort and the destructor call
// libjpeg without one: jpeg_abort and jpeg_destroy never raise an error.)
class RegionDecoder {
 public:
  RegionDecoder() {
    cinfo_.err = jpeg_std_error(&err_.pub);
    err_.pub.error_exit = &OnError;
    err_.pub.emit_message = &OnMessage;
    if (setjmp(err_.jump) != 0) return;  // out of memory
    jpeg_create_decompress(&cinfo_);
    created_ = true;
  }
  ~RegionDecoder() {
    if (created_) jpeg_destroy_decompress(&cinfo_);
  }
  RegionDecoder(const RegionDecoder&) = delete;
  RegionDecoder& operator=(const RegionDecoder&) = delete;

  bool created() const { return created_; }
  // The last error's text.
  const char* message() const { return err_.message; }

  // Reads the header of `bytes` (kept until the decode ends): whether the pixels are CMYK (or
  // YCCK) and whether the file is progressive. Any earlier decode left half done (an
  // allocation that threw) is abandoned first.
  bool ReadHeader(std::span<const uint8_t> bytes, bool* cmyk, bool* progressive) {
    jpeg_abort_decompress(&cinfo_);
    if (setjmp(err_.jump) != 0) return Fail();
    jpeg_mem_src(&cinfo_, bytes.data(), static_cast<unsigned long>(bytes.size()));
    jpeg_read_header(&cinfo_, TRUE);
    *cmyk = cinfo_.jpeg_color_space == JCS_CMYK || cinfo_.jpeg_color_space == JCS_YCCK;
    *progressive = cinfo_.progressive_mode != 0;
    return true;
  }

  // Starts the decode at `factor`.
  bool Start(tjscalingfactor factor, bool cmyk) {
    if (setjmp(err_.jump) != 0) return Fail();
    cinfo_.out_color_space = cmyk ? JCS_CMYK : JCS_EXT_RGB;
    cinfo_.scale_num = static_cast<unsigned int>(factor.num);
    cinfo_.scale_denom = static_cast<unsigned int>(factor.denom);
    cinfo_.dct_method = JDCT_ISLOW;
    cinfo_.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo_);
    return true;
  }
  int output_height() const { return static_cast<int>(cinfo_.output_height); }
  int output_width() const { return static_cast<int>(cinfo_.output_width); }

  // Narrows every scanline to columns [*left, *left + *width); libjpeg widens them to whole
  // iMCU columns and says which it took.
  bool CropColumns(int* left, int* width) {
    if (setjmp(err_.jump) != 0) return Fail();
    auto x = static_cast<JDIMENSION>(*left), w = static_cast<JDIMENSION>(*width);
    jpeg_crop_scanline(&cinfo_, &x, &w);
    *left = static_cast<int>(x);
    *width = static_cast<int>(w);
    return true;
  }

  // Skips `first` rows and reads the next `count` into `out` (`pitch` bytes apart). Then,
  // with a `spare` row of `pitch` bytes, entropy-decodes the rest of the file to its end
  // (skipping all but the last row, which is read into `spare`): the rows below are never
  // converted, but damage there fails the decode as it fails a whole one. Without, the rows
  // below are never decoded at all.
  bool ReadRows(int first, int count, uint8_t* out, size_t pitch, uint8_t* spare) {
    if (setjmp(err_.jump) != 0) return Fail();
    if (first > 0) jpeg_skip_scanlines(&cinfo_, static_cast<JDIMENSION>(first));
    for (int y = 0; y < count; ++y) {
      JSAMPROW row = out + static_cast<size_t>(y) * pitch;
      jpeg_read_scanlines(&cinfo_, &row, 1);
    }
    if (spare == nullptr) {
      jpeg_abort_decompress(&cinfo_);
      return true;
    }
    // Skipping to the very end would decode nothing (libjpeg marks the input ended): stop
    // one row short and read that row.
    if (cinfo_.output_scanline < cinfo_.output_height) {
      const JDIMENSION left = cinfo_.output_height - cinfo_.output_scanline;
      if (left > 1) jpeg_skip_scanlines(&cinfo_, left - 1);
      JSAMPROW row = spare;
      jpeg_read_scanlines(&cinfo_, &row, 1);
    }
    jpeg_finish_decompress(&cinfo_);
    return true;
  }

  void Abort() { jpeg_abort_decompress(&cinfo_); }

 private:
  struct ErrorManager {
    jpeg_error_mgr pub;
    std::jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
  };
  static void OnError(j_common_ptr c) {
    auto* e = reinterpret_cast<ErrorManager*>(c->err);
    (*c->err->format_message)(c, e->message);
    std::longjmp(e->jump, 1);
  }
  // A warning (level < 0; libjpeg would go on, filling grey) ends the decode, as
  // TJFLAG_STOPONWARNING does; trace messages are ignored.
  static void OnMessage(j_common_ptr c, int level) {
    if (level < 0) OnError(c);
  }
  bool Fail() {
    jpeg_abort_decompress(&cinfo_);
    return false;
  }

  jpeg_decompress_struct cinfo_{};
  ErrorManager err_{};
  bool created_ = false;
};

absl::Status RegionError(const RegionDecoder& d, absl::string_view what) {
  const bool truncated = absl::StrContains(d.message(), "Premature end");
  return Bad(truncated ? BadImage::kTruncated : BadImage::kCorrupt,
             absl::StrCat(what, d.message()));
}

// DecodeJpeg of o.region only (DecodeOptions::region). Whatever does not take the region
// path is decoded whole by DecodeJpeg, so it succeeds or fails, and is classified, as it
// would there: a header TurboJPEG refuses (as tjDecompressHeader3 would: an unknown
// subsampling), a progressive file (its block smoothing, on where refinement scans are
// missing, reads coefficients two blocks across a cropped scanline's edge; and its whole
// entropy decode happens up front anyway), a region wholly outside the image, a thread
// whose decoder could not be made; and without o.region_checks_whole_file, a file that does
// not end in an EOI marker (truncated, most likely: the rows below the region would not
// show the cut).
absl::StatusOr<Image> DecodeJpegRegion(std::span<const uint8_t> bytes, const DecodeOptions& o) {
  if (!o.region_checks_whole_file && !EndsWithEoi(bytes)) return DecodeJpeg(bytes, o);
  thread_local std::unique_ptr<void, TjDeleter> tj(tjInitDecompress());
  int height = 0, width = 0, subsamp = 0, colorspace = 0;
  if (tj == nullptr || tjDecompressHeader3(tj.get(), bytes.data(), bytes.size(), &width, &height,
                                           &subsamp, &colorspace) != 0) {
    return DecodeJpeg(bytes, o);
  }
  if (absl::Status s = CheckSize(width, height, o); !s.ok()) return s;
  thread_local RegionDecoder decoder;
  if (!decoder.created()) return DecodeJpeg(bytes, o);
  bool cmyk = false, progressive = false;
  if (!decoder.ReadHeader(bytes, &cmyk, &progressive)) return DecodeJpeg(bytes, o);
  if (progressive) {
    decoder.Abort();
    return DecodeJpeg(bytes, o);
  }
  if (!decoder.Start(TjFactor(height, width, o.scale_denom), cmyk)) {
    return RegionError(decoder, "JPEG: ");
  }
  const int64_t out_height = decoder.output_height(), out_width = decoder.output_width();
  const CropBox& r = o.region;
  const int64_t box_top = r.top, box_left = r.left;
  const int top = static_cast<int>(std::clamp<int64_t>(box_top - kRegionMargin, 0, out_height));
  // No margin below: the rows under the box are never converted.
  const int bottom = static_cast<int>(std::clamp<int64_t>(box_top + r.height, top, out_height));
  int left = static_cast<int>(std::clamp<int64_t>(box_left - kRegionMargin, 0, out_width));
  const int right =
      static_cast<int>(std::clamp<int64_t>(box_left + r.width + kRegionMargin, left, out_width));
  if (bottom <= top || right <= left) {  // wholly outside: the whole image, never an error
    decoder.Abort();
    return DecodeJpeg(bytes, o);
  }
  int columns = right - left;
  if (columns < out_width && !decoder.CropColumns(&left, &columns)) {
    return RegionError(decoder, "JPEG: ");
  }
  const int rows = bottom - top;
  const size_t pitch = static_cast<size_t>(columns) * (cmyk ? 4 : 3);
  const bool check = o.region_checks_whole_file;
  std::vector<uint8_t> pixels(pitch * (rows + (check ? 1 : 0)));  // + ReadRows' spare row
  if (!decoder.ReadRows(top, rows, pixels.data(), pitch,
                        check ? pixels.data() + pitch * rows : nullptr)) {
    return RegionError(decoder, "JPEG: ");
  }
  pixels.resize(pitch * rows);
  Image image = FinishJpeg(rows, columns, cmyk, std::move(pixels));
  image.top = top;
  image.left = left;
  return image;
}

absl::StatusOr<Image> DecodePng(std::span<const uint8_t> bytes, const DecodeOptions& o) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  auto fail = [&](BadImage reason) {
    const std::string why = png.message;
    png_image_free(&png);
    return Bad(reason, absl::StrCat("PNG: ", why));
  };
  if (!png_image_begin_read_from_memory(&png, bytes.data(), bytes.size())) {
    return fail(BadImage::kCorrupt);
  }
  if (absl::Status s = CheckSize(png.width, png.height, o); !s.ok()) {
    png_image_free(&png);
    return s;
  }
  // RGBA, then the alpha dropped below: PIL's convert("RGB") discards alpha rather than
  // compositing it onto a background, as png's RGB output would.
  png.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(png));
  if (!png_image_finish_read(&png, nullptr, rgba.data(), 0, nullptr)) {
    const std::string why = png.message;
    const bool truncated = absl::StrContains(why, "Not enough") || absl::StrContains(why, "EOF") ||
                           absl::StrContains(why, "end of");
    return fail(truncated ? BadImage::kTruncated : BadImage::kCorrupt);
  }
  Image image{static_cast<int>(png.height), static_cast<int>(png.width), {}};
  image.rgb.resize(static_cast<size_t>(png.width) * png.height * 3);
  for (size_t p = 0, n = static_cast<size_t>(png.width) * png.height; p < n; ++p) {
    std::memcpy(&image.rgb[3 * p], &rgba[4 * p], 3);
  }
  png_image_free(&png);
  return image;
}

}  // namespace

const char* BadImageName(BadImage reason) {
  switch (reason) {
    case BadImage::kNone: return "none";
    case BadImage::kEmpty: return "empty";
    case BadImage::kNotAnImage: return "not_an_image";
    case BadImage::kUnsupported: return "unsupported_format";
    case BadImage::kTruncated: return "truncated";
    case BadImage::kCorrupt: return "corrupt";
    case BadImage::kTooLarge: return "too_large";
    case BadImage::kUnreadable: return "unreadable";
    case BadImage::kTooSlow: return "too_slow";
  }
  return "none";
}

BadImage BadImageOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kPayload);  // absl::optional<absl::Cord>
  if (!payload.has_value()) return BadImage::kNone;
  for (BadImage r : kBadImageReasons) {
    if (*payload == BadImageName(r)) return r;
  }
  return BadImage::kNone;
}

absl::Status MarkBadImage(absl::Status status, BadImage reason) {
  status.SetPayload(kPayload, absl::Cord(BadImageName(reason)));
  return status;
}

absl::StatusOr<Image> DecodeImage(std::span<const uint8_t> bytes, const DecodeOptions& options) {
  if (bytes.empty()) return Bad(BadImage::kEmpty, "the file is empty");
  auto starts = [&](std::initializer_list<uint8_t> magic) {
    return bytes.size() >= magic.size() && std::equal(magic.begin(), magic.end(), bytes.begin());
  };
  if (starts({0xFF, 0xD8, 0xFF})) {
    return options.region.height > 0 && options.region.width > 0 ? DecodeJpegRegion(bytes, options)
                                                                 : DecodeJpeg(bytes, options);
  }
  if (starts({0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A})) return DecodePng(bytes, options);
  if (starts({'G', 'I', 'F', '8'}) || starts({'B', 'M'}) || starts({'R', 'I', 'F', 'F'}) ||
      starts({'I', 'I', 0x2A, 0x00}) || starts({'M', 'M', 0x00, 0x2A})) {
    return Bad(BadImage::kUnsupported, "GIF, BMP, WebP and TIFF are not supported (JPEG and PNG are)");
  }
  return Bad(BadImage::kNotAnImage, "neither JPEG nor PNG");
}

absl::StatusOr<JpegHeader> InspectJpeg(std::span<const uint8_t> bytes,
                                       const DecodeOptions& options) {
  const bool jpeg = bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF;
  if (!jpeg) return JpegHeader{};  // not a JPEG: for DecodeImage to take or classify
  thread_local std::unique_ptr<void, TjDeleter> handle(tjInitDecompress());
  if (handle == nullptr) return absl::InternalError("tjInitDecompress failed");
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(handle.get(), bytes.data(), bytes.size(), &width, &height, &subsamp,
                          &colorspace) != 0) {
    return DecodeJpeg(bytes, options).status();  // the same classification as a decode
  }
  if (absl::Status s = CheckSize(width, height, options); !s.ok()) return s;
  JpegHeader header{height, width, false};
  // The frame marker says baseline (SOF0) or extended sequential Huffman (SOF1); the file
  // must end with EOI, or it is truncated and the CPU decoder will say so.
  bool sequential = false;
  for (size_t i = 2; i + 3 < bytes.size();) {
    if (bytes[i] != 0xFF) break;
    const uint8_t marker = bytes[i + 1];
    if (marker == 0xFF) {
      ++i;
      continue;
    }
    if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
      sequential = marker == 0xC0 || marker == 0xC1;
      break;
    }
    i += 2 + ((static_cast<size_t>(bytes[i + 2]) << 8) | bytes[i + 3]);
  }
  const bool ends = EndsWithEoi(bytes);
  const bool subsampling = subsamp == TJSAMP_444 || subsamp == TJSAMP_422 ||
                           subsamp == TJSAMP_420 || subsamp == TJSAMP_440;
  header.gpu_decodable = sequential && ends && subsampling && colorspace == TJCS_YCbCr;
  return header;
}

}  // namespace gpufeed::server
