// What config.cc (the file, validation) and config_flags.cc (the flags, LoadConfig) share;
// not for other callers, which use config.h.
#pragma once

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "server/config.h"

namespace gpufeed::server::config_internal {

// Where a setting's value came from, for the settings a config file set (and no flag
// replaced): the setting's name (its flag's) -> "config FILE: file_field".
using Sources = absl::flat_hash_map<std::string, std::string>;

// The settings the file at `path` sets, over `c`, each recorded in `sources`.
absl::Status ApplyFile(const std::string& path, DaemonConfig* c, Sources* sources);

// ValidateConfig, naming the file where a bad value came from one.
absl::Status Validate(DaemonConfig& c, const Sources& sources);

}  // namespace gpufeed::server::config_internal
