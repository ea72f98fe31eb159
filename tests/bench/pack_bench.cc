// Document packing and blend order: what best_fit saves against concat, and how fast both are.
//
//   pack_bench [documents] [seq_len]
//
// Document lengths are log-normal (median 400 tokens, sigma 1.3, seed 1: web text's heavy
// tail). Prints a table (padding, truncated documents, dropped tokens, rows per second) of
// concat and of best_fit at several lookaheads, the blend's picks per second (sequential Fill
// and random At), and one JSON line. Not a timed test: CI does not gate on it.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "server/sampler/blend.h"
#include "server/sampler/pack.h"

namespace {

using gpufeed::server::Blend;
using gpufeed::server::BlendPick;
using gpufeed::server::BlendSegment;
using gpufeed::server::BlendSpec;
using gpufeed::server::MeasurePacking;
using gpufeed::server::Packing;
using gpufeed::server::PackStats;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

struct Row {
  std::string name;
  PackStats stats;
  double rows_per_s;
};

}  // namespace

int main(int argc, char** argv) {
  const size_t documents = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 200000;
  const uint64_t seq_len = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2048;
  std::mt19937_64 random(1);
  std::lognormal_distribution<double> length(std::log(400.0), 1.3);
  std::vector<uint64_t> lengths;
  uint64_t tokens = 0;
  for (size_t i = 0; i < documents; ++i) {
    lengths.push_back(static_cast<uint64_t>(std::ceil(length(random))));
    tokens += lengths.back();
  }

  std::vector<Row> rows;
  auto run = [&](const std::string& name, auto pack) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<Packing> packing = pack();
    const double seconds = Seconds(t0);
    if (!packing.ok()) {
      absl::FPrintF(stderr, "%s: %s\n", name, packing.status().ToString());
      std::exit(1);
    }
    rows.push_back(Row{name, MeasurePacking(*packing, lengths),
                       static_cast<double>(packing->rows()) / seconds});
  };
  run("concat", [&] { return gpufeed::server::PackConcat(lengths, seq_len); });
  for (uint64_t lookahead : {64, 256, 1024, 4096}) {
    run(absl::StrFormat("best_fit lookahead %d", lookahead),
        [&] { return gpufeed::server::PackBestFit(lengths, seq_len, lookahead); });
  }

  // The blend order: 3 sources 0.5/0.3/0.2, 10M picks in batches of 4096, then random At.
  BlendSpec spec;
  spec.sizes = {40000000, 25000000, 9000000};
  spec.segments.push_back(BlendSegment{0, {0.5, 0.3, 0.2}, {0, 0, 0}});
  auto blend = Blend::Create(spec);
  if (!blend.ok()) return 1;
  const uint64_t picks = 10000000;
  std::vector<BlendPick> batch(4096);
  uint64_t sink = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (uint64_t first = 0; first < picks; first += batch.size()) {
    (*blend)->Fill(first, batch);
    sink += batch.back().id;
  }
  const double fill_rate = static_cast<double>(picks) / Seconds(t0);
  t0 = std::chrono::steady_clock::now();
  const int lookups = 2000;
  for (int i = 0; i < lookups; ++i) sink += (*blend)->At(random() % picks).id;
  const double at_rate = lookups / Seconds(t0);

  absl::PrintF("pack_bench: %d documents, %d tokens (mean %.0f), seq_len %d (checksum %d)\n",
               documents, tokens, static_cast<double>(tokens) / documents, seq_len, sink % 1000);
  absl::PrintF("%-26s %10s %10s %12s %10s %10s %12s\n", "packing", "rows", "padding",
               "truncated", "dropped", "pad+trunc", "rows/s");
  std::string json = absl::StrFormat("{\"bench\":\"pack\",\"documents\":%d,\"seq_len\":%d",
                                     documents, seq_len);
  for (const Row& row : rows) {
    absl::PrintF("%-26s %10d %9.2f%% %11.2f%% %9.3f%% %9.2f%% %12.0f\n", row.name,
                 row.stats.rows, 100 * row.stats.padding_fraction(),
                 100 * row.stats.truncation_fraction(), 100 * row.stats.dropped_fraction(),
                 100 * (row.stats.padding_fraction() + row.stats.truncation_fraction()),
                 row.rows_per_s);
    std::string key = row.name;
    for (char& c : key) c = c == ' ' ? '_' : c;
    absl::StrAppendFormat(&json,
                          ",\"%s\":{\"rows\":%d,\"padding\":%.5f,\"truncated\":%.5f,"
                          "\"dropped\":%.6f,\"rows_per_s\":%.0f}",
                          key, row.stats.rows, row.stats.padding_fraction(),
                          row.stats.truncation_fraction(), row.stats.dropped_fraction(),
                          row.rows_per_s);
  }
  absl::PrintF("%-26s %12.1f M picks/s\n", "blend Fill (3 sources)", fill_rate / 1e6);
  absl::PrintF("%-26s %12.0f picks/s (replays up to %d samples)\n", "blend At (random)",
               at_rate, Blend::kSnapshotInterval);
  absl::StrAppendFormat(&json, ",\"blend_fill_picks_per_s\":%.0f,\"blend_at_per_s\":%.0f}\n",
                        fill_rate, at_rate);
  absl::PrintF("%s", json);
  return 0;
}
