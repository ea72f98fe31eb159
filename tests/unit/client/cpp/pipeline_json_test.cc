// Pipeline JSON -> v1::Pipeline without a daemon: the canonical (protobuf) form parses exactly
// as protobuf's parser reads it, each short name means its canonical spelling, and each
// refusal names the op's index, the op, the field and what is valid there.
#include "client/cpp/pipeline_json.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace gpufeed::client::internal {
namespace {

using google::protobuf::util::MessageDifferencer;

std::string ReadPipelineFile(const std::string& name) {
  std::ifstream in(std::string(GPUFEED_SOURCE_DIR) + "/deploy/pipelines/" + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// What protobuf's own parser makes of `json` (how the client read pipelines before).
v1::Pipeline ProtobufParse(const std::string& json) {
  v1::Pipeline pipeline;
  const auto parsed = google::protobuf::util::JsonStringToMessage(json, &pipeline);
  EXPECT_TRUE(parsed.ok()) << parsed.message() << " in " << json;
  return pipeline;
}

std::string Ops(const std::string& ops) { return absl::StrCat(R"({"ops": [)", ops, "]}"); }

TEST(ParsePipelineJsonTest, TheDeployedFilesParseAsProtobufReadsThem) {
  for (const char* name : {"imagenet_train.json", "imagenet_eval.json"}) {
    const std::string json = ReadPipelineFile(name);
    ASSERT_FALSE(json.empty()) << name;
    absl::StatusOr<v1::Pipeline> parsed = ParsePipelineJson(json);
    ASSERT_TRUE(parsed.ok()) << name << ": " << parsed.status();
    EXPECT_EQ(parsed->ops_size(), 5) << name;
    EXPECT_TRUE(MessageDifferencer::Equals(*parsed, ProtobufParse(json)))
        << name << ": " << parsed->DebugString();
  }
}

// Protobuf's JSON also takes lowerCamelCase names, enum numbers, quoted numbers and null
// fields: pipelines written so before keep parsing to the same proto. (An op given as null,
// which it took for no op and the daemon refused, is refused here, below.)
TEST(ParsePipelineJsonTest, EveryCanonicalSpellingParsesAsBefore) {
  const std::vector<std::string> cases = {
      Ops(R"({"randomResizedCrop": {"size": 224, "scaleMin": 0.5, "ratioMax": 2}})"),
      Ops(R"({"resize": {"shorterSide": "256"}}, {"centerCrop": {"size": 224}})"),
      Ops(R"({"cast": {"dtype": 10}}, {"layout": {"layout": 2}})"),
      Ops(R"({"decode": {"dctScaling": true}}, {"flip": {"p": null}})"),
      Ops(""),
      R"({"ops": null})",
      "{}",
  };
  for (const std::string& json : cases) {
    absl::StatusOr<v1::Pipeline> parsed = ParsePipelineJson(json);
    ASSERT_TRUE(parsed.ok()) << json << ": " << parsed.status();
    EXPECT_TRUE(MessageDifferencer::Equals(*parsed, ProtobufParse(json))) << json;
  }
}

TEST(ParsePipelineJsonTest, EachShortNameMeansItsCanonicalSpelling) {
  struct Case {
    std::string short_form, canonical;
  };
  const std::vector<Case> cases = {
      {R"({"cast": {"dtype": "uint8"}})", R"({"cast": {"dtype": "DTYPE_UINT8"}})"},
      {R"({"cast": {"dtype": "float16"}})", R"({"cast": {"dtype": "DTYPE_FLOAT16"}})"},
      {R"({"cast": {"dtype": "bfloat16"}})", R"({"cast": {"dtype": "DTYPE_BFLOAT16"}})"},
      {R"({"cast": {"dtype": "float32"}})", R"({"cast": {"dtype": "DTYPE_FLOAT32"}})"},
      {R"({"cast": {"dtype": "Float16"}})", R"({"cast": {"dtype": "DTYPE_FLOAT16"}})"},
      {R"({"layout": {"layout": "nchw"}})", R"({"layout": {"layout": "IMAGE_LAYOUT_NCHW"}})"},
      {R"({"layout": {"layout": "nhwc"}})", R"({"layout": {"layout": "IMAGE_LAYOUT_NHWC"}})"},
      {R"({"layout": {"layout": "NHWC"}})", R"({"layout": {"layout": "IMAGE_LAYOUT_NHWC"}})"},
      {R"({"random_resized_crop": {"size": 224, "scale": [0.25, 0.5]}})",
       R"({"random_resized_crop": {"size": 224, "scale_min": 0.25, "scale_max": 0.5}})"},
      {R"({"random_resized_crop": {"size": 224, "ratio": [0.5, 2]}})",
       R"({"random_resized_crop": {"size": 224, "ratio_min": 0.5, "ratio_max": 2}})"},
      // An op of one field, given its value alone.
      {R"({"resize": 256})", R"({"resize": {"shorter_side": 256}})"},
      {R"({"center_crop": 224})", R"({"center_crop": {"size": 224}})"},
      {R"({"flip": 0.5})", R"({"flip": {"p": 0.5}})"},
      {R"({"cast": "bfloat16"})", R"({"cast": {"dtype": "DTYPE_BFLOAT16"}})"},
      {R"({"layout": "nhwc"})", R"({"layout": {"layout": "IMAGE_LAYOUT_NHWC"}})"},
      {R"({"decode": true})", R"({"decode": {"dct_scaling": true}})"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::Pipeline> parsed = ParsePipelineJson(Ops(c.short_form));
    ASSERT_TRUE(parsed.ok()) << c.short_form << ": " << parsed.status();
    const v1::Pipeline want = ProtobufParse(Ops(c.canonical));
    EXPECT_TRUE(MessageDifferencer::Equals(*parsed, want))
        << c.short_form << " gave " << parsed->DebugString() << " want " << want.DebugString();
  }
}

// README.md's short forms of the two deployed files.
TEST(ParsePipelineJsonTest, TheReadmeShortFormsEqualTheDeployedFiles) {
  const std::string train = Ops(R"(
      {"random_resized_crop": {"size": 224, "scale": [0.08, 1.0], "ratio": [0.75, 1.3333333]}},
      {"flip": 0.5},
      {"normalize": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
      {"cast": "float16"},
      {"layout": "nchw"})");
  const std::string eval = Ops(R"(
      {"resize": 256},
      {"center_crop": 224},
      {"normalize": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
      {"cast": {"dtype": "float16"}},
      {"layout": {"layout": "nchw"}})");
  for (const auto& [json, file] :
       {std::pair{train, "imagenet_train.json"}, std::pair{eval, "imagenet_eval.json"}}) {
    absl::StatusOr<v1::Pipeline> parsed = ParsePipelineJson(json);
    ASSERT_TRUE(parsed.ok()) << file << ": " << parsed.status();
    EXPECT_TRUE(MessageDifferencer::Equals(*parsed, ProtobufParse(ReadPipelineFile(file))))
        << file << ": " << parsed->DebugString();
  }
}

TEST(ParsePipelineJsonTest, EachRefusalSaysWhereAndWhatIsValid) {
  const std::string ops =
      "ops are: random_resized_crop, resize, center_crop, flip, normalize, cast, layout, decode";
  struct Case {
    std::string json, message;
  };
  const std::vector<Case> cases = {
      {Ops(R"({"resize": {"size": 256}})"),
       R"(pipeline.ops[0] resize: no field "size"; resize takes: shorter_side)"},
      {Ops(R"({"resize": 256}, {"random_resized_crop": {"size": 224, "area": [0.1, 1]}})"),
       R"(pipeline.ops[1] random_resized_crop: no field "area"; random_resized_crop takes: )"
       R"(size, scale [lo, hi] (or scale_min, scale_max), ratio [lo, hi] (or ratio_min, )"
       R"(ratio_max))"},
      {Ops(R"({"center_crop": 224}, {"blur": {"sigma": 1}})"),
       absl::StrCat(R"(pipeline.ops[1]: no op "blur"; )", ops)},
      {Ops(R"({"resize": 256, "center_crop": 224})"),
       "pipeline.ops[0]: one op an entry, got 2 (center_crop, resize)"},
      {Ops("{}"),
       absl::StrCat(R"(pipeline.ops[0]: want one op, as {"name": {fields}}, got {}; )", ops)},
      {Ops(R"("resize")"),
       absl::StrCat(R"(pipeline.ops[0]: want one op, as {"name": {fields}}, got "resize"; )", ops)},
      {Ops(R"({"cast": {"dtype": "int8"}})"),
       R"(pipeline.ops[0] cast: dtype: no value "int8"; want uint8, float16, bfloat16, float32)"},
      {Ops(R"({"cast": "half"})"),
       R"(pipeline.ops[0] cast: dtype: no value "half"; want uint8, float16, bfloat16, float32)"},
      {Ops(R"({"layout": {"layout": "chw"}})"),
       R"(pipeline.ops[0] layout: layout: no value "chw"; want nchw, nhwc)"},
      {Ops(R"({"random_resized_crop": {"size": 224, "scale": [0.1]}})"),
       "pipeline.ops[0] random_resized_crop: scale: want [lo, hi], two numbers, got [0.1]"},
      {Ops(R"({"random_resized_crop": {"size": 224, "ratio": 0.75}})"),
       "pipeline.ops[0] random_resized_crop: ratio: want [lo, hi], two numbers, got 0.75"},
      {Ops(R"({"random_resized_crop": {"size": 224, "scale": [0.1, 1], "scale_min": 0.2}})"),
       R"(pipeline.ops[0] random_resized_crop: scale_min: given twice (as "scale" and )"
       R"("scale_min"))"},
      {Ops(R"({"resize": {"shorter_side": 256, "shorterSide": 256}})"),
       R"(pipeline.ops[0] resize: shorter_side: given twice (as "shorterSide" and )"
       R"("shorter_side"))"},
      {Ops(R"({"normalize": [0.5, 0.5, 0.5]})"),
       "pipeline.ops[0] normalize: want an object of fields, got [0.5,0.5,0.5]; normalize "
       "takes: mean, std"},
      {Ops(R"({"flip": null})"),
       "pipeline.ops[0] flip: want an object of fields, got null; flip takes: p"},
      {R"({"op": [], "ops": []})", R"(pipeline: no field "op"; a pipeline takes: ops)"},
      {R"({"ops": 3})", "pipeline: ops: want a list of ops, got 3"},
      {R"([{"resize": 256}])",
       R"(pipeline: want a JSON object {"ops": [...]}, got [{"resize":256}])"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::Pipeline> parsed = ParsePipelineJson(c.json);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_EQ(parsed.status().message(), c.message) << c.json;
  }
}

// A value of the wrong type is protobuf's message, after the op it is in; text that is not
// JSON says so.
TEST(ParsePipelineJsonTest, ABadValueOrBadJsonIsRefusedWithWhere) {
  struct Case {
    std::string json, prefix;
  };
  const std::vector<Case> cases = {
      {Ops(R"({"resize": 256}, {"center_crop": {"size": "big"}})"),
       "pipeline.ops[1] center_crop: "},
      {Ops(R"({"flip": {"p": [1]}})"), "pipeline.ops[0] flip: "},
      {Ops(R"({"cast": {"dtype": 1.5}})"), "pipeline.ops[0] cast: "},
      {R"({"ops": [)", "pipeline: not JSON: "},
      {"", "pipeline: not JSON: "},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::Pipeline> parsed = ParsePipelineJson(c.json);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_TRUE(absl::StartsWith(parsed.status().message(), c.prefix))
        << c.json << ": " << parsed.status();
  }
}

}  // namespace
}  // namespace gpufeed::client::internal
