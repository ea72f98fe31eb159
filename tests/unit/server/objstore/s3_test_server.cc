#include "tests/unit/server/objstore/s3_test_server.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

extern char** environ;

namespace gpufeed::testing {
namespace {

std::string Python() {
  const char* env = std::getenv("GPUFEED_S3_PYTHON");
  return env != nullptr && *env != '\0' ? env : GPUFEED_S3_PYTHON_DEFAULT;
}

std::string Script(const char* name) {
  return absl::StrCat(GPUFEED_SOURCE_DIR, "/tests/testing/", name);
}

// The string value of "name" in a flat JSON object of ours (no escapes in its values).
std::string JsonField(const std::string& json, const std::string& name) {
  const std::string tag = absl::StrCat("\"", name, "\": ");
  size_t at = json.find(tag);
  if (at == std::string::npos) return "";
  at += tag.size();
  if (json[at] == '"') {
    const size_t end = json.find('"', at + 1);
    return end == std::string::npos ? "" : json.substr(at + 1, end - at - 1);
  }
  const size_t end = json.find_first_of(",}", at);
  return json.substr(at, end - at);
}

}  // namespace

// Starts a server script and waits for its first line, a JSON object with its "port"; returns
// that line.
static absl::StatusOr<std::string> SpawnListening(const std::vector<std::string>& argv,
                                                  std::unique_ptr<ChildProcess>* process,
                                                  int* port) {
  auto child = ChildProcess::Spawn(argv);
  if (!child.ok()) return child.status();
  *process = *std::move(child);
  absl::StatusOr<std::string> ready = (*process)->ReadLine(60);
  if (!ready.ok()) return ready.status();
  if (!absl::SimpleAtoi(JsonField(*ready, "port"), port)) {
    return absl::InternalError(absl::StrCat(argv[1], " said: ", *ready));
  }
  return ready;
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    const std::vector<std::string>& argv) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: errno ", errno));
  }
  char stderr_template[] = "/tmp/gpufeed_s3_child_XXXXXX";
  const int err = mkstemp(stderr_template);
  if (err < 0) return absl::InternalError(absl::StrCat("mkstemp: errno ", errno));
  auto child = std::unique_ptr<ChildProcess>(new ChildProcess());
  child->stderr_path_ = stderr_template;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int rc = posix_spawn(&child->pid_, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  ::close(err);
  child->stdin_ = in[1];
  child->stdout_ = out[0];
  if (rc != 0) {
    child->pid_ = -1;
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": error ", rc));
  }
  return child;
}

ChildProcess::~ChildProcess() {
  if (stdin_ >= 0) ::close(stdin_);
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  if (stdout_ >= 0) ::close(stdout_);
  if (!stderr_path_.empty()) ::unlink(stderr_path_.c_str());
}

absl::StatusOr<std::string> ChildProcess::ReadLine(double timeout_s) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    const size_t newline = buffered_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(
          absl::StrFormat("no line from the child in %.0f s; its stderr:\n%s", timeout_s,
                          Stderr()));
    }
    pollfd p{stdout_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(stdout_, chunk, sizeof(chunk));
    if (n <= 0) {
      return absl::UnavailableError(absl::StrCat("the child ended; its stderr:\n", Stderr()));
    }
    buffered_.append(chunk, static_cast<size_t>(n));
  }
}

