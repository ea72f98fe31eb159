// A temporary directory (mkdtemp) removed with everything in it when the owner goes away:
// the one TempDir of every test, benchmark and harness (no gtest: benchmarks use it too).
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace gpufeed::testing {

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern =
        std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/gpufeed_test_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      // Nothing of a test can run without its directory.
      std::fprintf(stderr, "TempDir: mkdtemp(%s) failed: errno %d\n", pattern.c_str(), errno);
      std::abort();
    }
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    // Give back permissions a test may have taken away so the tree can be removed.
    for (auto it = std::filesystem::recursive_directory_iterator(path_, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
      std::filesystem::permissions(it->path(), std::filesystem::perms::owner_all,
                                   std::filesystem::perm_options::add, ec);
    }
    std::filesystem::remove_all(path_, ec);
  }

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

  // Writes `bytes` to `name` in the directory and returns the file's absolute path.
  std::string WriteFile(const std::string& name, const std::string& bytes) const {
    const std::string p = Join(name);
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::fprintf(stderr, "TempDir: writing %s failed\n", p.c_str());
      std::abort();
    }
    return p;
  }

 private:
  std::string path_;
};

}  // namespace gpufeed::testing
