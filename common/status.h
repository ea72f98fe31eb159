// Status helpers shared by every component. Fallible functions return absl::Status or
// absl::StatusOr<T> with the canonical code that fits; context is added as errors travel up.
#pragma once

#include "absl/strings/string_view.h"
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define GPUFEED_CONCAT_INNER_(a, b) a##b
#define GPUFEED_CONCAT_(a, b) GPUFEED_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define GPUFEED_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::absl::Status gpufeed_status_ = (expr);          \
    if (!gpufeed_status_.ok()) return gpufeed_status_; \
  } while (0)

// `lhs = value of expr` where expr is an absl::StatusOr<T>; returns its status if not OK.
#define GPUFEED_ASSIGN_OR_RETURN(lhs, expr) \
  GPUFEED_ASSIGN_OR_RETURN_IMPL_(GPUFEED_CONCAT_(gpufeed_statusor_, __LINE__), lhs, expr)
// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` may be a declaration, which parentheses break.
#define GPUFEED_ASSIGN_OR_RETURN_IMPL_(var, lhs, expr) \
  auto var = (expr);                                   \
  if (!var.ok()) return std::move(var).status();       \
  lhs = std::move(var).value()
// NOLINTEND(bugprone-macro-parentheses)

namespace gpufeed {

// Returns `status` with "context: " prepended to its message, keeping its code.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

// absl::Status from errno, with the canonical code that fits it.
absl::Status ErrnoToStatus(int error_number, absl::string_view context);

}  // namespace gpufeed
