// The shipped ImageNet pipelines parse (protobuf JSON, as gpufeedctl --pipeline reads them)
// and compile.
#include "server/service/convert.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

absl::StatusOr<PipelinePlan> Load(const std::string& name) {
  std::ifstream in(std::string(GPUFEED_SOURCE_DIR) + "/deploy/pipelines/" + name);
  std::stringstream text;
  text << in.rdbuf();
  v1::Pipeline pipeline;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text.str(), &pipeline);
  if (!parsed.ok()) return absl::InvalidArgumentError(std::string(parsed.message()));
  absl::StatusOr<std::vector<PipelineStep>> steps = PipelineFromProto(pipeline.ops());
  if (!steps.ok()) return steps.status();
  return CompilePipeline(*steps);
}

TEST(ShippedPipelinesTest, ImagenetTrainAndEvalCompile) {
  absl::StatusOr<PipelinePlan> train = Load("imagenet_train.json");
  ASSERT_TRUE(train.ok()) << train.status();
  ASSERT_TRUE(train->random_resized_crop.has_value());
  EXPECT_EQ(train->random_resized_crop->size, 224);
  EXPECT_DOUBLE_EQ(train->random_resized_crop->options.scale_min, 0.08f);
  EXPECT_EQ(train->flip_p, 0.5);
  EXPECT_EQ(train->output.dtype, DType::kFloat16);
  EXPECT_FLOAT_EQ(train->output.std[2], 0.225f);
  absl::StatusOr<PipelinePlan> eval = Load("imagenet_eval.json");
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->resize->shorter_side, 256);
  EXPECT_EQ(eval->center_crop->size, 224);
  EXPECT_EQ(eval->flip_p, 0);
}

TEST(ShippedPipelinesTest, AnEmptyOpIsRefusedByIndex) {
  v1::Pipeline pipeline;
  pipeline.add_ops()->mutable_center_crop()->set_size(8);
  pipeline.add_ops();
  absl::StatusOr<std::vector<PipelineStep>> steps = PipelineFromProto(pipeline.ops());
  EXPECT_EQ(steps.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(steps.status().message(), "pipeline[1]: no op set");
}


TEST(ConvertTest, SessionInfoCarriesTheOwnerUid) {
  SessionSnapshot snapshot;
  snapshot.id = 7;
  snapshot.owner_uid = 4242;
  snapshot.job = "train";
  v1::SessionInfo info;
  ToProto(snapshot, &info);
  EXPECT_EQ(info.session_id(), 7u);
  EXPECT_EQ(info.owner_uid(), 4242u);
  EXPECT_EQ(info.job(), "train");
  EXPECT_EQ(v1::SessionInfo::descriptor()->FindFieldByName("owner_uid")->number(), 19);
}

// The conversion, then the spec's rules (server/session/attach_spec.h), as Attach runs them.
absl::StatusOr<AttachSpec> Checked(const v1::AttachRequest& r) {
  absl::StatusOr<AttachSpec> spec = AttachSpecFromProto(r);
  if (!spec.ok()) return spec.status();
  if (absl::Status valid = ValidateAttachSpec(*spec, 64); !valid.ok()) return valid;
  return spec;
}

// An explicit list of shard files: carried in order, checked (count first,
// entries named), and part of the feed's key.
TEST(ConvertTest, ShardPathsAreCarriedCheckedAndKeyed) {
  v1::AttachRequest r;
  r.set_job("j");
  r.set_world_size(1);
  r.set_batch_size(2);
  v1::DatasetSpec* d = r.mutable_dataset();
  d->set_kind(v1::DATASET_KIND_TOKENS);
  d->set_seq_len(4);
  d->set_path("/data");
  d->add_paths("/data/b/1.bin");
  d->add_paths("/data/a/0.bin");
  absl::StatusOr<AttachSpec> spec = Checked(r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->feed.dataset.paths, (std::vector<std::string>{"/data/b/1.bin", "/data/a/0.bin"}));
  const std::string key = spec->feed.Canonical();
  EXPECT_NE(key.find(";paths=2 files, fnv1a64 "), std::string::npos) << key;
  d->set_paths(0, "/data/a/0.bin");
  d->set_paths(1, "/data/b/1.bin");
  spec = Checked(r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_NE(spec->feed.Canonical(), key);  // another order, another feed
  d->add_paths("/data/a/0.bin");
  spec = Checked(r);
  EXPECT_EQ(spec.status().message(),
            "dataset.paths[2]: /data/a/0.bin is dataset.paths[0] again; each file may appear once");
  d->set_paths(2, "/etc/passwd");
  spec = Checked(r);
  EXPECT_EQ(spec.status().message(),
            "dataset.paths[2]: '/etc/passwd' is not a file beneath dataset.path /data (the "
            "directory passed)");
  for (int i = 0; i < 16384; ++i) d->add_paths(absl::StrCat("/data/", i));
  spec = Checked(r);
  EXPECT_EQ(spec.status().message(),
            "dataset.paths: 16387 files, at most 16384; name their directory or a glob instead");
  d->clear_paths();
  d->add_paths("/data/x.npy");
  d->set_kind(v1::DATASET_KIND_RECORDS);
  d->set_seq_len(0);
  spec = Checked(r);
  EXPECT_EQ(spec.status().message(),
            "dataset.paths: only for kind tokens and webdataset (an explicit list of shard files)");
}

// Enum values the core's types cannot hold are the conversion's to refuse, naming the field;
// the core takes the kind as given.
TEST(ConvertTest, AnUnknownDatasetKindIsRefused) {
  v1::AttachRequest r;
  r.set_job("j");
  r.set_world_size(1);
  r.set_batch_size(2);
  r.mutable_dataset()->set_path("/data/tokens.bin");
  absl::StatusOr<AttachSpec> spec = AttachSpecFromProto(r);  // kind unset
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spec.status().message(),
            "dataset.kind: unknown kind 0 (want tokens, records, image_folder or webdataset)");
  r.mutable_dataset()->set_kind(static_cast<v1::DatasetKind>(99));
  spec = AttachSpecFromProto(r);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spec.status().message(),
            "dataset.kind: unknown kind 99 (want tokens, records, image_folder or webdataset)");
}

}  // namespace
}  // namespace gpufeed::server
