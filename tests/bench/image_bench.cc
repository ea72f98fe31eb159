// Image benchmark and comparison tool (tests/bench/image/README.md tells the whole run).
//
//   image_bench feed   --socket S --data DIR --pipeline FILE [--decode auto|cpu|nvjpeg]
//                      [--augment auto|cpu|gpu] [--device cuda:0|host] [--batch 256]
//                      [--ring-slots 4] [--warmup 5] [--seconds 20] [--label NAME]
//       images/s into the consumer's memory through a running gpufeedd, and the machine's
//       busy CPU cores meanwhile (all processes: the daemon's pool, nvJPEG's threads, us).
//   image_bench nvjpeg --data DIR [--batch 256] [--seconds 10] [--backend hardware|gpu_hybrid]
//                      [--flags N]  (nvjpegCreateEx flags; 32: chroma upsampling by interpolation)
//                      [--format rgbi|rgb|yuv|y|unchanged] [--step-ms MS] [--trace 1]
//                      [--vary N] [--chunk N] [--sync 1] [--stall-s 10] [--roi F]
//       nvJPEG's batched decode alone, files preloaded in pinned memory: the limit of the
//       nvJPEG path (no augmentation, no daemon). --format: nvJPEG's output format (planar
//       ones get three planes of the image's full size). --step-ms: one batch every MS
//       (a consumer's pace, to measure what the decode costs a training context beside
//       it). --vary N: batches alternate between B and B - N images, so the decoder is
//       re-initialised (nvjpegDecodeBatchedInitialize) before each, as when the number of
//       rows nvJPEG takes changes from batch to batch. --chunk N: each batch in calls of at
//       most N images (does the cost to a training context beside it follow the images or
//       the call size?). --sync 1: the stream synchronised after every call. A progress line
//       goes to stderr every second; a call that has not returned after --stall-s seconds
//       (10; 0: never) ends the run with exit code 3, naming the call. --trace: synchronises and
//       prints "batch N" on stderr after each batch, so a profiler's per-kernel lines (ncu) can be
//       counted per batch.
//   image_bench crop   --image FILE --crop TOP,LEFT,H,W --size S --out OUT.npy [--decoded D.npy]
//       the CPU path for a fixed crop (libjpeg-turbo decode, antialiased bilinear resize,
//       uint8 HWC), for tests/bench/image/compare_torchvision.py; --decoded writes the
//       decoded image too.
//   image_bench decode --data DIR [--files 2000]
//       libjpeg-turbo's decode rate on one core (the unit of the CPU path's goal).
// Each measurement prints one JSON line on stdout; progress goes to stderr.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/augment/output.h"
#include "server/augment/resize.h"
#include "server/decode/image_decoder.h"
#include "server/reader/image_folder.h"

#ifdef GPUFEED_WITH_CUDA
#include <cuda_runtime_api.h>

#include "gpufeed/client.h"
#include "server/device/nvjpeg.h"
#endif

namespace gpufeed {
namespace {

using Flags = std::map<std::string, std::string>;

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 2; i + 1 < argc; i += 2) flags[argv[i]] = argv[i + 1];
  return flags;
}

std::string Get(const Flags& f, const std::string& key, const std::string& fallback = "") {
  auto it = f.find(key);
  return it == f.end() ? fallback : it->second;
}

int64_t GetInt(const Flags& f, const std::string& key, int64_t fallback) {
  int64_t v = fallback;
  auto it = f.find(key);
  if (it != f.end() && !absl::SimpleAtoi(it->second, &v)) {
    std::fprintf(stderr, "%s: want an integer, got '%s'\n", key.c_str(), it->second.c_str());
    std::exit(2);
  }
  return v;
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "image_bench: %s\n", message.c_str());
  std::exit(1);
}

