// A blend's sources expanded to files, and the blend and pack options checked, without a
// daemon: what each kind of name stands for (a file, a directory, a glob, a Megatron pair),
// the exact message of each refusal, and the segments' JSON both ways.
#include "client/cpp/blend.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/options.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::client::internal {
namespace {

using ::testing::ElementsAre;

class BlendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char real[PATH_MAX];
    ASSERT_NE(::realpath(temp_.path().c_str(), real), nullptr);
    root_ = real;
    for (const char* dir : {"web", "code", "empty", "mixed"}) {
      ASSERT_EQ(::mkdir(Path(dir).c_str(), 0755), 0) << dir;
    }
    for (const char* f :
         {"web/b.npy", "web/a.bin", "web/.hidden.bin", "code/x.bin", "code/x.idx", "code/y.bin",
          "code/notes.txt", "code/.z.bin", "math.npy", "mixed/lone.idx", "mixed/m.bin"}) {
      temp_.WriteFile(f, "tokens");
    }
    ASSERT_EQ(::mkdir(Path("web/sub").c_str(), 0755), 0);  // no file of the source
    temp_.WriteFile("web/sub/deep.bin", "tokens");
    ASSERT_EQ(::symlink(Path("math.npy").c_str(), Path("web/link.npy").c_str()), 0);
  }

  std::string Path(const std::string& name) const { return absl::StrCat(root_, "/", name); }

  AttachOptions Blend(std::vector<BlendSource> sources) const {
    AttachOptions o;
    o.kind = "tokens";
    o.seq_len = 16;
    o.batch_size = 4;
    o.blend = std::move(sources);
    return o;
  }

  gpufeed::testing::TempDir temp_;
  std::string root_;
};

TEST_F(BlendTest, ADirectoryIsItsRegularFilesByNameLinksResolved) {
  absl::StatusOr<std::vector<std::string>> files = ExpandBlendSource(0, Path("web") + "/");
  ASSERT_TRUE(files.ok()) << files.status();
  // Not .hidden.bin, not the subdirectory; link.npy is math.npy, by its real path.
  EXPECT_THAT(*files, ElementsAre(Path("web/a.bin"), Path("web/b.npy"), Path("math.npy")));
  files = ExpandBlendSource(0, Path("web"));  // without the slash: the same
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(files->size(), 3u);
}

TEST_F(BlendTest, AGlobMatchesNamesOfItsDirectoryAndAnIdxGoesWithItsBin) {
  absl::StatusOr<std::vector<std::string>> files = ExpandBlendSource(1, Path("code/*.bin"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("code/x.bin"), Path("code/y.bin")));  // not .z.bin
  // A glob that takes the .idx too leaves it out beside its .bin, as a directory does.
  files = ExpandBlendSource(1, Path("code/x.*"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("code/x.bin")));
  files = ExpandBlendSource(1, Path("code"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("code/notes.txt"), Path("code/x.bin"), Path("code/y.bin")));
  // An .idx without its .bin stays, for the daemon to refuse as an index naming it.
  files = ExpandBlendSource(1, Path("mixed"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("mixed/lone.idx"), Path("mixed/m.bin")));
}

TEST_F(BlendTest, AFileIsItself) {
  absl::StatusOr<std::vector<std::string>> files = ExpandBlendSource(2, Path("math.npy"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("math.npy")));
  // A Megatron X.bin named alone is itself: the daemon reads its X.idx beside it.
  files = ExpandBlendSource(2, Path("code/x.bin"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("code/x.bin")));
  files = ExpandBlendSource(2, Path("web/link.npy"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("math.npy")));
}

