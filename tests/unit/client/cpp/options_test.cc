// AttachOptions -> AttachRequest, checked without a daemon: what a good set of options asks
// for, and that each bad option is refused with a message that starts with its field's name.
#include "client/cpp/options.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/shard_list.h"
#include "gtest/gtest.h"

namespace gpufeed::client::internal {
namespace {

AttachOptions TokenOptions() {
  AttachOptions o;
  o.job = "gpt";
  o.rank = 1;
  o.world_size = 4;
  o.kind = "tokens";
  o.dataset = "/data/train.bin";
  o.token_dtype = "uint32";
  o.vocab_size = 50257;
  o.seq_len = 1024;
  o.batch_size = 16;
  o.seed = 7;
  o.shuffle = false;
  o.ring_slots = 3;
  o.start = {2, 5, "fp", 160};
  o.stop_epoch = 9;
  return o;
}

TEST(AttachPlanFromOptionsTest, TokensOnTheHost) {
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(TokenOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->device);
  const v1::AttachRequest& r = plan->request;
  EXPECT_EQ(r.job(), "gpt");
  EXPECT_EQ(r.rank(), 1);
  EXPECT_EQ(r.world_size(), 4);
  EXPECT_EQ(r.dataset().kind(), v1::DATASET_KIND_TOKENS);
  EXPECT_EQ(r.dataset().path(), "/data/train.bin");
  EXPECT_EQ(r.dataset().token_dtype(), v1::DTYPE_UINT32);
  EXPECT_EQ(r.dataset().vocab_size(), 50257u);
  EXPECT_EQ(r.dataset().seq_len(), 1024);
  EXPECT_EQ(r.batch_size(), 16);
  EXPECT_EQ(r.seed(), 7u);
  EXPECT_FALSE(r.shuffle());
  EXPECT_TRUE(r.drop_last());
  EXPECT_EQ(r.ring_slots(), 3);
  EXPECT_EQ(r.delivery().kind(), v1::DELIVERY_KIND_HOST);
  EXPECT_EQ(r.start().epoch(), 2);
  EXPECT_EQ(r.start().step(), 5);
  EXPECT_EQ(r.start().fingerprint(), "fp");
  EXPECT_EQ(r.start().samples(), 160);
  EXPECT_EQ(r.elastic(), v1::ELASTIC_KEEP_GLOBAL_BATCH);
  EXPECT_EQ(r.stop_epoch(), 9);
  EXPECT_EQ(r.bad_sample(), v1::BAD_SAMPLE_POLICY_SKIP);
  EXPECT_EQ(r.decode(), v1::IMAGE_DECODE_AUTO);
  EXPECT_EQ(r.augment(), v1::IMAGE_AUGMENT_AUTO);
  EXPECT_EQ(r.pipeline_size(), 0);
}

TEST(AttachPlanFromOptionsTest, AnEmptyTokenDtypeIsLeftToTheDaemon) {
  AttachOptions o = TokenOptions();
  o.token_dtype = "";
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->request.dataset().token_dtype(), v1::DTYPE_UNSPECIFIED);
}

TEST(AttachPlanFromOptionsTest, ImagesWithAPipeline) {
  AttachOptions o;
  o.kind = "image_folder";
  o.dataset = "/data/imagenet/train";
  o.bad_sample = "fail";
  o.decode = "cpu";
  o.augment = "gpu";
  o.pipeline_json =
      R"({"ops": [{"resize": {"shorter_side": 256}}, {"center_crop": {"size": 224}}]})";
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::AttachRequest& r = plan->request;
  EXPECT_EQ(r.dataset().kind(), v1::DATASET_KIND_IMAGE_FOLDER);
  EXPECT_EQ(r.bad_sample(), v1::BAD_SAMPLE_POLICY_FAIL);
  EXPECT_EQ(r.decode(), v1::IMAGE_DECODE_CPU);
  EXPECT_EQ(r.augment(), v1::IMAGE_AUGMENT_GPU);
  ASSERT_EQ(r.pipeline_size(), 2);
  EXPECT_EQ(r.pipeline(0).resize().shorter_side(), 256);
  EXPECT_EQ(r.pipeline(1).center_crop().size(), 224);
}

TEST(AttachPlanFromOptionsTest, APipelineInShortNames) {
  AttachOptions o;
  o.kind = "image_folder";
  o.dataset = "/data/imagenet/train";
  o.pipeline_json = R"({"ops": [{"random_resized_crop": {"size": 224, "scale": [0.25, 1]}},)"
                    R"( {"cast": "bfloat16"}, {"layout": "nhwc"}]})";
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::AttachRequest& r = plan->request;
  ASSERT_EQ(r.pipeline_size(), 3);
  EXPECT_EQ(r.pipeline(0).random_resized_crop().size(), 224);
  EXPECT_EQ(r.pipeline(0).random_resized_crop().scale_min(), 0.25f);
  EXPECT_EQ(r.pipeline(0).random_resized_crop().scale_max(), 1.0f);
  EXPECT_EQ(r.pipeline(1).cast().dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(r.pipeline(2).layout().layout(), v1::IMAGE_LAYOUT_NHWC);
}

TEST(AttachPlanFromOptionsTest, EachBadOptionIsRefusedByName) {
  struct Case {
    std::string field;
    std::function<void(AttachOptions&)> spoil;
  };
  const std::vector<Case> cases = {
      {"token_dtype", [](AttachOptions& o) { o.token_dtype = "float32"; }},
      {"vocab_size", [](AttachOptions& o) { o.vocab_size = -1; }},
      {"kind", [](AttachOptions& o) { o.kind = "parquet"; }},
      {"bad_sample", [](AttachOptions& o) { o.bad_sample = "ignore"; }},
      {"decode", [](AttachOptions& o) { o.decode = "gpu"; }},
      {"augment", [](AttachOptions& o) { o.augment = "nvjpeg"; }},
      {"delivery", [](AttachOptions& o) { o.delivery = "disk"; }},
      {"pipeline", [](AttachOptions& o) { o.pipeline_json = "{\"ops\": 3}"; }},
      {"elastic", [](AttachOptions& o) { o.elastic = "keep_global_batch"; }},
  };
  for (const Case& c : cases) {
    AttachOptions o = TokenOptions();
    c.spoil(o);
    absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_TRUE(absl::StartsWith(plan.status().message(), c.field + ": "))
        << c.field << ": " << plan.status();
  }
}

TEST(AttachPlanFromOptionsTest, TheMessageSaysWhatIsWanted) {
  AttachOptions o = TokenOptions();
  o.delivery = "disk";
  EXPECT_EQ(AttachPlanFromOptions(o).status().message(),
            "delivery: unknown kind 'disk' (want host or device)");
}

TEST(AttachPlanFromOptionsTest, ElasticNamesTheModeAResumeAtAnotherWorldSizeKeeps) {
  AttachOptions o = TokenOptions();
  o.elastic = "rank_batch";
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->request.elastic(), v1::ELASTIC_KEEP_RANK_BATCH);
  o.elastic = "rank";
  EXPECT_EQ(AttachPlanFromOptions(o).status().message(),
            "elastic: want global_batch or rank_batch, got 'rank'");
}

TEST(AttachPlanFromOptionsTest, AListOfShardFilesIsSentInOrderOrRefusedByEntry) {
  AttachOptions o = TokenOptions();
  o.dataset.clear();
  o.dataset_paths = {"/b/1.bin", "/a/0.bin"};
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::DatasetSpec& d = plan->request.dataset();
  ASSERT_EQ(d.paths_size(), 2);
  EXPECT_EQ(d.paths(0), "/b/1.bin");
  EXPECT_EQ(d.paths(1), "/a/0.bin");
  EXPECT_EQ(d.path(), "");  // set when the files are opened (their common directory)
  const std::vector<std::pair<std::function<void(AttachOptions&)>, std::string>> bad = {
      {[](AttachOptions& o) { o.dataset_paths[1] = "a/0.bin"; },
       "dataset.paths[1]: 'a/0.bin' is not an absolute path of a file"},
      {[](AttachOptions& o) { o.dataset = "/data"; },
       "dataset: '/data' and a list of 2 shard files (dataset_paths) given together; give one"},
      {[](AttachOptions& o) { o.kind = "records"; },
       "dataset.paths: a list of shard files is for kind tokens and webdataset, not records"},
      {[](AttachOptions& o) { o.dataset_paths.assign(16385, "/a/0.bin"); },
       "dataset.paths: 16385 files, at most 16384; name their directory or a glob instead"},
  };
  for (const auto& [spoil, message] : bad) {
    AttachOptions spoilt = o;
    spoil(spoilt);
    EXPECT_EQ(AttachPlanFromOptions(spoilt).status().message(), message);
  }
}

TEST(AttachPlanFromOptionsTest, EachDatasetKindIsItsEnum) {
  for (const auto& [name, kind] : std::vector<std::pair<std::string, v1::DatasetKind>>{
           {"tokens", v1::DATASET_KIND_TOKENS},
           {"records", v1::DATASET_KIND_RECORDS},
           {"image_folder", v1::DATASET_KIND_IMAGE_FOLDER},
           {"webdataset", v1::DATASET_KIND_WEBDATASET}}) {
    AttachOptions o;
    o.kind = name;
    o.dataset = "/data/x";
    absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
    ASSERT_TRUE(plan.ok()) << name << ": " << plan.status();
    EXPECT_EQ(plan->request.dataset().kind(), kind) << name;
    EXPECT_EQ(plan->request.dataset().path(), "/data/x") << name;
  }
}

// The arrays of a records dataset are names in one directory: `dataset` when given, else the
// directory the absolute paths share.
TEST(AttachPlanFromOptionsTest, RecordsArraysAreNamesInOneDirectory) {
  AttachOptions o;
  o.kind = "records";
  o.dataset = "/data/rec";
  o.arrays = {{"x", "images.npy"}, {"y", "labels.npy"}};
  absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::DatasetSpec& d = plan->request.dataset();
  EXPECT_EQ(d.path(), "/data/rec");
  ASSERT_EQ(d.arrays_size(), 2);
  EXPECT_EQ(d.arrays(0).name(), "x");
  EXPECT_EQ(d.arrays(0).file(), "images.npy");
  EXPECT_EQ(d.arrays(1).name(), "y");
  EXPECT_EQ(d.arrays(1).file(), "labels.npy");

  o.dataset.clear();
  o.arrays = {{"x", "/data/rec/images.npy"}, {"y", "/data/rec/labels.npy"}};
  plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->request.dataset().path(), "/data/rec");
  EXPECT_EQ(plan->request.dataset().arrays(0).file(), "images.npy");
  EXPECT_EQ(plan->request.dataset().arrays(1).file(), "labels.npy");
  o.arrays = {{"x", "/images.npy"}};
  plan = AttachPlanFromOptions(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->request.dataset().path(), "/");

