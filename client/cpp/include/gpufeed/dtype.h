// Element types of tensors, numbered as gpufeed.v1.DType and the C ABI (public header).
#pragma once

#include <cstdint>
#include <string_view>

namespace gpufeed {

enum class DType : int32_t {
  kUnspecified = 0,
  kBool = 1,
  kInt8 = 2,
  kUInt8 = 3,
  kInt16 = 4,
  kUInt16 = 5,
  kInt32 = 6,
  kUInt32 = 7,
  kInt64 = 8,
  kUInt64 = 9,
  kFloat16 = 10,
  kBFloat16 = 11,
  kFloat32 = 12,
  kFloat64 = 13,
  kComplex64 = 14,
  kComplex128 = 15,
};

// Bytes per element; 0 for kUnspecified or an out-of-range value.
constexpr uint32_t DTypeSize(DType t) {
  switch (t) {
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
    case DType::kInt16:
    case DType::kUInt16:
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFloat64:
    case DType::kComplex64:
      return 8;
    case DType::kComplex128:
      return 16;
    default:
      return 0;
  }
}

// "uint16", "float32", ...; "unspecified" for anything else.
const char* DTypeName(DType t);
// Inverse of DTypeName; kUnspecified when unknown.
DType DTypeFromName(std::string_view name);

}  // namespace gpufeed
