#include "client/cpp/pipeline_json.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

// How: the text is parsed into a google.protobuf.Value (a JSON tree) by the JSON parser the
// client already links, rather than by a second JSON library; each op's keys are checked
// against v1.PipelineOp's descriptor (so the lists in the errors never fall behind the proto)
// and the short names rewritten; each op is then written back as JSON and parsed by protobuf's
// own parser into a v1.PipelineOp, so every value the canonical form took before (quoted
// numbers, enum numbers, null) it takes still, and a bad value is protobuf's message prefixed
// with the op.

namespace gpufeed::client::internal {
namespace {

namespace pb = google::protobuf;

// The short enum names of README.md, per op and field, and the proto enum value each means.
struct ShortName {
  absl::string_view op, field, name, proto_name;
};
constexpr ShortName kShortNames[] = {
    {"cast", "dtype", "uint8", "DTYPE_UINT8"},
    {"cast", "dtype", "float16", "DTYPE_FLOAT16"},
    {"cast", "dtype", "bfloat16", "DTYPE_BFLOAT16"},
    {"cast", "dtype", "float32", "DTYPE_FLOAT32"},
    {"layout", "layout", "nchw", "IMAGE_LAYOUT_NCHW"},
    {"layout", "layout", "nhwc", "IMAGE_LAYOUT_NHWC"},
};

template <typename... Parts>
absl::Status Invalid(const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(parts...));
}

// A value as the user wrote it, cut short: errors quote what they refuse.
std::string Show(const pb::Value& value) {
  std::string out;
  if (!pb::util::MessageToJsonString(value, &out).ok()) return "(unprintable)";
  if (out.size() > 48) out = absl::StrCat(out.substr(0, 45), "...");
  return out;
}

// Keys in sorted order: protobuf's map has none, and the first error should not depend on it.
std::vector<std::string> SortedKeys(const pb::Struct& s) {
  std::vector<std::string> keys;
  for (const auto& [key, value] : s.fields()) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// By the proto name or protobuf's JSON (lowerCamelCase) name, as protobuf's parser finds it.
const pb::FieldDescriptor* FindField(const pb::Descriptor& d, absl::string_view name) {
  for (int i = 0; i < d.field_count(); ++i) {
    const pb::FieldDescriptor* f = d.field(i);
    if (f->name() == name || f->json_name() == name) return f;
  }
  return nullptr;
}

// `scale` for scale_min and scale_max: {min, max}, or nulls where `key` is no such pair.
std::pair<const pb::FieldDescriptor*, const pb::FieldDescriptor*> RangeFields(
    const pb::Descriptor& d, absl::string_view key) {
  const pb::FieldDescriptor* lo = d.FindFieldByName(absl::StrCat(key, "_min"));
  const pb::FieldDescriptor* hi = d.FindFieldByName(absl::StrCat(key, "_max"));
  if (lo == nullptr || hi == nullptr) return {nullptr, nullptr};
  return {lo, hi};
}

std::string OpList() {
  const pb::Descriptor& d = *v1::PipelineOp::descriptor();
  std::vector<std::string> names;
  for (int i = 0; i < d.field_count(); ++i) names.push_back(d.field(i)->name());
  return absl::StrJoin(names, ", ");
}

// "size, scale [lo, hi] (or scale_min, scale_max), ...": every spelling an op's fields take.
std::string FieldList(const pb::Descriptor& d) {
  std::vector<std::string> names;
  for (int i = 0; i < d.field_count(); ++i) {
    const std::string& name = d.field(i)->name();
    const absl::string_view base(name.data(), name.size() >= 4 ? name.size() - 4 : 0);
    if (absl::EndsWith(name, "_max") && RangeFields(d, base).first != nullptr) continue;
    if (absl::EndsWith(name, "_min") && RangeFields(d, base).first != nullptr) {
      names.push_back(absl::StrCat(base, " [lo, hi] (or ", base, "_min, ", base, "_max)"));
    } else {
      names.push_back(name);
    }
  }
  return absl::StrJoin(names, ", ");
}

std::string ShortNamesOf(absl::string_view op, absl::string_view field) {
  std::vector<absl::string_view> names;
  for (const ShortName& s : kShortNames) {
    if (s.op == op && s.field == field) names.push_back(s.name);
  }
  return absl::StrJoin(names, ", ");
}

// One op's fields, spelt as protobuf's parser takes them, with who set each (for "twice").
class OpFields {
 public:
  OpFields(std::string where, const pb::FieldDescriptor& op)
      : where_(std::move(where)), op_(op), d_(*op.message_type()) {}

  // `key` as the user wrote it, short or canonical.
  absl::Status Add(const std::string& key, const pb::Value& value) {
    if (const auto [lo, hi] = RangeFields(d_, key); lo != nullptr) {
      const bool pair = value.kind_case() == pb::Value::kListValue &&
                        value.list_value().values_size() == 2 &&
                        value.list_value().values(0).kind_case() == pb::Value::kNumberValue &&
                        value.list_value().values(1).kind_case() == pb::Value::kNumberValue;
      if (!pair) {
        return Invalid(where_, ": ", key, ": want [lo, hi], two numbers, got ", Show(value));
      }
      GPUFEED_RETURN_IF_ERROR(Put(*lo, key, value.list_value().values(0)));
      return Put(*hi, key, value.list_value().values(1));
    }
    const pb::FieldDescriptor* f = FindField(d_, key);
    if (f == nullptr) {
      return Invalid(where_, ": no field \"", key, "\"; ", op_.name(), " takes: ", FieldList(d_));
    }
    if (f->enum_type() != nullptr && value.kind_case() == pb::Value::kStringValue &&
        f->enum_type()->FindValueByName(value.string_value()) == nullptr) {
      const std::string lower = absl::AsciiStrToLower(value.string_value());
      for (const ShortName& s : kShortNames) {
        if (s.op == op_.name() && s.field == f->name() && s.name == lower) {
          pb::Value canonical;
          canonical.set_string_value(std::string(s.proto_name));
          return Put(*f, key, canonical);
        }
      }
      return Invalid(where_, ": ", f->name(), ": no value ", Show(value), "; want ",
                     ShortNamesOf(op_.name(), f->name()));
    }
    return Put(*f, key, value);
  }

  // The op, as protobuf's parser reads it.
  absl::StatusOr<v1::PipelineOp> ToProto() && {
    pb::Value op;
    (*op.mutable_struct_value()->mutable_fields())[op_.name()].mutable_struct_value()->Swap(
        &fields_);
    std::string json;
    if (!pb::util::MessageToJsonString(op, &json).ok()) return Invalid(where_, ": unprintable");
    v1::PipelineOp out;
    const auto parsed = pb::util::JsonStringToMessage(json, &out);
    if (!parsed.ok()) return Invalid(where_, ": ", std::string(parsed.message()));
    return out;
  }

 private:
  absl::Status Put(const pb::FieldDescriptor& f, const std::string& key, const pb::Value& value) {
    auto [it, added] = set_by_.emplace(f.name(), key);
    if (!added) {
      return Invalid(where_, ": ", f.name(), ": given twice (as \"", it->second, "\" and \"", key,
                     "\")");
    }
    (*fields_.mutable_fields())[f.name()] = value;
    return absl::OkStatus();
  }

  const std::string where_;
  const pb::FieldDescriptor& op_;
  const pb::Descriptor& d_;
  pb::Struct fields_;
  std::map<std::string, std::string> set_by_;  // field -> the key that set it
};

absl::StatusOr<v1::PipelineOp> ParseOp(int index, const pb::Value& entry) {
  const std::string at = absl::StrCat("pipeline.ops[", index, "]");
  if (entry.has_struct_value() && entry.struct_value().fields_size() > 1) {
    return Invalid(at, ": one op an entry, got ", entry.struct_value().fields_size(), " (",
                   absl::StrJoin(SortedKeys(entry.struct_value()), ", "), ")");
  }
  if (!entry.has_struct_value() || entry.struct_value().fields_size() != 1) {
    return Invalid(at, ": want one op, as {\"name\": {fields}}, got ", Show(entry),
                   "; ops are: ", OpList());
  }
  const auto& [name, body] = *entry.struct_value().fields().begin();
  const pb::FieldDescriptor* op = FindField(*v1::PipelineOp::descriptor(), name);
  if (op == nullptr) return Invalid(at, ": no op \"", name, "\"; ops are: ", OpList());
  const pb::Descriptor& d = *op->message_type();
  OpFields fields(absl::StrCat(at, " ", op->name()), *op);
  // (protobuf's parser takes {"flip": null} as no op at all, which the daemon refuses.)
  if (body.has_struct_value()) {
    for (const std::string& key : SortedKeys(body.struct_value())) {
      GPUFEED_RETURN_IF_ERROR(fields.Add(key, body.struct_value().fields().at(key)));
    }
  } else if (d.field_count() == 1 && body.kind_case() != pb::Value::kNullValue) {
    // {"resize": 256}: an op of one field given its value alone.
    GPUFEED_RETURN_IF_ERROR(fields.Add(d.field(0)->name(), body));
  } else {
    return Invalid(at, " ", op->name(), ": want an object of fields, got ", Show(body), "; ",
                   op->name(), " takes: ", FieldList(d));
  }
  return std::move(fields).ToProto();
}

}  // namespace

absl::StatusOr<v1::Pipeline> ParsePipelineJson(absl::string_view json) {
  pb::Value root;
  const auto parsed = pb::util::JsonStringToMessage(std::string(json), &root);
  if (!parsed.ok()) return Invalid("pipeline: not JSON: ", std::string(parsed.message()));
  if (!root.has_struct_value()) {
    return Invalid("pipeline: want a JSON object {\"ops\": [...]}, got ", Show(root));
  }
  for (const std::string& key : SortedKeys(root.struct_value())) {
    if (key != "ops") return Invalid("pipeline: no field \"", key, "\"; a pipeline takes: ops");
  }
  v1::Pipeline pipeline;
  const auto ops = root.struct_value().fields().find("ops");
  if (ops == root.struct_value().fields().end() ||
      ops->second.kind_case() == pb::Value::kNullValue) {
    return pipeline;
  }
  if (!ops->second.has_list_value()) {
    return Invalid("pipeline: ops: want a list of ops, got ", Show(ops->second));
  }
  const pb::ListValue& list = ops->second.list_value();
  for (int i = 0; i < list.values_size(); ++i) {
    GPUFEED_ASSIGN_OR_RETURN(*pipeline.add_ops(), ParseOp(i, list.values(i)));
  }
  return pipeline;
}

}  // namespace gpufeed::client::internal
