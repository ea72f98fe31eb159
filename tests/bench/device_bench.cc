// gpufeed device-delivery benchmark, for the GPU machine (one call of
// .ci/device/run_on_device.sh). Prints a table and one JSON line:
//  (a) the limit: cudaMemcpyAsync host->device from pinned memory, batch-sized copies;
//  (b) gpufeed device delivery of a records dataset of uint8 rows 3x224x224 (B=256, 38.5 MB a
//      batch, a file of --gb GB in the page cache) to one consumer process (gpufeedctl
//      consume --device) that only waits and releases: GB/s, batches/s, daemon CPU %;
//  (d) ready-to-usable latency in the consumer's stream: from Next() returning to the
//      batch's ready event completing in the consumer's stream, p50/p99 over --latency-batches
//      batches (B=64), with a simulated 2 ms training step so the ring runs ahead as in
//      training. (c), torch's DataLoader on the same file, is tests/bench/torch_loader_bench.py.
//
//   device_bench [--gb 4] [--batches 300] [--latency-batches 10000] [--dataset PATH]
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gpufeed/client.h"
#include "tests/integration/harness.h"

namespace gt = gpufeed::testing;

namespace {

constexpr uint64_t kRow = 3 * 224 * 224;

// A .npy of `rows` uint8 rows of shape (3, 224, 224).
void WriteRecords(const std::string& path, uint64_t rows) {
  std::string header = absl::StrFormat(
      "{'descr': '|u1', 'fortran_order': False, 'shape': (%d, 3, 224, 224), }", rows);
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out << header;
  std::vector<char> chunk(kRow * 64);
  for (uint64_t r = 0; r < rows; r += 64) {
    const uint64_t n = std::min<uint64_t>(64, rows - r);
    for (uint64_t i = 0; i < n * kRow; i += 4096) chunk[i] = static_cast<char>((r * kRow + i) * 7);
    out.write(chunk.data(), static_cast<std::streamsize>(n * kRow));
  }
}

double CopyLimit(uint64_t bytes) {
  void* host = nullptr;
  void* dev = nullptr;
  cudaHostAlloc(&host, bytes, cudaHostAllocDefault);
  cudaMalloc(&dev, bytes);
  std::memset(host, 1, bytes);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s);
  cudaEventRecord(a, s);
  const int n = 50;
  for (int i = 0; i < n; ++i) cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s);
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaFree(dev);
  cudaFreeHost(host);
  return n * static_cast<double>(bytes) / (ms / 1e3);
}