// Busy CPU time of the whole machine, in core-seconds, from /proc/stat.
double BusyCoreSeconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  uint64_t user, nice, system, idle, iowait, irq, softirq, steal;
  in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  return static_cast<double>(user + nice + system + irq + softirq + steal) /
         static_cast<double>(::sysconf(_SC_CLK_TCK));
}

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Die(absl::StrCat("cannot read ", path));
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void WriteNpyU8(const std::string& path, const std::vector<int64_t>& shape, const uint8_t* data,
                size_t bytes) {
  std::string header = absl::StrCat("{'descr': '|u1', 'fortran_order': False, 'shape': (",
                                    absl::StrJoin(shape, ", "), "), }");
  header.append(63 - (10 + header.size()) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint16_t length = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&length), 2);
  out << header;
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) Die(absl::StrCat("cannot write ", path));
}

int Crop(const Flags& f) {
  const std::vector<uint8_t> bytes = ReadAll(Get(f, "--image"));
  absl::StatusOr<server::Image> image = server::DecodeImage(bytes);
  if (!image.ok()) Die(image.status().ToString());
  std::vector<std::string> parts = absl::StrSplit(Get(f, "--crop"), ',');
  if (parts.size() != 4) Die("--crop: want TOP,LEFT,H,W");
  int v[4];
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleAtoi(parts[i], &v[i])) Die("--crop: want integers");
  }
  const server::CropBox box{v[0], v[1], v[2], v[3]};
  if (box.top < 0 || box.left < 0 || box.height <= 0 || box.width <= 0 ||
      box.top + box.height > image->height || box.left + box.width > image->width) {
    Die(absl::StrCat("--crop: outside the ", image->height, "x", image->width, " image"));
  }
  const int size = static_cast<int>(GetInt(f, "--size", 224));
  std::vector<float> pixels(static_cast<size_t>(size) * size * 3);
  server::ResizedCrop(*image, box, size, size, false, pixels.data());
  server::OutputSpec spec;
  spec.dtype = DType::kUInt8;
  spec.layout = server::Layout::kNHWC;
  std::vector<uint8_t> out(pixels.size());
  server::WriteImage(pixels.data(), size, size, spec, reinterpret_cast<std::byte*>(out.data()));
  WriteNpyU8(Get(f, "--out"), {size, size, 3}, out.data(), out.size());
  if (const std::string decoded = Get(f, "--decoded"); !decoded.empty()) {
    WriteNpyU8(decoded, {image->height, image->width, 3}, image->rgb.data(), image->rgb.size());
  }
  std::printf("{\"tool\":\"crop\",\"image\":\"%s\",\"height\":%d,\"width\":%d}\n",
              Get(f, "--image").c_str(), image->height, image->width);
  return 0;
}

int Decode(const Flags& f) {
  absl::StatusOr<server::ImageFolderIndex> index = server::IndexImageFolder(Get(f, "--data"));
  if (!index.ok()) Die(index.status().ToString());
  const size_t files = std::min<size_t>(index->paths.size(), static_cast<size_t>(GetInt(f, "--files", 2000)));
  std::vector<std::vector<uint8_t>> bytes;
  for (size_t i = 0; i < files; ++i) bytes.push_back(ReadAll(index->paths[i * index->paths.size() / files]));
  const absl::Time start = absl::Now();
  for (const auto& b : bytes) {
    absl::StatusOr<server::Image> image = server::DecodeImage(b);
    if (!image.ok()) Die(image.status().ToString());
  }
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("{\"tool\":\"decode\",\"label\":\"libjpeg-turbo decode, one core\",\"images\":%zu,"
              "\"seconds\":%.3f,\"images_per_s\":%.1f,\"busy_cores\":1.0}\n",
              files, wall, files / wall);
  return 0;
}

#ifdef GPUFEED_WITH_CUDA

