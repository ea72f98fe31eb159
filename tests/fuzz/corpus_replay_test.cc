// Replays each fuzz target's seed corpus (tests/fuzz/corpus/<name>/) and its committed
// findings (tests/fuzz/regressions/<name>/) through the target's function, in the normal
// build: so GCC's test and ASan passes run the same checks the fuzzers run under clang. A
// broken invariant aborts the test binary (FUZZ_CHECK), which ctest reports as a failure.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {
namespace {

namespace fs = std::filesystem;

struct Target {
  const char* name;
  int (*fn)(const uint8_t*, size_t);
};

// The name, not the bytes: ctest names each parameterised test by its printed parameter.
void PrintTo(const Target& target, std::ostream* os) { *os << target.name; }

constexpr Target kTargets[] = {
    {"attach_request", FuzzAttachRequest}, {"npy_header", FuzzNpyHeader},
    {"pipeline_json", FuzzPipelineJson},   {"mem_frame", FuzzMemFrame},
    {"image_header", FuzzImageHeader},     {"tar_index", FuzzTarIndex},
};

std::vector<fs::path> Files(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file()) out.push_back(entry.path());
  }
  return out;
}

std::string Read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class CorpusReplayTest : public ::testing::TestWithParam<Target> {};

TEST_P(CorpusReplayTest, SeedsAndRegressionsPass) {
  const fs::path root = GPUFEED_FUZZ_DIR;
  const std::vector<fs::path> seeds = Files(root / "corpus" / GetParam().name);
  ASSERT_FALSE(seeds.empty()) << "no seeds in " << (root / "corpus" / GetParam().name);
  std::vector<fs::path> all = seeds;
  // A finding committed before its fix ends in ".open" (tests/fuzz/README.md): not yet.
  for (const fs::path& p : Files(root / "regressions" / GetParam().name)) {
    if (p.extension() != ".open") all.push_back(p);
  }
  for (const fs::path& path : all) {
    SCOPED_TRACE(path.string());
    const std::string bytes = Read(path);
    EXPECT_EQ(GetParam().fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, CorpusReplayTest, ::testing::ValuesIn(kTargets));

}  // namespace
}  // namespace gpufeed::fuzz
