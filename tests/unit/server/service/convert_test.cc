// The shipped ImageNet pipelines parse (protobuf JSON, as gpufeedctl --pipeline reads them)
// and compile.
#include "server/service/convert.h"

#include <fstream>
#include <sstream>

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

}  // namespace
}  // namespace gpufeed::server
