#include "common/os/guarded_copy.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace gpufeed {
namespace {

thread_local sigjmp_buf* armed = nullptr;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  sigjmp_buf* jump = armed;
  if (jump != nullptr) {
    armed = nullptr;
    siglongjmp(*jump, 1);
  }
  // Not ours: fall back to the default action; returning re-executes the faulting access.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
}

void InstallHandler() {
  struct sigaction action {};
  action.sa_sigaction = OnSigbus;
  // SA_NODEFER: SIGBUS stays unblocked after the jump (sigsetjmp does not save the mask,
  // which would cost a system call per copy).
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, nullptr);
}

}  // namespace

absl::Status GuardedCopy(void* dst, const void* src, size_t n) {
  if (n == 0) return absl::OkStatus();  // src may be null: an empty file has no mapping
  static std::once_flag once;
  std::call_once(once, InstallHandler);
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {
    return absl::DataLossError("the mapped file shrank (SIGBUS while reading it)");
  }
  armed = &jump;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  armed = nullptr;
  return absl::OkStatus();
}

}  // namespace gpufeed
