// A real S3 server on loopback for the objstore tests, and a fault-injecting proxy in front
// of it: moto's server mode (tests/testing/moto_s3_server.py) and
// tests/testing/s3_fault_proxy.py, each a child process on a free port, gone with its owner.
//
// The Python that runs them: $GPUFEED_S3_PYTHON, else the venv tests/run.sh makes under the
// build directory (build/s3-venv, moto from PyPI). Where it has no moto, MotoUnavailable()
// says why and the tests skip, visibly.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gpufeed::testing {

// A child process whose stdin and stdout are pipes to us; stderr goes to a file. Killed
// (SIGKILL) and reaped by the destructor; closing its stdin first asks it to leave.
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // One line of its stdout, without the newline; DEADLINE_EXCEEDED after `timeout_s`,
  // UNAVAILABLE (with its stderr) where it ended.
  absl::StatusOr<std::string> ReadLine(double timeout_s);
  absl::Status WriteLine(const std::string& line);
  std::string Stderr() const;

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string stderr_path_;
  std::string buffered_;
};

// Why the S3 tests cannot run here ("" where they can): the Python or its moto is missing.
std::string MotoUnavailable();

class MotoServer {
 public:
  // no_auth: no signature checks (STS's AssumeRoleWithWebIdentity is tested there: moto
  // wants it signed, AWS does not).
  static absl::StatusOr<std::unique_ptr<MotoServer>> Start(bool no_auth = false);
  ~MotoServer();

  int port() const { return port_; }
  std::string endpoint() const;
  const std::string& access_key() const { return access_key_; }
  const std::string& secret() const { return secret_; }

  absl::Status CreateBucket(const std::string& bucket);
  absl::Status Put(const std::string& bucket, const std::string& key, const std::string& bytes);
  // Many small objects in one command: key -> its text.
  absl::Status PutMany(const std::string& bucket,
                       const std::vector<std::pair<std::string, std::string>>& objects);
  // Temporary credentials (a session token) from STS's AssumeRole of an allow-all role.
  struct TemporaryCredentials {
    std::string access_key, secret, token;
  };
  absl::StatusOr<TemporaryCredentials> AssumeRole();

 private:
  // The answer's JSON ("" for a plain "ok").
  absl::StatusOr<std::string> Command(const std::string& json);
  std::unique_ptr<ChildProcess> process_;
  std::string scratch_dir_;
  int port_ = 0;
  std::string access_key_;
  std::string secret_;
  int puts_ = 0;
};

struct FaultSpec {
  int seed = 1;
  double error_rate = 0;     // share answered 500 InternalError or 503 SlowDown
  double truncate_rate = 0;  // share whose body is cut in half
  int latency_ms = 0;        // added to every request
};

class FaultProxy {
 public:
  static absl::StatusOr<std::unique_ptr<FaultProxy>> Start(int upstream_port,
                                                           const FaultSpec& spec);
  std::string endpoint() const;

 private:
  std::unique_ptr<ChildProcess> process_;
  int port_ = 0;
};

// `text` as a JSON string literal (UTF-8 passed through).
std::string JsonString(const std::string& text);

}  // namespace gpufeed::testing
