#include "client/cpp/rpc.h"

#include <sys/stat.h>

#include "absl/strings/str_cat.h"

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

std::shared_ptr<grpc::Channel> ChannelFor(const std::string& socket, bool fresh) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (fresh) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(absl::StrCat("unix://", socket),
                                   grpc::InsecureChannelCredentials(), args);
}

}  // namespace gpufeed::client::internal