absl::Status ChildProcess::WriteLine(const std::string& line) {
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(stdin_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("write to the child: errno ", errno));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

std::string ChildProcess::Stderr() const {
  std::ifstream in(stderr_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string MotoUnavailable() {
  static const std::string reason = [] {
    const std::string python = Python();
    if (::access(python.c_str(), X_OK) != 0) {
      return absl::StrCat("no Python at ", python,
                          " (tests/run.sh makes it: a venv with moto from PyPI; or set "
                          "GPUFEED_S3_PYTHON)");
    }
    auto child = ChildProcess::Spawn(
        {python, "-c", "import moto.server, boto3, werkzeug; print('ok')"});
    if (!child.ok()) return std::string(child.status().message());
    absl::StatusOr<std::string> line = (*child)->ReadLine(60);
    if (!line.ok() || *line != "ok") {
      return absl::StrCat(python, " cannot import moto's server (pip install 'moto[server]'): ",
                          line.ok() ? *line : std::string(line.status().message()));
    }
    return std::string();
  }();
  return reason;
}

absl::StatusOr<std::unique_ptr<MotoServer>> MotoServer::Start(bool no_auth) {
  auto server = std::unique_ptr<MotoServer>(new MotoServer());
  std::vector<std::string> argv = {Python(), Script("moto_s3_server.py")};
  if (no_auth) argv.push_back("--no_auth");
  absl::StatusOr<std::string> ready = SpawnListening(argv, &server->process_, &server->port_);
  if (!ready.ok()) return ready.status();
  server->access_key_ = JsonField(*ready, "access_key");
  server->secret_ = JsonField(*ready, "secret");
  char dir_template[] = "/tmp/gpufeed_s3_data_XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: errno ", errno));
  }
  server->scratch_dir_ = dir_template;
  return server;
}

MotoServer::~MotoServer() {
  if (!scratch_dir_.empty()) ::rmdir(scratch_dir_.c_str());  // each Put removed its file
}

std::string MotoServer::endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }

absl::StatusOr<std::string> MotoServer::Command(const std::string& json) {
  if (absl::Status s = process_->WriteLine(json); !s.ok()) return s;
  absl::StatusOr<std::string> answer = process_->ReadLine(120);
  if (!answer.ok()) return answer.status();
  if (*answer == "ok") return std::string();
  if (answer->rfind("ok ", 0) == 0) return answer->substr(3);
  return absl::InternalError(absl::StrCat("moto_s3_server.py: ", *answer));
}

absl::Status MotoServer::CreateBucket(const std::string& bucket) {
  return Command(absl::StrCat(R"({"op": "create_bucket", "bucket": )", JsonString(bucket), "}"))
      .status();
}

absl::StatusOr<MotoServer::TemporaryCredentials> MotoServer::AssumeRole() {
  absl::StatusOr<std::string> answer = Command(R"({"op": "temporary_credentials"})");
  if (!answer.ok()) return answer.status();
  return TemporaryCredentials{JsonField(*answer, "access_key"), JsonField(*answer, "secret"),
                              JsonField(*answer, "token")};
}

absl::Status MotoServer::Put(const std::string& bucket, const std::string& key,
                             const std::string& bytes) {
  const std::string file = absl::StrCat(scratch_dir_, "/", puts_++);
  {
    std::ofstream out(file, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  absl::Status s = Command(absl::StrCat(R"({"op": "put", "bucket": )", JsonString(bucket),
                                        R"(, "key": )", JsonString(key), R"(, "file": )",
                                        JsonString(file), "}"))
                       .status();
  ::unlink(file.c_str());
  return s;
}

absl::Status MotoServer::PutMany(const std::string& bucket,
                                 const std::vector<std::pair<std::string, std::string>>& objects) {
  std::string json = absl::StrCat(R"({"op": "put_many", "bucket": )", JsonString(bucket),
                                  R"(, "objects": [)");
  for (size_t i = 0; i < objects.size(); ++i) {
    absl::StrAppend(&json, i == 0 ? "" : ", ", R"({"key": )", JsonString(objects[i].first),
                    R"(, "text": )", JsonString(objects[i].second), "}");
  }
  absl::StrAppend(&json, "]}");
  return Command(json).status();
}

absl::StatusOr<std::unique_ptr<FaultProxy>> FaultProxy::Start(int upstream_port,
                                                              const FaultSpec& spec) {
  auto proxy = std::unique_ptr<FaultProxy>(new FaultProxy());
  absl::StatusOr<std::string> ready = SpawnListening(
      {Python(), Script("s3_fault_proxy.py"), absl::StrCat("--upstream=127.0.0.1:", upstream_port),
       absl::StrCat("--seed=", spec.seed), absl::StrCat("--error_rate=", spec.error_rate),
       absl::StrCat("--truncate_rate=", spec.truncate_rate),
       absl::StrCat("--latency_ms=", spec.latency_ms)},
      &proxy->process_, &proxy->port_);
  if (!ready.ok()) return ready.status();
  return proxy;
}

std::string FaultProxy::endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", u);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace gpufeed::testing