double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string field;
  double ticks = 0;
  for (int i = 1; i <= 15 && in >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace

int main(int argc, char** argv) {
  double gb = 4;
  int64_t batches = 300, latency_batches = 10000;
  std::string dataset;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--gb") gb = std::stod(argv[i + 1]);
    if (flag == "--batches") batches = std::stol(argv[i + 1]);
    if (flag == "--latency-batches") latency_batches = std::stol(argv[i + 1]);
    if (flag == "--dataset") dataset = argv[i + 1];
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "device_bench: no CUDA device\n");
    return 1;
  }
  gt::TempDir dir;
  const uint64_t rows = static_cast<uint64_t>(gb * 1e9 / kRow);
  if (dataset.empty()) {
    dataset = dir.Join("records.npy");
    std::fprintf(stderr, "writing %lu rows (%.1f GB) to %s...\n", rows, rows * kRow / 1e9, dataset.c_str());
    WriteRecords(dataset, rows);
  }
  const uint64_t batch_bytes = 256 * kRow;
  const double limit = CopyLimit(batch_bytes);

  // Every core reads: --threads=0 (one per core) overrides the harness's 2.
  gt::Daemon daemon(dir, {"--staging_bytes=4294967296", "--device_bytes=17179869184", "--threads=0"});
  if (!daemon.ready()) {
    std::fprintf(stderr, "gpufeedd did not start: %s\n", daemon.process().Stderr().c_str());
    return 1;
  }
  // Warm the page cache with one pass (host delivery, no shuffle).
  gt::RunCtl(daemon.socket(), {"consume", "--job", "warm", "--kind", "records", "--dataset", dataset,
                               "--batch-size", "256", "--no-shuffle"},
             dir.Join("warm"));

  // (b) device delivery to one consumer that only waits and releases.
  const double cpu0 = CpuSeconds(daemon.process().pid());
  const absl::Time t0 = absl::Now();
  gt::CtlResult b = gt::RunCtl(daemon.socket(),
                               {"consume", "--job", "b", "--kind", "records", "--dataset", dataset,
                                "--batch-size", "256", "--ring-slots", "8", "--epochs", "0",
                                "--max-batches", absl::StrCat(batches), "--device", "cuda:0",
                                "-o", "json"},
                               dir.Join("b"));
  const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
  const double cpu = CpuSeconds(daemon.process().pid()) - cpu0;
  if (b.exit_code != 0) {
    std::fprintf(stderr, "consumer failed: %s\n", b.err.c_str());
    return 1;
  }
  const size_t at = b.out.find("\"bytes_per_s\":");
  const size_t bt = b.out.find("\"batches_per_s\":");
  const double bytes_per_s = std::stod(b.out.substr(at + 14));
  const double batches_per_s = std::stod(b.out.substr(bt + 16));

  // (d) ready-to-usable latency, in this process.
  gpufeed::client::AttachOptions o;
  o.socket = daemon.socket();
  o.job = "latency";
  o.kind = "records";
  o.dataset = dataset;
  o.batch_size = 64;
  o.ring_slots = 8;
  o.delivery = "device";
  o.gpu = "cuda:0";
  auto session = gpufeed::client::Session::Attach(o);
  if (!session.ok()) {
    std::fprintf(stderr, "latency attach: %s\n", session.status().ToString().c_str());
    return 1;
  }
  cudaSetDevice(0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEvent_t usable;
  cudaEventCreateWithFlags(&usable, cudaEventDisableTiming);  // spin: no wake-up latency
  std::vector<double> us, settled_us;
  for (int64_t i = 0; i < latency_batches; ++i) {
    auto batch = (*session)->Next(absl::Seconds(30));
    if (!batch.ok()) break;
    // Every 10th batch: wait 2 ms first, so the copy has surely finished and only the cost
    // of waiting on a completed interprocess event remains.
    const bool settle = i % 10 == 9;
    if (settle) absl::SleepFor(absl::Milliseconds(2));
    const absl::Time got = absl::Now();
    if (!batch->WaitReady(stream).ok()) break;
    cudaEventRecord(usable, stream);
    cudaEventSynchronize(usable);
    (settle ? settled_us : us).push_back(absl::ToDoubleMicroseconds(absl::Now() - got));
    batch->Release(stream);
    absl::SleepFor(absl::Milliseconds(2));  // the training step
  }
  // The floor of this measurement: the same three calls on a local event that completed long
  // ago, so what remains is the cost of asking, not waiting.
  std::vector<double> floor_us;
  {
    cudaEvent_t local;
    cudaEventCreateWithFlags(&local, cudaEventDisableTiming);
    cudaEventRecord(local, stream);
    cudaEventSynchronize(local);
    for (int i = 0; i < 1000; ++i) {
      const absl::Time t = absl::Now();
      cudaStreamWaitEvent(stream, local, 0);
      cudaEventRecord(usable, stream);
      cudaEventSynchronize(usable);
      floor_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    }
    std::sort(floor_us.begin(), floor_us.end());
  }
  std::sort(us.begin(), us.end());
  std::sort(settled_us.begin(), settled_us.end());
  const double p50 = us.empty() ? -1 : us[us.size() / 2];
  const double p99 = us.empty() ? -1 : us[us.size() * 99 / 100];

  std::printf("\ngpufeed device_bench (records uint8 3x224x224, B=256 = %.1f MB a batch, %.1f GB file)\n\n",
              batch_bytes / 1e6, rows * kRow / 1e9);
  std::printf("| measure | value |\n|---|---|\n");
  std::printf("| (a) cudaMemcpyAsync H2D, pinned, %.1f MB copies | %.2f GB/s |\n", batch_bytes / 1e6, limit / 1e9);
  std::printf("| (b) gpufeed device delivery, 1 consumer | %.2f GB/s, %.1f batches/s (%.0f%% of (a)) |\n",
              bytes_per_s / 1e9, batches_per_s, 100 * bytes_per_s / limit);
  std::printf("| (b) daemon CPU | %.0f%% of one core (%.1f s CPU in %.1f s) |\n", 100 * cpu / wall, cpu, wall);
  std::printf("| (d) ready-to-usable latency, B=64, %zu batches | p50 %.1f us, p99 %.1f us |\n", us.size(), p50, p99);
  if (!settled_us.empty()) {
    std::printf("| (d) the same, 2 ms after Next (copy surely done), %zu batches | p50 %.1f us, p99 %.1f us |\n",
                settled_us.size(), settled_us[settled_us.size() / 2],
                settled_us[settled_us.size() * 99 / 100]);
  }
  std::printf("| (d) floor: the same calls on a long-completed local event | p50 %.1f us, p99 %.1f us |\n",
              floor_us[floor_us.size() / 2], floor_us[floor_us.size() * 99 / 100]);
  std::printf("\n{\"bench\":\"device_bench\",\"batch_bytes\":%lu,\"copy_limit_bytes_per_s\":%.0f,"
              "\"delivery_bytes_per_s\":%.0f,\"delivery_batches_per_s\":%.2f,\"daemon_cpu_pct\":%.1f,"
              "\"latency_p50_us\":%.1f,\"latency_p99_us\":%.1f,\"latency_batches\":%zu}\n",
              batch_bytes, limit, bytes_per_s, batches_per_s, 100 * cpu / wall, p50, p99, us.size());
  return 0;
}
