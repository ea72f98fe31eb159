// libcurl easy handles, bounded and reused. A handle keeps its connections open after a
// transfer, so reusing handles reuses connections (keep-alive); bounding the handles bounds the
// requests in flight, and so the connections to the store.
#pragma once

#include <curl/curl.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gpufeed::objstore {

// curl_global_init, once per process, before the first handle (it is not thread-safe against
// other libcurl calls, so every handle's creation goes through here). INTERNAL if it failed.
absl::Status InitCurlOnce();

class CurlHandlePool {
 public:
  // A handle on loan: reset to libcurl's defaults (its connection cache kept), returned to the
  // pool when the lease ends.
  class Lease {
   public:
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)), handle_(std::exchange(other.handle_, nullptr)) {}
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    CURL* get() const { return handle_; }

   private:
    friend class CurlHandlePool;
    Lease(CurlHandlePool* pool, CURL* handle) : pool_(pool), handle_(handle) {}
    CurlHandlePool* pool_;
    CURL* handle_;
  };

  // At most `max_handles` at once. INTERNAL if libcurl cannot be initialized.
  static absl::StatusOr<std::unique_ptr<CurlHandlePool>> Create(int max_handles);
  ~CurlHandlePool();
  CurlHandlePool(const CurlHandlePool&) = delete;
  CurlHandlePool& operator=(const CurlHandlePool&) = delete;

  // Waits for a free handle (creating one while fewer than max_handles exist). RESOURCE_EXHAUSTED
  // if libcurl cannot allocate one.
  absl::StatusOr<Lease> Acquire();

 private:
  explicit CurlHandlePool(int max_handles) : max_handles_(max_handles) {}
  void Release(CURL* handle);

  const int max_handles_;
  absl::Mutex mu_;
  std::vector<CURL*> idle_ ABSL_GUARDED_BY(mu_);
  int created_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpufeed::objstore
