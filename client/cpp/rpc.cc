#include "client/cpp/rpc.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

std::shared_ptr<grpc::Channel> ChannelFor(const std::string& socket, bool fresh) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (fresh) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(absl::StrCat("unix://", socket),
                                   grpc::InsecureChannelCredentials(), args);
}

}  // namespace gpufeed::client::internal
