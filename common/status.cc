#include "common/status.h"

#include <cerrno>
#include <cstring>

namespace gpufeed {

absl::Status ErrnoToStatus(int error_number, absl::string_view context) {
  absl::StatusCode code;
  switch (error_number) {
    case ENOENT:
    case ENOTDIR:
      code = absl::StatusCode::kNotFound;
      break;
    case EACCES:
    case EPERM:
      code = absl::StatusCode::kPermissionDenied;
      break;
    case EEXIST:
    case EADDRINUSE:
      code = absl::StatusCode::kAlreadyExists;
      break;
    case EINVAL:
    case ENAMETOOLONG:
    case EISDIR:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EAGAIN:
      code = absl::StatusCode::kUnavailable;
      break;
    case EIO:
      code = absl::StatusCode::kDataLoss;
      break;
    default:
      code = absl::StatusCode::kInternal;
  }
  return absl::Status(code, absl::StrCat(context, ": ", std::strerror(error_number)));
}

}  // namespace gpufeed
