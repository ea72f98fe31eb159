// Where gpufeedd's sockets live when nothing names them: one rule for the daemon (which makes
// the directory), the C and C++ clients, gpufeedctl and Python (through the C library).
//
//   daemon: `runtime_dir` (default /run/gpufeed), created mode 0755 if missing; where the
//           daemon may not create or write it (not root, a read-only /run, a directory of
//           another user), $XDG_RUNTIME_DIR/gpufeed instead. Sockets gpufeed.sock and
//           gpufeed.mem.sock in it.
//   client: /run/gpufeed/gpufeed.sock if it exists, else $XDG_RUNTIME_DIR/gpufeed/gpufeed.sock
//           if that exists, else /run/gpufeed/gpufeed.sock (which the "no gpufeedd" error
//           then names).
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"

namespace gpufeed {

inline constexpr char kSystemRuntimeDir[] = "/run/gpufeed";
inline constexpr char kSocketName[] = "gpufeed.sock";         // gRPC
inline constexpr char kMemSocketName[] = "gpufeed.mem.sock";  // memory (SCM_RIGHTS)

// The clients' default socket. `xdg_runtime_dir`: $XDG_RUNTIME_DIR (null or empty: unset);
// `system_dir`: kSystemRuntimeDir but in tests.
std::string DefaultSocketPath(const char* xdg_runtime_dir,
                              const std::string& system_dir = kSystemRuntimeDir);

struct RuntimeDir {
  std::string path;  // the directory the sockets go in
  // For the daemon's one line saying where it listens: "runtime directory /run/gpufeed
  // created", "... in $XDG_RUNTIME_DIR/gpufeed: uid 1000 may not create /run/gpufeed (...)".
  std::string how;
};

// The daemon's runtime directory, made as the header says. Each directory on the way, the
// runtime directory itself included, must be safe to put sockets under: a directory (not a
// symbolic link) owned by root or `euid`, writable by group or others only with the sticky
// bit; otherwise FAILED_PRECONDITION naming it and why (no fallback: someone else could move
// the sockets). A runtime directory the daemon cannot make or write (EACCES, EPERM, EROFS, a
// missing parent, another user's directory) falls back to `xdg_runtime_dir`/gpufeed; where
// that fails too, FAILED_PRECONDITION naming both and --listen.
absl::StatusOr<RuntimeDir> PrepareRuntimeDir(const std::string& runtime_dir,
                                             const char* xdg_runtime_dir, uid_t euid);

}  // namespace gpufeed
