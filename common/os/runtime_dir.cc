#include "common/os/runtime_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/os/fd.h"
#include "common/status.h"

namespace gpufeed {
namespace {

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Why a directory is no place for sockets ("" where it is): someone besides root and the
// daemon could rename or replace what is in it.
std::string Unsafe(const struct stat& st, uid_t euid) {
  if (st.st_uid != 0 && st.st_uid != euid) {
    return absl::StrCat("is owned by uid ", st.st_uid, ", neither root nor gpufeedd's uid ", euid);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return absl::StrFormat("is writable by its %s without the sticky bit (mode %04o)",
                           (st.st_mode & S_IWOTH) != 0 ? "others" : "group", st.st_mode & 07777);
  }
  return "";
}

// One directory tried: OK with `cannot` empty when it is ready for the sockets; `cannot` set
// when the daemon may not make or use it (the caller falls back); an error when it is unsafe.
struct Attempt {
  std::string cannot;
  bool created = false;
};

absl::StatusOr<Attempt> Make(const std::string& dir, uid_t euid) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("runtime_dir: must be an absolute path, got '", dir, "'"));
  }
  std::vector<std::string> parts = absl::StrSplit(dir, '/', absl::SkipEmpty());
  for (const std::string& p : parts) {
    if (p == "." || p == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("runtime_dir: ", dir, ": give a path without . or .. components"));
    }
  }
  if (parts.empty()) {
    return absl::InvalidArgumentError("runtime_dir: / itself cannot hold gpufeedd's sockets");
  }
  const auto unsafe = [&](const std::string& path, const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runtime_dir: ", path, " ", why,
        ": another user could replace gpufeedd's sockets beneath it; fix its owner or mode, or "
        "name the sockets with --listen=unix:///PATH/gpufeed.sock"));
  };
  Attempt out;
  UniqueFd at(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!at.valid()) return ErrnoToStatus(errno, "runtime_dir: opening /");
  struct stat st {};
  if (::fstat(at.get(), &st) != 0) return ErrnoToStatus(errno, "runtime_dir: /");
  if (std::string why = Unsafe(st, euid); !why.empty()) return unsafe("/", why);
  std::string walked;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    const std::string parent = walked.empty() ? "/" : walked;
    walked = absl::StrCat(walked, "/", parts[i]);
    const char* name = parts[i].c_str();
    if (last) {
      if (::mkdirat(at.get(), name, 0755) == 0) {
        out.created = true;
        // Exactly 0755 whatever the umask: clients must reach the sockets (their own modes
        // decide who may connect).
        if (::fchmodat(at.get(), name, 0755, 0) != 0) {
          return ErrnoToStatus(errno, absl::StrCat("runtime_dir: chmod 0755 ", walked));
        }
      } else if (errno != EEXIST) {
        const int error = errno;
        if (error == EACCES || error == EPERM || error == EROFS || error == ENOENT) {
          out.cannot = absl::StrCat("uid ", euid, " may not create ", walked, " (",
                                    std::strerror(error), ")");
          return out;
        }
        return ErrnoToStatus(error, absl::StrCat("runtime_dir: creating ", walked));
      }
    }
    UniqueFd next(::openat(at.get(), name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!next.valid()) {
      const int error = errno;
      if (error == ENOENT) {
        out.cannot = absl::StrCat(walked, " does not exist");
        return out;
      }
      if (error == EACCES) {
        out.cannot = absl::StrCat("uid ", euid, " may not search ", parent);
        return out;
      }
      if (error == ELOOP || error == ENOTDIR) {
        return unsafe(walked, "is a symbolic link or not a directory (give the real path)");
      }
      return ErrnoToStatus(error, absl::StrCat("runtime_dir: ", walked));
    }
    if (::fstat(next.get(), &st) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("runtime_dir: ", walked));
    }
    if (std::string why = Unsafe(st, euid); !why.empty()) {
      // The runtime directory of another user (systemd's, for its gpufeed user): not ours to
      // use, and nothing unsafe about it.
      if (last && st.st_uid != 0 && st.st_uid != euid) {
        out.cannot = absl::StrCat(walked, " belongs to uid ", st.st_uid);
        return out;
      }
      return unsafe(walked, why);
    }
    at = std::move(next);
  }
  if (::faccessat(at.get(), ".", W_OK | X_OK, AT_EACCESS) != 0) {
    out.cannot =
        absl::StrCat("uid ", euid, " may not write ", dir, " (", std::strerror(errno), ")");
  }
  return out;
}

}  // namespace

std::string DefaultSocketPath(const char* xdg_runtime_dir, const std::string& system_dir) {
  const std::string system = absl::StrCat(system_dir, "/", kSocketName);
  if (Exists(system) || xdg_runtime_dir == nullptr || xdg_runtime_dir[0] != '/') return system;
  const std::string user =
      absl::StrCat(absl::StripSuffix(xdg_runtime_dir, "/"), "/gpufeed/", kSocketName);
  return Exists(user) ? user : system;
}

absl::StatusOr<RuntimeDir> PrepareRuntimeDir(const std::string& runtime_dir,
                                             const char* xdg_runtime_dir, uid_t euid) {
  GPUFEED_ASSIGN_OR_RETURN(const Attempt first, Make(runtime_dir, euid));
  if (first.cannot.empty()) {
    return RuntimeDir{runtime_dir, absl::StrCat("runtime directory ", runtime_dir,
                                                first.created ? " created" : "")};
  }
  const std::string instead = "; name the socket with --listen=unix:///PATH/gpufeed.sock";
  if (xdg_runtime_dir == nullptr || xdg_runtime_dir[0] == '\0') {
    return absl::FailedPreconditionError(
        absl::StrCat("runtime_dir: ", first.cannot,
                     ", and $XDG_RUNTIME_DIR is not set: run gpufeedd as root "
                     "(or as the owner of ",
                     runtime_dir, "), set XDG_RUNTIME_DIR", instead));
  }
  if (xdg_runtime_dir[0] != '/') {
    return absl::FailedPreconditionError(absl::StrCat("runtime_dir: ", first.cannot,
                                                      ", and $XDG_RUNTIME_DIR ('", xdg_runtime_dir,
                                                      "') is not an absolute path", instead));
  }
  const std::string fallback = absl::StrCat(absl::StripSuffix(xdg_runtime_dir, "/"), "/gpufeed");
  absl::StatusOr<Attempt> second = Make(fallback, euid);
  if (!second.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runtime_dir: ", first.cannot, "; and in $XDG_RUNTIME_DIR: ", second.status().message()));
  }
  if (!second->cannot.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runtime_dir: ", first.cannot, ", nor in $XDG_RUNTIME_DIR: ", second->cannot, instead));
  }
  return RuntimeDir{fallback,
                    absl::StrCat("in $XDG_RUNTIME_DIR/gpufeed", second->created ? " (created)" : "",
                                 " because ", first.cannot)};
}

}  // namespace gpufeed