TEST_F(BlendTest, EachSourceThatNamesNoFileIsRefusedByIndexAndName) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {Path("code/*.json"), absl::StrCat("blend[1] '", Path("code/*.json"), "': no files match")},
      {Path("empty/"), absl::StrCat("blend[1] '", Path("empty/"), "': no files in the directory")},
      {Path("nope.npy"),
       absl::StrCat("blend[1] '", Path("nope.npy"), "': No such file or directory")},
      {Path("nope/*.bin"), absl::StrCat("blend[1] '", Path("nope/*.bin"), "': listing ",
                                        Path("nope"), ": No such file or directory")},
      {Path("*/x.bin"), absl::StrCat("blend[1] '", Path("*/x.bin"),
                                     "': No such file or directory (a pattern may only be in the "
                                     "last component, /data/code/*.bin)")},
      {"data/web", "blend[1] 'data/web': not an absolute path"},
      {"",
       "blend[1]: no name; a source is the absolute path of a token file, a directory or a "
       "glob (/data/code/*.bin)"},
  };
  for (const auto& [name, message] : bad) {
    absl::StatusOr<std::vector<std::string>> files = ExpandBlendSource(1, name);
    EXPECT_FALSE(files.ok()) << name;
    EXPECT_EQ(files.status().message(), message);
  }
  EXPECT_EQ(ExpandBlendSource(1, Path("nope.npy")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ExpandBlendSource(1, Path("code/*.json")).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  EXPECT_EQ(ExpandBlendSource(0, Path("fifo")).status().message(),
            absl::StrCat("blend[0] '", Path("fifo"),
                         "': a FIFO, not a token file, a directory or "
                         "a glob"));
}

TEST_F(BlendTest, ABlendIsSentAsSourcesOfFilesWithTheirWeightsAndNames) {
  AttachOptions o =
      Blend({{Path("web/"), 0.7}, {Path("code/*.bin"), 0.2}, {Path("math.npy"), 0.1}});
  o.pack = "best_fit";
  o.eos_id = 50256;
  o.pack_lookahead = 64;
  o.blend_history = {{0, {0.5, 0.3, 0.2}, {0, 0, 0}}, {10, {0.1, 0.6, 0.3}, {5, 3, 2}}};
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::DatasetSpec& d = plan->request.dataset();
  EXPECT_EQ(d.path(), "");  // the files' common directory, set when they are opened
  EXPECT_EQ(d.paths_size(), 0);
  ASSERT_EQ(d.sources_size(), 3);
  EXPECT_THAT(d.sources(0).paths(),
              ElementsAre(Path("web/a.bin"), Path("web/b.npy"), Path("math.npy")));
  EXPECT_EQ(d.sources(0).weight(), 0.7);
  EXPECT_EQ(d.sources(0).name(), Path("web/"));
  EXPECT_THAT(d.sources(1).paths(), ElementsAre(Path("code/x.bin"), Path("code/y.bin")));
  EXPECT_EQ(d.sources(1).name(), Path("code/*.bin"));
  EXPECT_THAT(d.sources(2).paths(), ElementsAre(Path("math.npy")));
  EXPECT_EQ(d.sources(2).weight(), 0.1);
  EXPECT_EQ(d.pack(), v1::PACK_MODE_BEST_FIT);
  ASSERT_TRUE(d.has_eos_id());
  EXPECT_EQ(d.eos_id(), 50256);
  EXPECT_EQ(d.pack_lookahead(), 64u);
  ASSERT_EQ(d.blend_history_size(), 2);
  EXPECT_EQ(d.blend_history(1).start(), 10u);
  EXPECT_THAT(d.blend_history(1).weights(), ElementsAre(0.1, 0.6, 0.3));
  EXPECT_THAT(d.blend_history(1).ledger(), ElementsAre(5u, 3u, 2u));
}

TEST_F(BlendTest, PackingWithoutABlendIsTheDatasetWithAPackMode) {
  AttachOptions o = Blend({});
  o.dataset = "/data/train.bin";
  o.pack = "concat";
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::DatasetSpec& d = plan->request.dataset();
  EXPECT_EQ(d.path(), "/data/train.bin");
  EXPECT_EQ(d.sources_size(), 0);
  EXPECT_EQ(d.pack(), v1::PACK_MODE_CONCAT);
  EXPECT_FALSE(d.has_eos_id());  // unset: the .idx documents
  EXPECT_EQ(d.pack_lookahead(), 0u);
  o.pack = "none";  // the default: no pack fields
  plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->request.dataset().pack(), v1::PACK_MODE_NONE);
}

