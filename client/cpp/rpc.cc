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
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/os/fd.h"
#include "common/os/peer_cred.h"
#include "gpufeed/client.h"

namespace gpufeed::client::internal {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

absl::Status CheckSocket(const std::string& socket) {
  struct stat st {};
  if (::stat(socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(kNoDaemonListening, socket,
                                               ": no socket there (is gpufeedd running? it logs "
                                               "where it listens)"));
  }
  return absl::OkStatus();
}

absl::Status TrustDaemonUid(uint32_t peer_uid, uint32_t self_uid, std::optional<uint32_t> dir_owner,
                            const char* env, const std::string& socket) {
  const bool named = env != nullptr && *env != '\0';
  std::vector<uint32_t> trusted;
  if (named) {
    for (absl::string_view part : absl::StrSplit(env, ',')) {
      uint32_t uid = 0;
      if (!absl::SimpleAtoi(part, &uid) || part.empty() || part[0] == '+' || part[0] == '-') {
        return absl::InvalidArgumentError(absl::StrCat(
            "GPUFEED_DAEMON_UID: want numeric uids separated by commas (e.g. 998), got '", env,
            "'"));
      }
      trusted.push_back(uid);
    }
  } else if (dir_owner.has_value()) {
    trusted.push_back(*dir_owner);
  }
  if (peer_uid == 0 || peer_uid == self_uid ||
      std::find(trusted.begin(), trusted.end(), peer_uid) != trusted.end()) {
    return absl::OkStatus();
  }
  const size_t slash = socket.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : socket.substr(0, slash);
  return absl::PermissionDeniedError(absl::StrCat(
      "memory socket ", socket, " is served by uid ", peer_uid,
      ", which this client does not trust with its dataset descriptors: it trusts root, its "
      "own uid (",
      self_uid, ") and ",
      named ? absl::StrCat("GPUFEED_DAEMON_UID (", env, ")")
            : absl::StrCat("the owner of ", dir,
                           dir_owner.has_value() ? absl::StrCat(" (uid ", *dir_owner, ")")
                                                 : std::string(" (not readable)")),
      "; if uid ", peer_uid, " runs your node's gpufeedd, set GPUFEED_DAEMON_UID=", peer_uid));
}

absl::Status CheckDaemonPeer(int fd, const std::string& socket) {
  absl::StatusOr<PeerCred> peer = GetPeerCred(fd);
  if (!peer.ok()) {
    return absl::Status(peer.status().code(),
                        absl::StrCat("memory socket ", socket, ": ", peer.status().message()));
  }
  const size_t slash = socket.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : socket.substr(0, slash);
  struct stat st {};
  std::optional<uint32_t> owner;
  if (::stat(dir.empty() ? "/" : dir.c_str(), &st) == 0) owner = st.st_uid;
  return TrustDaemonUid(peer->uid, static_cast<uint32_t>(::geteuid()), owner,
                        std::getenv("GPUFEED_DAEMON_UID"), socket);
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
        kNoDaemonListening, socket, ": a stale socket file (gpufeedd stopped or crashed?)"));
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
