// How long a training job pauses when gpufeedd restarts, on this machine.
//
//   restart_bench [--restarts N] [--ranks R] [--step-ms MS]
//
// R ranks of one job (threads of this process, the C++ client, host delivery, tokens) consume
// without end, MS milliseconds a batch as a training step would. gpufeedd is stopped N times
// each way (SIGKILL; SIGTERM; `gpufeedctl drain --timeout 300ms`, which ends the streams when
// it times out) and started again at once on the same socket. Per restart it measures:
//   pause:       the longest time any rank went without a batch, from the fault until every
//                rank had one from the new daemon (what the job sees; it includes the step);
//   after ready: from the new daemon answering to the last rank's first batch from it.
// It checks that every rank's batches stay contiguous (no step lost, none twice), prints a
// table of p50 / max per fault and one JSON line. The daemon's start-up is inside the pause;
// a supervisor's restart delay (systemd's RestartSec) would add to it. Not a timed test.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gpufeed/client.h"
#include "tests/integration/harness.h"

namespace gt = gpufeed::testing;
namespace gc = gpufeed::client;

namespace {

struct Arrival {
  absl::Time at;
  int64_t epoch;
  int64_t step;
};

class Rank {
 public:
  Rank(const std::string& socket, const std::string& dataset, int rank, int world,
       absl::Duration step)
      : step_(step) {
    gc::AttachOptions o;
    o.socket = socket;
    o.job = "bench";
    o.rank = rank;
    o.world_size = world;
    o.dataset = dataset;
    o.seq_len = 16;
    o.batch_size = 4;
    o.ring_slots = 4;
    auto session = gc::Session::Attach(o);
    if (!session.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, session.status().ToString().c_str());
      std::exit(1);
    }
    session_ = std::move(*session);
    steps_per_epoch_ = session_->info().steps_per_epoch;
    thread_ = std::thread([this] { Run(); });
  }
  ~Rank() {
    stop_ = true;
    thread_.join();
  }

  // Arrivals after `from`; the first's time (InfiniteFuture when none yet).
  absl::Time FirstAfter(absl::Time from) const {
    absl::MutexLock lock(&mu_);
    for (const Arrival& a : arrivals_) {
      if (a.at > from) return a.at;
    }
    return absl::InfiniteFuture();
  }
  // The longest gap between arrivals (or from `from`) up to `to`.
  absl::Duration LongestGap(absl::Time from, absl::Time to) const {
    absl::MutexLock lock(&mu_);
    absl::Time last = absl::InfinitePast();
    absl::Duration longest = absl::ZeroDuration();
    for (const Arrival& a : arrivals_) {
      if (a.at <= from) {
        last = a.at;
        continue;
      }
      if (a.at > to) break;
      if (last != absl::InfinitePast()) longest = std::max(longest, a.at - last);
      last = a.at;
    }
    return longest;
  }
  // Every batch the step after the one before it: nothing lost, nothing twice.
  bool Contiguous() const {
    absl::MutexLock lock(&mu_);
    for (size_t i = 1; i < arrivals_.size(); ++i) {
      const int64_t prev = arrivals_[i - 1].epoch * steps_per_epoch_ + arrivals_[i - 1].step;
      if (arrivals_[i].epoch * steps_per_epoch_ + arrivals_[i].step != prev + 1) return false;
    }
    return !arrivals_.empty();
  }
  bool failed() const { return failed_; }

 private:
  void Run() {
    while (!stop_) {
      absl::StatusOr<gc::Batch> b = session_->Next(absl::Milliseconds(200));
      if (absl::IsDeadlineExceeded(b.status())) continue;
      if (!b.ok()) {
        std::fprintf(stderr, "rank: %s\n", b.status().ToString().c_str());
        failed_ = true;
        return;
      }
      {
        absl::MutexLock lock(&mu_);
        arrivals_.push_back({absl::Now(), b->epoch(), b->step()});
      }
      absl::SleepFor(step_);  // the training step, holding the batch
    }
  }

