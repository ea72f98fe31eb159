// Helpers for integration tests: a temp dir, child processes, the real gpufeedd on a socket
// in the temp dir, gpufeedctl runs, and independent reference computations.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::testing {

// A child process with stdout and stderr captured into files.
class Subprocess {
 public:
  Subprocess(const std::vector<std::string>& argv, const std::string& out_prefix);
  ~Subprocess();  // kills it if still running
  pid_t pid() const { return pid_; }
  // Exit code, 128+signal when killed, -1 on timeout (the child keeps running).
  int Wait(absl::Duration timeout = absl::Seconds(60));
  bool Running();
  void Kill(int signal);
  std::string Stdout() const;
  std::string Stderr() const;

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  bool done_ = false;
  std::string out_, err_;
};

struct CtlResult {
  int exit_code;
  std::string out;
  std::string err;
};

class Daemon {
 public:
  // Starts gpufeedd on dir/gf.sock and waits until it answers.
  Daemon(const TempDir& dir, std::vector<std::string> extra_flags = {});
  ~Daemon();
  const std::string& socket() const { return socket_; }
  Subprocess& process() { return *process_; }
  bool ready() const { return ready_; }

 private:
  std::string socket_;
  std::unique_ptr<Subprocess> process_;
  bool ready_ = false;
};

std::string GpufeeddPath();
std::string GpufeedctlPath();

// Runs gpufeedctl --socket SOCKET ARGS... to completion.
CtlResult RunCtl(const std::string& socket, const std::vector<std::string>& args,
                 const std::string& out_prefix);
std::vector<std::string> CtlArgv(const std::string& socket, const std::vector<std::string>& args);

// Whether the daemon on `socket` lists a session of `job` ("": any job) that has delivered at
// least `batches` batches: what a test polls (tests/testing/eventually.h) before it relies on
// a consumer having attached, instead of sleeping.
bool JobHasDelivered(const std::string& socket, const std::string& job, int64_t batches = 1);

// Writes `count` uint16 tokens, token k = (k * 7 + 3) % 65521, and returns them.
std::vector<uint16_t> WriteTokens(const std::string& path, size_t count);

struct IdsLine {
  int rank = 0;
  int64_t epoch = 0;
  int64_t step = 0;
  std::vector<int64_t> ids;
  int64_t valid = 0;
};
// Parses the --ids file of gpufeedctl consume.
std::vector<IdsLine> ReadIdsFile(const std::string& path);

// The checksum gpufeedctl prints, computed independently from the file's tokens.
uint64_t TokensChecksum(const std::vector<uint16_t>& tokens, int64_t seq_len,
                        const std::vector<IdsLine>& lines);

// The integer value of "key": in a one-line JSON object; -1 when absent.
int64_t JsonInt(const std::string& json, const std::string& key);
std::string ReadFile(const std::string& path);

// The p-quantile (0 <= p <= 1) of `v`, nearest rank; `v` must not be empty.
double Percentile(std::vector<double> v, double p);

// A TCP port nobody listens on now (for --metrics_listen, --health_listen).
int FreePort();
// GET http://127.0.0.1:PORT/PATH; the body, or "" on failure.
std::string HttpGet(int port, const std::string& path);
// The value of the Prometheus sample `series` (name with labels, exactly as exposed) in
// `text`; -1 when absent.
double Sample(const std::string& text, const std::string& series);

}  // namespace gpufeed::testing