int Feed(const Flags& f) {
  client::AttachOptions o;
  o.socket = Get(f, "--socket");
  o.job = absl::StrCat("image_bench-", ::getpid());
  o.kind = "image_folder";
  o.dataset = Get(f, "--data");
  o.batch_size = GetInt(f, "--batch", 256);
  o.seed = 1;
  o.decode = Get(f, "--decode", "auto");
  o.augment = Get(f, "--augment", "auto");
  const std::string device = Get(f, "--device", "cuda:0");
  if (device != "host") {
    o.delivery = "device";
    o.gpu = device;
  }
  std::stringstream pipeline;
  pipeline << std::ifstream(Get(f, "--pipeline")).rdbuf();
  o.pipeline_json = pipeline.str();
  o.ring_slots = static_cast<int32_t>(GetInt(f, "--ring-slots", 4));
  const int64_t warmup = GetInt(f, "--warmup", 5);
  const double seconds = static_cast<double>(GetInt(f, "--seconds", 20));
  auto session = client::Session::Attach(o);
  if (!session.ok()) Die(session.status().ToString());
  cudaStream_t stream = nullptr;
  if (o.delivery == "device") {
    cudaSetDevice((*session)->info().gpu_ordinal);
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  const std::string label =
      Get(f, "--label", absl::StrCat("gpufeed ", (*session)->info().decode, " decode + ",
                                     (*session)->info().augment, " augment"));
  std::fprintf(stderr, "%s: attached (%s decode, %s augment, %s delivery)\n", label.c_str(),
               (*session)->info().decode.c_str(), (*session)->info().augment.c_str(),
               o.delivery.c_str());
  int64_t batches = 0, images = 0;
  absl::Time start, last = absl::Now();
  double busy0 = 0;
  while (true) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(120));
    if (!batch.ok()) Die(batch.status().ToString());
    if (absl::Status s = batch->WaitReady(stream); !s.ok()) Die(s.ToString());
    batch->Release(stream);
    ++batches;
    if (batches == warmup) {
      if (stream != nullptr) cudaStreamSynchronize(stream);
      start = absl::Now();
      busy0 = BusyCoreSeconds();
      continue;
    }
    if (batches < warmup) continue;
    images += batch->valid_count();
    const absl::Time now = absl::Now();
    if (now - last > absl::Seconds(2)) {
      last = now;
      std::fprintf(stderr, "%s: %ld images, %.0f images/s\n", label.c_str(), images,
                   images / absl::ToDoubleSeconds(now - start));
    }
    if (absl::ToDoubleSeconds(now - start) >= seconds) break;
  }
  if (stream != nullptr) cudaStreamSynchronize(stream);
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  const double cores = (BusyCoreSeconds() - busy0) / wall;
  std::printf("{\"tool\":\"feed\",\"label\":\"%s\",\"decode\":\"%s\",\"augment\":\"%s\","
              "\"delivery\":\"%s\",\"batch\":%ld,\"images\":%ld,\"seconds\":%.3f,"
              "\"images_per_s\":%.1f,\"busy_cores\":%.2f}\n",
              label.c_str(), (*session)->info().decode.c_str(),
              (*session)->info().augment.c_str(), o.delivery.c_str(), o.batch_size, images, wall,
              images / wall, cores);
  (void)(*session)->Detach();
  return 0;
}