  const absl::Duration step_;
  std::unique_ptr<gc::Session> session_;
  int64_t steps_per_epoch_ = 1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  mutable absl::Mutex mu_;
  std::vector<Arrival> arrivals_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  int restarts = 20, ranks = 3;
  int64_t step_ms = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--restarts") == 0) restarts = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--step-ms") == 0) step_ms = std::atoll(argv[i + 1]);
  }
  gt::TempDir dir;
  const std::string dataset = dir.Join("tokens.bin");
  gt::WriteTokens(dataset, 1 << 20);
  struct Row {
    const char* fault;
    std::vector<double> pause_ms, after_ready_ms;
    bool exact = true;
  };
  std::vector<Row> rows = {{"SIGKILL", {}, {}}, {"SIGTERM", {}, {}}, {"drain 300ms", {}, {}}};
  for (size_t kind = 0; kind < rows.size(); ++kind) {
    auto daemon = std::make_unique<gt::Daemon>(dir);
    if (!daemon->ready()) {
      std::fprintf(stderr, "gpufeedd did not start: %s\n", daemon->process().Stderr().c_str());
      return 1;
    }
    std::vector<std::unique_ptr<Rank>> consumers;
    for (int r = 0; r < ranks; ++r) {
      consumers.push_back(std::make_unique<Rank>(daemon->socket(), dataset, r, ranks,
                                                 absl::Milliseconds(step_ms)));
    }
    for (int i = 0; i < restarts; ++i) {
      absl::SleepFor(absl::Milliseconds(300));  // streaming
      const absl::Time fault = absl::Now();
      if (kind == 2) {
        gt::CtlResult drained = gt::RunCtl(daemon->socket(), {"drain", "--timeout", "300ms"},
                                           dir.Join("drain"));
        if (drained.exit_code != 0) {
          std::fprintf(stderr, "drain: %s\n", drained.err.c_str());
          return 1;
        }
      } else {
        daemon->process().Kill(kind == 0 ? SIGKILL : SIGTERM);
      }
      if (daemon->process().Wait(absl::Seconds(30)) == -1) {
        std::fprintf(stderr, "gpufeedd did not exit\n");
        return 1;
      }
      daemon = std::make_unique<gt::Daemon>(dir);
      const absl::Time ready = absl::Now();
      absl::Time resumed = ready;
      for (const auto& c : consumers) {
        while (c->FirstAfter(ready) == absl::InfiniteFuture() && !c->failed()) {
          absl::SleepFor(absl::Milliseconds(1));
        }
        if (c->failed()) return 1;
        resumed = std::max(resumed, c->FirstAfter(ready));
      }
      absl::Duration pause = absl::ZeroDuration();
      for (const auto& c : consumers) pause = std::max(pause, c->LongestGap(fault, resumed));
      rows[kind].pause_ms.push_back(absl::ToDoubleMilliseconds(pause));
      rows[kind].after_ready_ms.push_back(absl::ToDoubleMilliseconds(resumed - ready));
      std::fprintf(stderr, "%s %d/%d: pause %.0f ms, %.0f ms after the new daemon answered\n",
                   rows[kind].fault, i + 1, restarts, rows[kind].pause_ms.back(),
                   rows[kind].after_ready_ms.back());
    }
    for (const auto& c : consumers) rows[kind].exact = rows[kind].exact && c->Contiguous();
    consumers.clear();
  }
  std::printf("\nrestart pause, %d ranks, %lld ms steps, %d restarts each, restarted at once\n\n",
              ranks, static_cast<long long>(step_ms), restarts);
  std::printf("| fault | pause p50 | pause max | after ready p50 | after ready max | exact |\n");
  std::printf("|---|---:|---:|---:|---:|---|\n");
  std::string json = absl::StrCat("{\"bench\":\"restart\",\"ranks\":", ranks,
                                  ",\"step_ms\":", step_ms, ",\"restarts\":", restarts);
  bool all_exact = true;
  for (const Row& r : rows) {
    std::printf("| %s | %.0f ms | %.0f ms | %.0f ms | %.0f ms | %s |\n", r.fault,
                gt::Percentile(r.pause_ms, 0.5), gt::Percentile(r.pause_ms, 1.0),
                gt::Percentile(r.after_ready_ms, 0.5), gt::Percentile(r.after_ready_ms, 1.0),
                r.exact ? "yes" : "NO");
    absl::StrAppendFormat(&json,
                          ",\"%s\":{\"pause_p50_ms\":%.0f,\"pause_max_ms\":%.0f,"
                          "\"after_ready_p50_ms\":%.0f,\"after_ready_max_ms\":%.0f,"
                          "\"exact\":%s}",
                          std::string(r.fault).substr(0, std::string(r.fault).find(' ')),
                          gt::Percentile(r.pause_ms, 0.5), gt::Percentile(r.pause_ms, 1.0),
                          gt::Percentile(r.after_ready_ms, 0.5),
                          gt::Percentile(r.after_ready_ms, 1.0), r.exact ? "true" : "false");
    all_exact = all_exact && r.exact;
  }
  std::printf("\n%s}\n", json.c_str());
  return all_exact ? 0 : 1;
}
