// A memcpy from a file mapping that survives the file shrinking underneath: the SIGBUS the
// kernel raises for a page past the new end of file becomes a DATA_LOSS status instead of
// killing the daemon.
//
// Why not pread alone: small samples read with pread from the page cache move several times
// fewer bytes a second than memcpy from a mapping of the same file (syscall entry, page-cache
// lookup per call; measured: docs/benchmarks.md, section Host delivery). The guard keeps
// pread's contract (an error, not a crash) at memcpy's speed.
//
// How: a process-wide SIGBUS handler (installed once, SA_NODEFER) checks a thread-local
// jump buffer that GuardedCopy arms around its memcpy; a fault inside an armed copy
// siglongjmps back and the copy returns an error. A SIGBUS anywhere else restores the
// default action and re-faults, crashing as it would have without us. The handler takes no
// lock and calls nothing that is not async-signal-safe.
#pragma once

#include <cstddef>

#include "absl/status/status.h"

namespace gpufeed {

// Copies n bytes; DATA_LOSS when reading `src` faulted (the mapped file shrank), and `dst`
// may be partly written then.
absl::Status GuardedCopy(void* dst, const void* src, size_t n);

}  // namespace gpufeed