int Nvjpeg(const Flags& f) {
  absl::StatusOr<server::ImageFolderIndex> index = server::IndexImageFolder(Get(f, "--data"));
  if (!index.ok()) Die(index.status().ToString());
  const char* library = std::getenv("GPUFEED_NVJPEG_LIBRARY");
  absl::StatusOr<server::nvjpeg::Api> loaded = server::nvjpeg::Load(library != nullptr ? library : "");
  if (!loaded.ok()) Die(loaded.status().ToString());
  const server::nvjpeg::Api* api = &*loaded;
  const int batch = static_cast<int>(GetInt(f, "--batch", 256));
  const double seconds = static_cast<double>(GetInt(f, "--seconds", 10));
  const std::string backend_name = Get(f, "--backend", "hardware");
  const int backend =
      backend_name == "hardware" ? server::nvjpeg::kHardware : server::nvjpeg::kGpuHybrid;
  // Files into one pinned buffer, as the daemon's staging slots are.
  const size_t files = std::min<size_t>(index->paths.size(), 20000);
  std::vector<std::vector<uint8_t>> bytes(files);
  std::vector<server::JpegHeader> headers(files);
  size_t total = 0;
  for (size_t i = 0; i < files; ++i) {
    bytes[i] = ReadAll(index->paths[i]);
    absl::StatusOr<server::JpegHeader> h = server::InspectJpeg(bytes[i]);
    if (!h.ok() || !h->gpu_decodable) Die(absl::StrCat(index->paths[i], ": not for nvJPEG"));
    headers[i] = *h;
    total += bytes[i].size();
  }
  unsigned char* pinned = nullptr;
  cudaHostAlloc(reinterpret_cast<void**>(&pinned), total, cudaHostAllocDefault);
  std::vector<const unsigned char*> data(files);
  std::vector<size_t> lengths(files);
  size_t max_decoded = 0;
  for (size_t i = 0, at = 0; i < files; ++i) {
    std::memcpy(pinned + at, bytes[i].data(), bytes[i].size());
    data[i] = pinned + at;
    lengths[i] = bytes[i].size();
    at += bytes[i].size();
    max_decoded = std::max<size_t>(max_decoded, static_cast<size_t>(headers[i].height) * headers[i].width * 3);
  }
  server::nvjpeg::Handle handle = nullptr;
  server::nvjpeg::State state = nullptr;
  const unsigned flags = static_cast<unsigned>(GetInt(f, "--flags", 0));
  const std::string format_name = Get(f, "--format", "rgbi");
  const std::map<std::string, int> formats = {{"unchanged", 0},
                                              {"yuv", 1},
                                              {"y", 2},
                                              {"rgb", 3},
                                              {"rgbi", server::nvjpeg::kRgbInterleaved}};
  if (formats.count(format_name) == 0) Die("--format: want rgbi, rgb, yuv, y or unchanged");
  const int format = formats.at(format_name);
  const bool planar = format != server::nvjpeg::kRgbInterleaved;
  const int64_t step_ms = GetInt(f, "--step-ms", 0);
  const bool trace = GetInt(f, "--trace", 0) != 0;
  const int vary = static_cast<int>(GetInt(f, "--vary", 0));
  if (vary < 0 || vary >= batch) Die("--vary: want 0 <= N < --batch");
  // --roi F (percent, 1-100; 0: off): each image decoded only in a centred box of F % of its
  // area (nvjpegDecodeBatchedEx with a region, as a random resized crop would ask): does a
  // smaller output cost a training process beside it less?
  const int roi = static_cast<int>(GetInt(f, "--roi", 0));
  if (roi < 0 || roi > 100) Die("--roi: want a percentage of the area, 0 (off) to 100");
  if (roi > 0 && api->DecodeBatchedEx == nullptr)
    Die("--roi: this nvJPEG has no nvjpegDecodeBatchedEx");
  const int chunk = static_cast<int>(GetInt(f, "--chunk", 0));
  if (chunk < 0 || chunk > batch) Die("--chunk: want 0 <= N <= --batch (0: one call a batch)");
  if (int rc = api->CreateEx(backend, nullptr, nullptr, flags, &handle); rc != 0) {
    Die(absl::StrCat("nvjpegCreateEx(", backend_name, "): ", server::nvjpeg::StatusName(rc)));
  }
  api->JpegStateCreate(handle, &state);
  unsigned engines = 0, cores = 0;
  api->GetHardwareDecoderInfo(handle, &engines, &cores);
  if (api->DecodeBatchedInitialize(handle, state, batch, 1, format) != 0) {
    Die("nvjpegDecodeBatchedInitialize failed");
  }
  unsigned char* out = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&out), max_decoded * static_cast<size_t>(batch));
  std::vector<server::nvjpeg::Image> images(static_cast<size_t>(batch));
  // --roi: each file's centred box and its decode parameters, made once.
  struct Box {
    int x, y, w, h;
  };
  std::vector<Box> boxes(files);
  std::vector<server::nvjpeg::DecodeParams> params(roi > 0 ? files : 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const double side = std::sqrt(roi / 100.0);
    Box& b = boxes[i];
    b.w = std::max(1, static_cast<int>(headers[i].width * side));
    b.h = std::max(1, static_cast<int>(headers[i].height * side));
    b.x = (headers[i].width - b.w) / 2;
    b.y = (headers[i].height - b.h) / 2;
    if (api->DecodeParamsCreate(handle, &params[i]) != 0 ||
        api->DecodeParamsSetOutputFormat(params[i], format) != 0 ||
        api->DecodeParamsSetROI(params[i], b.x, b.y, b.w, b.h) != 0) {
      Die("nvjpegDecodeParams for --roi failed");
    }
  }
  std::vector<server::nvjpeg::DecodeParams> round_params(static_cast<size_t>(batch));
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  int64_t decoded = 0, calls = 0;
  const bool sync = GetInt(f, "--sync", 0) != 0;
  // What the main thread is in, for the watchdog: a call of nvJPEG's that never returns (seen
  // on an H200 with 64- and 96-image calls back to back) is named, not waited for.
  static std::atomic<int64_t> in_call{-1}, in_since_ms{0}, in_images{0};
  static std::atomic<const char*> in_what{""};
  const int64_t stall_s = GetInt(f, "--stall-s", 10);
  auto now_ms = [] { return absl::ToUnixMillis(absl::Now()); };
  auto enter = [&](const char* what, int64_t images) {
    in_images = images;
    in_what = what;
    in_since_ms = now_ms();
    in_call = calls;
  };
  if (stall_s > 0) {
    std::thread([stall_s, now_ms] {
      for (;;) {
        absl::SleepFor(absl::Milliseconds(200));
        const int64_t call = in_call.load();
        if (call >= 0 && now_ms() - in_since_ms.load() > stall_s * 1000) {
          std::fprintf(stderr,
                       "image_bench: stalled: %s (call %ld, %ld images) has not returned "
                       "for %ld s\n",
                       in_what.load(), static_cast<long>(call), static_cast<long>(in_images.load()),
                       static_cast<long>(stall_s));
          std::fflush(stderr);
          std::_Exit(3);
        }
      }
    }).detach();
  }
  size_t next = 0;
  absl::Time start = absl::Now();
  double busy0 = BusyCoreSeconds();
  int initialized = batch;
  absl::Time last_progress = absl::Now();
  for (int round = 0;; ++round) {
    const int n = batch - (round % 2) * vary;
    std::vector<const unsigned char*> d(static_cast<size_t>(n));
    std::vector<size_t> l(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i, next = (next + 1) % files) {
      d[i] = data[next];
      l[i] = lengths[next];
      images[i] = {};
      unsigned char* base = out + static_cast<size_t>(i) * max_decoded;
      size_t w = static_cast<size_t>(headers[next].width);
      if (roi > 0) {
        round_params[i] = params[next];
        w = static_cast<size_t>(boxes[next].w);
      }
      if (planar) {  // three planes of the full size: room for any subsampling
        const size_t plane = w * static_cast<size_t>(headers[next].height);
        for (int c = 0; c < 3; ++c) {
          images[i].channel[c] = base + c * plane;
          images[i].pitch[c] = w;
        }
      } else {
        images[i].channel[0] = base;
        images[i].pitch[0] = w * 3;
      }
    }
    // One call a batch, or (--chunk) calls of at most `chunk` images, the decoder
    // re-initialised whenever a call's size differs from the last one's.
    for (int at = 0; at < n;) {
      const int m = chunk > 0 ? std::min(chunk, n - at) : n;
      if (m != initialized) {
        enter("nvjpegDecodeBatchedInitialize", m);
        if (api->DecodeBatchedInitialize(handle, state, m, 1, format) != 0) {
          Die("nvjpegDecodeBatchedInitialize failed");
        }
        initialized = m;
      }
      enter("nvjpegDecodeBatched", m);
      if (int rc = roi > 0
                       ? api->DecodeBatchedEx(handle, state, d.data() + at, l.data() + at,
                                              images.data() + at, round_params.data() + at, stream)
                       : api->DecodeBatched(handle, state, d.data() + at, l.data() + at,
                                            images.data() + at, stream);
          rc != 0) {
        Die(absl::StrCat("nvjpegDecodeBatched: ", server::nvjpeg::StatusName(rc)));
      }
      if (sync) {
        enter("cudaStreamSynchronize after nvjpegDecodeBatched", m);
        cudaStreamSynchronize(stream);
      }
      in_call = -1;
      ++calls;
      at += m;
    }
    if (absl::Now() - last_progress >= absl::Seconds(1)) {  // a stall shows as silence
      last_progress = absl::Now();
      std::fprintf(stderr, "nvjpeg: round %d, %ld images, %.1f s\n", round, decoded,
                   absl::ToDoubleSeconds(last_progress - start));
    }
    if (trace) {
      cudaStreamSynchronize(stream);
      std::fprintf(stderr, "batch %d\n", round);
    }
    if (step_ms > 0) {  // the consumer's pace: batch k starts at start + k * step
      const absl::Time due = start + absl::Milliseconds(step_ms * (round > 2 ? round - 2 : 0));
      if (due > absl::Now()) absl::SleepFor(due - absl::Now());
    }
    if (round == 2) {  // warm-up done
      enter("cudaStreamSynchronize after the warm-up", 0);
      cudaStreamSynchronize(stream);
      in_call = -1;
      start = absl::Now();
      busy0 = BusyCoreSeconds();
      decoded = 0;
      continue;
    }
    decoded += n;
    if (round > 2 && absl::ToDoubleSeconds(absl::Now() - start) >= seconds) break;
  }
  cudaStreamSynchronize(stream);
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  const double busy = (BusyCoreSeconds() - busy0) / wall;
  std::printf(
      "{\"tool\":\"nvjpeg\",\"label\":\"nvJPEG %s batched decode alone%s\",\"backend\":\"%s\","
      "\"format\":\"%s\",\"step_ms\":%ld,\"vary\":%d,\"chunk\":%d,\"sync\":%d,\"roi\":%d,\"calls\":"
      "%ld,"
      "\"engines\":%u,\"batch\":%d,\"files\":%zu,\"images\":%ld,\"seconds\":%.3f,"
      "\"images_per_s\":%.1f,\"busy_cores\":%.2f}\n",
      backend_name.c_str(),
      (flags != 0 ? " (flags " + std::to_string(flags) + ")" : std::string()).c_str(),
      backend_name.c_str(), format_name.c_str(), static_cast<long>(step_ms), vary, chunk,
      sync ? 1 : 0, roi, static_cast<long>(calls), engines, batch, files, decoded, wall,
      decoded / wall, busy);
  return 0;
}

#endif  // GPUFEED_WITH_CUDA

}  // namespace
}  // namespace gpufeed

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const gpufeed::Flags flags = gpufeed::ParseFlags(argc, argv);
  if (command == "crop") return gpufeed::Crop(flags);
  if (command == "decode") return gpufeed::Decode(flags);
#ifdef GPUFEED_WITH_CUDA
  if (command == "feed") return gpufeed::Feed(flags);
  if (command == "nvjpeg") return gpufeed::Nvjpeg(flags);
#endif
  std::fprintf(stderr, "usage: image_bench feed|nvjpeg|crop|decode --flag value ... (see the source's "
                       "first comment)\n");
  return 2;
}
