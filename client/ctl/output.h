// What every gpufeedctl command prints with: errors, JSON strings, aligned tables.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace gpufeed::ctl {

// Prints "error: CODE: message" to stderr and returns 1, the exit status of a failed command.
int Fail(const absl::Status& status);

// `s` as a JSON string literal, quotes included.
std::string JsonString(const std::string& s);

// Prints `header` and `rows` as columns padded to their widest cell, two spaces apart.
void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows);

}  // namespace gpufeed::ctl