  const std::vector<std::pair<std::vector<std::pair<std::string, std::string>>, std::string>>
      bad = {
          {{{"x", "images.npy"}},
           "arrays: 'x' is 'images.npy'; without dataset (the arrays' directory) each file must "
           "be an absolute path"},
          {{{"x", "/data/rec/"}},
           "arrays: 'x' is '/data/rec/'; without dataset (the arrays' directory) each file must "
           "be an absolute path"},
          {{{"x", "/a/images.npy"}, {"y", "/b/labels.npy"}},
           "arrays: 'x' (/a/images.npy) and 'y' (/b/labels.npy) lie in different directories; "
           "the arrays of one records dataset share one"},
      };
  for (const auto& [arrays, message] : bad) {
    o.arrays = arrays;
    plan = AttachPlanFromOptions(o);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(plan.status().message(), message);
  }
  o.kind = "tokens";
  o.arrays = {{"x", "/a/images.npy"}};
  EXPECT_EQ(AttachPlanFromOptions(o).status().message(), "arrays: only for kind records, not tokens");
}

TEST(AttachPlanFromOptionsTest, TooManyBytesOfShardPathsAreRefused) {
  AttachOptions o = TokenOptions();
  o.dataset.clear();
  // 8 files of 1 MiB names each: few enough files, too many bytes.
  o.dataset_paths.assign(8, "/" + std::string((1 << 20) - 1, 'a'));
  EXPECT_EQ(AttachPlanFromOptions(o).status().message(),
            "dataset.paths: 8388608 bytes of paths, at most " +
                std::to_string(kMaxListedShardBytes) + "; name their directory or a glob instead");
}

}  // namespace
}  // namespace gpufeed::client::internal