TEST_F(BlendTest, EachBadBlendOrPackOptionIsRefusedWithItsMessage) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::string web = Path("web/"), code = Path("code/*.bin");
  struct Case {
    std::function<void(AttachOptions&)> spoil;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[&](AttachOptions& o) { o.blend[1].weight = 0; },
       absl::StrCat("blend[1] '", code, "': weight must be > 0 and finite, got 0")},
      {[&](AttachOptions& o) { o.blend[1].weight = -0.5; },
       absl::StrCat("blend[1] '", code, "': weight must be > 0 and finite, got -0.5")},
      {[&](AttachOptions& o) { o.blend[0].weight = nan; },
       absl::StrCat("blend[0] '", web, "': weight must be > 0 and finite, got nan")},
      {[&](AttachOptions& o) { o.blend[0].weight = inf; },
       absl::StrCat("blend[0] '", web, "': weight must be > 0 and finite, got inf")},
      // Every weight is checked before any source is listed.
      {[&](AttachOptions& o) {
         o.blend[0].name = Path("nope");
         o.blend[1].weight = -1;
       },
       absl::StrCat("blend[1] '", code, "': weight must be > 0 and finite, got -1")},
      {[&](AttachOptions& o) { o.blend[1].name = Path("code/*.json"); },
       absl::StrCat("blend[1] '", Path("code/*.json"), "': no files match")},
      {[](AttachOptions& o) { o.kind = "webdataset"; },
       "blend: a blend of token sources is for kind tokens, not webdataset"},
      {[](AttachOptions& o) { o.dataset = "/data/train.bin"; },
       "dataset: '/data/train.bin' and a blend of 2 sources given together; give one"},
      {[](AttachOptions& o) { o.dataset_paths = {"/a/0.bin"}; },
       "dataset.paths: a list of 1 shard files and a blend of 2 sources given together; give "
       "one"},
      {[&](AttachOptions& o) {
         o.blend.assign(257, {web, 1});
       },
       "blend: 257 sources, at most 256"},
      {[](AttachOptions& o) { o.pack = "greedy"; },
       "pack: want none, concat or best_fit, got 'greedy'"},
      {[](AttachOptions& o) {
         o.kind = "records";
         o.blend.clear();
         o.dataset = "/data/x.npy";
         o.pack = "concat";
       },
       "pack: packs the documents of token files, for kind tokens, not records"},
      {[](AttachOptions& o) { o.eos_id = 0; },
       "eos_id: ends the documents packing packs; with pack none there is no packing (set pack "
       "concat or best_fit)"},
      {[](AttachOptions& o) {
         o.pack = "concat";
         o.eos_id = -1;
       },
       "eos_id: want a token, 0 to 4294967295, got -1"},
      {[](AttachOptions& o) {
         o.pack = "concat";
         o.pack_lookahead = 8;
       },
       "pack_lookahead: the documents best_fit packs together; pack is concat"},
      {[](AttachOptions& o) {
         o.pack = "best_fit";
         o.pack_lookahead = -8;
       },
       "pack_lookahead: want 1 to 4294967295 (0: the daemon's default), got -8"},
      {[](AttachOptions& o) {
         o.blend.clear();
         o.dataset = "/data/train.bin";
         o.blend_history = {{0, {1}, {0}}};
       },
       "blend_history: 1 segments of a blend, but no blend given"},
      {[](AttachOptions& o) {
         o.blend_history = {{0, {0.5, 0.5}, {0}}};
       },
       "blend_history[0]: 2 weights and 1 ledger entries; a segment has one of each a source"},
  };
  for (const Case& c : cases) {
    AttachOptions o = Blend({{web, 0.7}, {code, 0.3}});
    c.spoil(o);
    absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(plan.status().message(), c.message);
  }
}

