#include "tests/integration/harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gpufeed/client.h"

extern char** environ;

namespace gpufeed::testing {

Subprocess::Subprocess(const std::vector<std::string>& argv, const std::string& out_prefix)
    : out_(out_prefix + ".out"), err_(out_prefix + ".err") {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&actions);
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !done_) {
    ::kill(pid_, SIGKILL);
    Wait(absl::Seconds(10));
  }
}

int Subprocess::Wait(absl::Duration timeout) {
  if (pid_ <= 0) return -1;
  const absl::Time deadline = absl::Now() + timeout;
  while (!done_) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      done_ = true;
      status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return status_;
}

bool Subprocess::Running() {
  if (done_) return false;
  return Wait(absl::ZeroDuration()) == -1;
}

void Subprocess::Kill(int signal) {
  if (pid_ > 0 && !done_) ::kill(pid_, signal);
}

std::string Subprocess::Stdout() const { return ReadFile(out_); }
std::string Subprocess::Stderr() const { return ReadFile(err_); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The build's binaries, unless the environment names others (a bundle on the GPU machine).
std::string GpufeeddPath() {
  const char* env = std::getenv("GPUFEEDD");
  return env != nullptr && *env != '\0' ? env : GPUFEEDD_PATH;
}
std::string GpufeedctlPath() {
  const char* env = std::getenv("GPUFEEDCTL");
  return env != nullptr && *env != '\0' ? env : GPUFEEDCTL_PATH;
}

Daemon::Daemon(const TempDir& dir, std::vector<std::string> extra_flags)
    : socket_(dir.Join("gf.sock")) {
  std::vector<std::string> argv = {GpufeeddPath(), "--listen=unix://" + socket_,
                                   "--staging_bytes=67108864", "--threads=2"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  process_ = std::make_unique<Subprocess>(argv, dir.Join("gpufeedd"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline && process_->Running()) {
    auto admin = client::AdminClient::Connect(socket_, absl::Seconds(1));
    if (admin.ok() && (*admin)->GetStatus().ok()) {
      ready_ = true;
      return;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

Daemon::~Daemon() {
  process_->Kill(SIGTERM);
  if (process_->Wait(absl::Seconds(10)) == -1) process_->Kill(SIGKILL);
}

std::vector<std::string> CtlArgv(const std::string& socket, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {GpufeedctlPath(), "--socket", socket};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

CtlResult RunCtl(const std::string& socket, const std::vector<std::string>& args,
                 const std::string& out_prefix) {
  Subprocess p(CtlArgv(socket, args), out_prefix);
  const int code = p.Wait(absl::Seconds(120));
  return {code, p.Stdout(), p.Stderr()};
}

bool JobHasDelivered(const std::string& socket, const std::string& job, int64_t batches) {
  auto admin = client::AdminClient::Connect(socket, absl::Seconds(1));
  if (!admin.ok()) return false;
  auto sessions = (*admin)->ListSessions();
  if (!sessions.ok()) return false;
  return std::any_of(sessions->begin(), sessions->end(), [&](const client::SessionSummary& s) {
    return (job.empty() || s.job == job) && s.batches_delivered >= batches;
  });
}

std::vector<uint16_t> WriteTokens(const std::string& path, size_t count) {
  std::vector<uint16_t> tokens(count);
  for (size_t k = 0; k < count; ++k) tokens[k] = static_cast<uint16_t>((k * 7 + 3) % 65521);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!tokens.empty()) std::fwrite(tokens.data(), sizeof(uint16_t), tokens.size(), f);
  std::fclose(f);
  return tokens;
}

int64_t JsonInt(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  const size_t at = json.find(needle);
  if (at == std::string::npos) return -1;
  size_t end = at + needle.size();
  while (end < json.size() && (std::isdigit(static_cast<unsigned char>(json[end])) || json[end] == '-')) ++end;
  int64_t v = -1;
  if (!absl::SimpleAtoi(json.substr(at + needle.size(), end - at - needle.size()), &v)) return -1;
  return v;
}

std::vector<IdsLine> ReadIdsFile(const std::string& path) {
  std::vector<IdsLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    IdsLine l;
    l.rank = static_cast<int>(JsonInt(line, "rank"));
    l.epoch = JsonInt(line, "epoch");
    l.step = JsonInt(line, "step");
    l.valid = JsonInt(line, "valid");
    const size_t open = line.find("\"ids\":[");
    const size_t close = line.find(']', open);
    const std::string list = line.substr(open + 7, close - open - 7);
    for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      int64_t id;
      if (absl::SimpleAtoi(item, &id)) l.ids.push_back(id);
    }
    out.push_back(std::move(l));
  }
  return out;
}

uint64_t TokensChecksum(const std::vector<uint16_t>& tokens, int64_t seq_len,
                        const std::vector<IdsLine>& lines) {
  uint64_t sum = 0;
  for (const IdsLine& l : lines) {
    for (int64_t r = 0; r < l.valid; ++r) {
      const size_t first = static_cast<size_t>(l.ids[static_cast<size_t>(r)] * seq_len);
      for (int64_t j = 0; j <= seq_len; ++j) {
        sum += static_cast<uint64_t>(j + 1) * tokens[first + static_cast<size_t>(j)];
      }
    }
  }
  return sum;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5)];
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  (void)!::write(fd, request.data(), request.size());
  std::string response;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) response.append(buf, static_cast<size_t>(n));
  ::close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = -1;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

}  // namespace gpufeed::testing
