#include "server/objstore/curl_pool.h"

#include <mutex>

#include "absl/strings/str_cat.h"

namespace gpufeed::objstore {

absl::Status InitCurlOnce() {
  static std::once_flag once;
  static CURLcode result = CURLE_OK;
  std::call_once(once, [] { result = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (result != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("curl_global_init: ", curl_easy_strerror(result)));
  }
  return absl::OkStatus();
}

CurlHandlePool::Lease::~Lease() {
  if (pool_ != nullptr) pool_->Release(handle_);
}

absl::StatusOr<std::unique_ptr<CurlHandlePool>> CurlHandlePool::Create(int max_handles) {
  if (absl::Status init = InitCurlOnce(); !init.ok()) return init;
  return std::unique_ptr<CurlHandlePool>(new CurlHandlePool(max_handles));
}

CurlHandlePool::~CurlHandlePool() {
  absl::MutexLock lock(&mu_);
  // Every lease has ended: the client that owns the pool outlives its calls.
  for (CURL* handle : idle_) curl_easy_cleanup(handle);
}

absl::StatusOr<CurlHandlePool::Lease> CurlHandlePool::Acquire() {
  CURL* handle = nullptr;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](CurlHandlePool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->mu_) {
          return !pool->idle_.empty() || pool->created_ < pool->max_handles_;
        },
        this));
    if (!idle_.empty()) {
      handle = idle_.back();
      idle_.pop_back();
    } else {
      ++created_;  // reserved now, created outside the lock
    }
  }
  if (handle == nullptr) {
    handle = curl_easy_init();
    if (handle == nullptr) {
      absl::MutexLock lock(&mu_);
      --created_;
      return absl::ResourceExhaustedError("curl_easy_init failed (out of memory)");
    }
  } else {
    // Options of the last request gone; its open connections and DNS cache kept.
    curl_easy_reset(handle);
  }
  return Lease(this, handle);
}

void CurlHandlePool::Release(CURL* handle) {
  absl::MutexLock lock(&mu_);
  idle_.push_back(handle);
}

}  // namespace gpufeed::objstore