TEST(BlendSegmentsJsonTest, WritesEachWeightSoThatItReadsBackTheSame) {
  const std::vector<BlendSegment> segments = {
      {0, {0.7, 0.2, 0.1}, {0, 0, 0}},
      {123456789, {1.0 / 3, 2.0 / 3, 1e-300}, {41152263, 82304526, 1}}};
  const std::string json = BlendSegmentsJson(segments);
  EXPECT_THAT(json, ::testing::StartsWith(
                        R"([{"start": 0, "weights": [0.7, 0.2, 0.1], "ledger": [0, 0, 0]}, {")"));
  absl::StatusOr<std::vector<BlendSegment>> back = ParseBlendSegmentsJson(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, segments);  // bit for bit
  EXPECT_EQ(BlendSegmentsJson({}), "[]");
  back = ParseBlendSegmentsJson("[]");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->empty());
}

TEST(BlendSegmentsJsonTest, EachBadElementIsNamed) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"start": 0})",
       R"(blend_history: want a list of segments, [{"start": 0, "weights": [0.5, 0.5], )"
       R"("ledger": [0, 0]}, ...], got {"start":0})"},
      {R"([3])",
       R"(blend_history[0]: want {"start": N, "weights": [...], "ledger": [...]}, got 3)"},
      {R"([{"start": 0, "weights": [1], "ledger": [0], "end": 5}])",
       "blend_history[0]: unknown key 'end' (want start, weights and ledger)"},
      {R"([{"start": 0, "weights": [1]}])", "blend_history[0]: no 'ledger'"},
      {R"([{"start": -1, "weights": [1], "ledger": [0]}])",
       "blend_history[0].start: want an integer >= 0, got -1"},
      {R"([{"start": 0, "weights": [1], "ledger": [0]}, {"start": 2.5, "weights": [1], )"
       R"("ledger": [0]}])",
       "blend_history[1].start: want an integer >= 0, got 2.5"},
      {R"([{"start": 0, "weights": 1, "ledger": [0]}])",
       "blend_history[0].weights: want a list, one a source, got 1"},
      {R"([{"start": 0, "weights": [1, -0.5], "ledger": [0, 0]}])",
       "blend_history[0].weights[1]: want a finite number >= 0, got -0.5"},
      {R"([{"start": 0, "weights": [1], "ledger": ["7"]}])",
       R"(blend_history[0].ledger[0]: want an integer >= 0, got "7")"},
  };
  for (const auto& [json, message] : bad) {
    absl::StatusOr<std::vector<BlendSegment>> parsed = ParseBlendSegmentsJson(json);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_EQ(parsed.status().message(), message);
  }
  absl::StatusOr<std::vector<BlendSegment>> parsed = ParseBlendSegmentsJson("[{");
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()),
              ::testing::StartsWith("blend_history: not JSON: "));
}

// What the daemon reports is checked as everything from the socket: one weight and one count
// a source, at most one segment more than the history sent.
TEST(BlendSegmentsFromReplyTest, TheReplyIsBoundedByTheRequest) {
  google::protobuf::RepeatedPtrField<v1::BlendSegment> reply;
  v1::BlendSegment* s = reply.Add();
  s->set_start(10);
  s->add_weights(0.5), s->add_weights(0.5);
  s->add_ledger(5), s->add_ledger(5);
  absl::StatusOr<std::vector<BlendSegment>> kept = BlendSegmentsFromReply(reply, 2, 0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, (std::vector<BlendSegment>{{10, {0.5, 0.5}, {5, 5}}}));
  EXPECT_TRUE(BlendSegmentsFromReply(reply, 0, 0)->empty());  // no blend: nothing kept
  EXPECT_EQ(BlendSegmentsFromReply(reply, 3, 0).status().message(),
            "attach: daemon sent a blend segment of 2 weights and 2 ledger entries for 3 sources");
  *reply.Add() = *s;
  EXPECT_EQ(BlendSegmentsFromReply(reply, 2, 0).status().message(),
            "attach: daemon sent 2 blend segments for a history of 0");
  EXPECT_EQ(BlendSegmentsFromReply(reply, 2, 1)->size(), 2u);
}

}  // namespace
}  // namespace gpufeed::client::internal
