#include "common/dtype.h"

#include <array>
#include <utility>

namespace gpufeed {
namespace {

constexpr std::array<std::pair<DType, std::string_view>, 15> kNames = {{
    {DType::kBool, "bool"},
    {DType::kInt8, "int8"},
    {DType::kUInt8, "uint8"},
    {DType::kInt16, "int16"},
    {DType::kUInt16, "uint16"},
    {DType::kInt32, "int32"},
    {DType::kUInt32, "uint32"},
    {DType::kInt64, "int64"},
    {DType::kUInt64, "uint64"},
    {DType::kFloat16, "float16"},
    {DType::kBFloat16, "bfloat16"},
    {DType::kFloat32, "float32"},
    {DType::kFloat64, "float64"},
    {DType::kComplex64, "complex64"},
    {DType::kComplex128, "complex128"},
}};

}  // namespace

const char* DTypeName(DType t) {
  for (const auto& [type, name] : kNames) {
    if (type == t) return name.data();
  }
  return "unspecified";
}

DType DTypeFromName(std::string_view name) {
  for (const auto& [type, n] : kNames) {
    if (n == name) return type;
  }
  return DType::kUnspecified;
}

}  // namespace gpufeed
