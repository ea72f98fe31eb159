// gtest printers for the daemon's plain types, so failures show values instead of bytes.
// Defined in the types' own namespaces (where gtest finds them by ADL) and inline, so every
// test file can include this header.
#pragma once

#include <ostream>

#include "server/sampler/sampler.h"

namespace gpufeed::server {

inline void PrintTo(const Position& p, std::ostream* os) {
  *os << "(epoch " << p.epoch << ", step " << p.step << ")";
}

}  // namespace gpufeed::server
