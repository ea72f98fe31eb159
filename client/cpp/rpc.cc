#include "client/cpp/rpc.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/os/fd.h"

namespace gpufeed::client::internal {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

absl::Status CheckSocket(const std::string& socket) {
  struct stat st {};
  if (::stat(socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(
        "no gpufeedd socket at ", socket, " (is gpufeedd running? set the socket path with "
        "--socket or GPUFEED_SOCKET)"));
  }
  return absl::OkStatus();
}

absl::Status ProbeSocket(const std::string& socket) {
  if (absl::Status s = CheckSocket(socket); !s.ok()) return s;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket.size() >= sizeof(addr.sun_path)) return absl::OkStatus();  // gRPC says why
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::OkStatus();  // no descriptor to spare: let gRPC try
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
    return absl::OkStatus();
  }
  const int error = errno;
  if (error == ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat(
        "nothing listens on ", socket, ": a stale socket file (gpufeedd stopped or crashed?); "
        "start gpufeedd, or set the socket with --socket or GPUFEED_SOCKET"));
  }
  if (error == EACCES || error == EPERM) {
    struct stat st {};
    (void)::stat(socket.c_str(), &st);
    return absl::PermissionDeniedError(absl::StrFormat(
        "this process (uid %u, gid %u) may not connect to %s (mode %04o, owner uid %u, group "
        "%u): join the socket's group (e.g. usermod -aG gpufeed $USER, then log in again)",
        ::geteuid(), ::getegid(), socket, st.st_mode & 07777, st.st_uid, st.st_gid));
  }
  return absl::OkStatus();  // anything else: gRPC's own attempt reports it
}

std::shared_ptr<grpc::Channel> ChannelFor(const std::string& socket, bool fresh,
                                          absl::Duration keepalive) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (fresh) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (keepalive > absl::ZeroDuration()) {
    const int ms =
        static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(keepalive), int64_t{1} << 30));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    // gRPC's defaults stop pinging after 2 pings with no data sent, and space pings on a
    // quiet connection 5 minutes apart: a consumer holding every slot sends nothing for long.
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, ms);
  }
  return grpc::CreateCustomChannel(absl::StrCat("unix://", socket),
                                   grpc::InsecureChannelCredentials(), args);
}

void DebugLog(absl::string_view line) {
  static const bool on = [] {
    const char* v = std::getenv("GPUFEED_DEBUG");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  if (on) std::fprintf(stderr, "gpufeed debug: %.*s\n", static_cast<int>(line.size()), line.data());
}

std::string InOurWords(const absl::Status& status, const std::string& socket) {
  const absl::string_view m = status.message();
  std::string words;
  if (absl::IsDeadlineExceeded(status)) {
    words = "gpufeedd did not answer in time (stopped, hung or overloaded?)";
  } else if (absl::IsUnavailable(status)) {
    if (absl::StrContains(m, "Connection refused")) {
      words = absl::StrCat("nothing listens on ", socket, " (connection refused)");
    } else if (absl::StrContains(m, "No such file")) {
      words = absl::StrCat("no socket at ", socket);
    } else if (absl::StrContains(m, "keepalive")) {
      words = "gpufeedd stopped answering (no reply to keepalive pings)";
    } else if (absl::StrContains(m, "failed to connect") || absl::StrContains(m, "Socket closed") ||
               absl::StrContains(m, "Connection reset") || absl::StrContains(m, "Broken pipe") ||
               absl::StrContains(m, "GOAWAY") || absl::StrContains(m, "Transport closed") ||
               absl::StrContains(m, "Stream removed")) {
      words = "the connection to gpufeedd was lost";
    }
  }
  if (words.empty()) return std::string(m);  // the daemon's own words
  DebugLog(absl::StrCat(words, ": ", status.ToString()));
  return words;
}

}  // namespace gpufeed::client::internal
