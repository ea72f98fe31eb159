#include "server/device/nvjpeg.h"

#include <dlfcn.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cuda/cuda.h"

namespace gpufeed::server::nvjpeg {
namespace {

template <typename F>
bool Bind(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(::dlsym(lib, name));
  return *out != nullptr;
}

}  // namespace

absl::StatusOr<Api> Load(const std::string& library) {
  std::vector<std::string> candidates;
  if (!library.empty()) {
    candidates.push_back(library);
  } else {
    candidates = {"libnvjpeg.so.13", "libnvjpeg.so.12", "/usr/local/cuda/lib64/libnvjpeg.so.13",
                  "/usr/local/cuda/lib64/libnvjpeg.so.12",
                  "/usr/local/cuda/targets/x86_64-linux/lib/libnvjpeg.so.13"};
  }
  std::vector<std::string> errors;
  for (const std::string& path : candidates) {
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      errors.push_back(::dlerror());
      continue;
    }
    Api api;
    api.library = path;
    const bool ok = Bind(lib, "nvjpegCreateEx", &api.CreateEx) &&
                    Bind(lib, "nvjpegDestroy", &api.Destroy) &&
                    Bind(lib, "nvjpegJpegStateCreate", &api.JpegStateCreate) &&
                    Bind(lib, "nvjpegJpegStateDestroy", &api.JpegStateDestroy) &&
                    Bind(lib, "nvjpegDecodeBatchedInitialize", &api.DecodeBatchedInitialize) &&
                    Bind(lib, "nvjpegDecodeBatched", &api.DecodeBatched) &&
                    Bind(lib, "nvjpegDecode", &api.Decode) &&
                    Bind(lib, "nvjpegGetHardwareDecoderInfo", &api.GetHardwareDecoderInfo);
    if (!ok) {
      errors.push_back(absl::StrCat(path, ": missing symbol: ", ::dlerror()));
      ::dlclose(lib);
      continue;
    }
    // Optional: left null where absent.
    if (!(Bind(lib, "nvjpegDecodeParamsCreate", &api.DecodeParamsCreate) &&
          Bind(lib, "nvjpegDecodeParamsDestroy", &api.DecodeParamsDestroy) &&
          Bind(lib, "nvjpegDecodeParamsSetOutputFormat", &api.DecodeParamsSetOutputFormat) &&
          Bind(lib, "nvjpegDecodeParamsSetROI", &api.DecodeParamsSetROI) &&
          Bind(lib, "nvjpegDecodeBatchedEx", &api.DecodeBatchedEx))) {
      api.DecodeBatchedEx = nullptr;
    }
    return api;  // never unloaded: handles may outlive any owner we could name
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "decode: nvJPEG is not available to gpufeedd (", absl::StrJoin(errors, "; "),
      "); set gpufeedd's --nvjpeg_library (or $GPUFEED_NVJPEG_LIBRARY) or attach with decode "
      "cpu"));
}

absl::StatusOr<UniqueState> UniqueState::Create(const Api* api, Handle handle, int device) {
  cuda::DeviceGuard guard(device);
  UniqueState out;
  const int rc = api->JpegStateCreate(handle, &out.state_);
  if (rc != 0) {
    out.state_ = nullptr;
    return absl::InternalError(absl::StrCat("nvjpegJpegStateCreate: ", StatusName(rc)));
  }
  out.api_ = api;
  out.device_ = device;
  return out;
}

void UniqueState::reset() {
  if (state_ == nullptr) return;
  cuda::DeviceGuard guard(device_);
  api_->JpegStateDestroy(std::exchange(state_, nullptr));
}

std::string StatusName(int status) {
  static const char* const kNames[] = {
      "NVJPEG_STATUS_SUCCESS",          "NVJPEG_STATUS_NOT_INITIALIZED",
      "NVJPEG_STATUS_INVALID_PARAMETER", "NVJPEG_STATUS_BAD_JPEG",
      "NVJPEG_STATUS_JPEG_NOT_SUPPORTED", "NVJPEG_STATUS_ALLOCATOR_FAILURE",
      "NVJPEG_STATUS_EXECUTION_FAILED", "NVJPEG_STATUS_ARCH_MISMATCH",
      "NVJPEG_STATUS_INTERNAL_ERROR",   "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
      "NVJPEG_STATUS_INCOMPLETE_BITSTREAM"};
  const char* name = status >= 0 && status < static_cast<int>(std::size(kNames)) ? kNames[status]
                                                                                 : "NVJPEG_STATUS_?";
  return absl::StrCat(name, " (", status, ")");
}

}  // namespace gpufeed::server::nvjpeg
