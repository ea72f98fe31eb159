#include "client/cpp/blend.h"

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "common/shard_list.h"
#include "common/status.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace gpufeed::client {
namespace {

namespace pb = google::protobuf;

// A double written so that it reads back as the same double: the weights a resume sends
// back are compared with the ones the daemon keeps.
std::string Number(double value) {
  char text[64];
  const std::to_chars_result written = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, written.ptr);
}

// A JSON number that is an integer >= 0 a double holds exactly (below 2^53: a blend's counts
// never come near it).
bool ReadCount(const pb::Value& v, uint64_t* out) {
  if (v.kind_case() != pb::Value::kNumberValue) return false;
  const double d = v.number_value();
  if (!(d >= 0 && d < 9007199254740992.0) || std::floor(d) != d) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

std::string Shown(const pb::Value& v) {
  std::string out;
  if (!pb::util::MessageToJsonString(v, &out).ok()) return "(unprintable)";
  if (out.size() > 48) out = absl::StrCat(out.substr(0, 45), "...");
  return out;
}

}  // namespace

std::string BlendSegmentsJson(const std::vector<BlendSegment>& segments) {
  std::string out = "[";
  for (size_t i = 0; i < segments.size(); ++i) {
    const BlendSegment& s = segments[i];
    absl::StrAppend(&out, i == 0 ? "" : ", ", "{\"start\": ", s.start, ", \"weights\": [");
    for (size_t k = 0; k < s.weights.size(); ++k) {
      absl::StrAppend(&out, k == 0 ? "" : ", ", Number(s.weights[k]));
    }
    absl::StrAppend(&out, "], \"ledger\": [");
    for (size_t k = 0; k < s.ledger.size(); ++k) {
      absl::StrAppend(&out, k == 0 ? "" : ", ", s.ledger[k]);
    }
    absl::StrAppend(&out, "]}");
  }
  absl::StrAppend(&out, "]");
  return out;
}

absl::StatusOr<std::vector<BlendSegment>> ParseBlendSegmentsJson(std::string_view json) {
  // How: the JSON parser the client already links (protobuf's, into a google.protobuf.Value
  // tree, as pipeline_json.cc does), then each element checked by hand so that an error
  // names it.
  pb::Value root;
  if (const auto parsed = pb::util::JsonStringToMessage(std::string(json), &root); !parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("blend_history: not JSON: ", std::string(parsed.message())));
  }
  constexpr char kShape[] =
      "a list of segments, [{\"start\": 0, \"weights\": [0.5, 0.5], \"ledger\": [0, 0]}, ...]";
  if (root.kind_case() != pb::Value::kListValue) {
    return absl::InvalidArgumentError(
        absl::StrCat("blend_history: want ", kShape, ", got ", Shown(root)));
  }
  std::vector<BlendSegment> segments;
  for (int i = 0; i < root.list_value().values_size(); ++i) {
    const pb::Value& entry = root.list_value().values(i);
    const std::string at = absl::StrCat("blend_history[", i, "]");
    if (entry.kind_case() != pb::Value::kStructValue) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ": want {\"start\": N, \"weights\": [...], \"ledger\": [...]}, got ", Shown(entry)));
    }
    const auto& fields = entry.struct_value().fields();
    std::vector<std::string> unknown;
    for (const auto& [key, value] : fields) {
      if (key != "start" && key != "weights" && key != "ledger") unknown.push_back(key);
    }
    if (!unknown.empty()) {
      std::sort(unknown.begin(), unknown.end());  // the first error should not depend on a map
      return absl::InvalidArgumentError(absl::StrCat(at, ": unknown key '", unknown.front(),
                                                     "' (want start, weights and ledger)"));
    }
    for (const char* key : {"start", "weights", "ledger"}) {
      if (fields.find(key) == fields.end()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ": no '", key, "'"));
      }
    }
    BlendSegment segment;
    if (!ReadCount(fields.at("start"), &segment.start)) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".start: want an integer >= 0, got ", Shown(fields.at("start"))));
    }
    for (const char* key : {"weights", "ledger"}) {
      if (fields.at(key).kind_case() != pb::Value::kListValue) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ".", key, ": want a list, one a source, got ", Shown(fields.at(key))));
      }
    }
    const pb::ListValue& weights = fields.at("weights").list_value();
    for (int k = 0; k < weights.values_size(); ++k) {
      const pb::Value& w = weights.values(k);
      if (w.kind_case() != pb::Value::kNumberValue || !std::isfinite(w.number_value()) ||
          w.number_value() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ".weights[", k, "]: want a finite number >= 0, got ", Shown(w)));
      }
      segment.weights.push_back(w.number_value());
    }
    const pb::ListValue& ledger = fields.at("ledger").list_value();
    for (int k = 0; k < ledger.values_size(); ++k) {
      uint64_t count = 0;
      if (!ReadCount(ledger.values(k), &count)) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, ".ledger[", k, "]: want an integer >= 0, got ", Shown(ledger.values(k))));
      }
      segment.ledger.push_back(count);
    }
    segments.push_back(std::move(segment));
  }
  return segments;
}

namespace internal {
namespace {

constexpr char kPatternChars[] = "*?[";

template <typename... Parts>
absl::Status Invalid(const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(parts...));
}

// "blend[1] '/data/code/*.bin'": how errors name a source.
std::string SourceName(size_t index, const std::string& name) {
  return absl::StrCat("blend[", index, "] '", name, "'");
}

// The regular files (links followed) directly in `dir` whose names do not start with '.'
// and, with a `pattern`, match it; sorted. gpufeedd lists a shard directory by this rule
// (ListShardFiles), so a blend's source names what the same path would as a dataset.
absl::StatusOr<std::vector<std::string>> ListFiles(const std::string& source,
                                                   const std::string& dir,
                                                   const std::string& pattern) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat(source, ": listing ", dir));
  DIR* d = ::fdopendir(fd.get());
  if (d == nullptr) return ErrnoToStatus(errno, absl::StrCat(source, ": listing ", dir));
  const int dir_fd = fd.Release();  // the DIR owns it now
  std::vector<std::string> names;
  absl::Status status;
  while (true) {
    errno = 0;
    const dirent* e = ::readdir(d);
    if (e == nullptr) {
      if (errno != 0) status = ErrnoToStatus(errno, absl::StrCat(source, ": listing ", dir));
      break;
    }
    const std::string name = e->d_name;
    if (name.empty() || name[0] == '.') continue;
    if (!pattern.empty() && ::fnmatch(pattern.c_str(), name.c_str(), FNM_PERIOD) != 0) continue;
    struct stat st {};
    if (::fstatat(dir_fd, e->d_name, &st, 0) != 0 || !S_ISREG(st.st_mode)) continue;
    names.push_back(name);
  }
  ::closedir(d);
  GPUFEED_RETURN_IF_ERROR(status);
  std::sort(names.begin(), names.end());
  // An X.idx goes with its X.bin, an S.offsets.npy with its shard (the daemon opens them
  // beside the listed shard): no files of their own. One without its shard stays, for the
  // daemon to refuse, named.
  std::vector<std::string> kept;
  for (const std::string& name : names) {
    if (!IsCompanionIn(name, names)) kept.push_back(name);
  }
  return kept;
}

absl::StatusOr<std::string> RealPath(const std::string& source, const std::string& path) {
  char real[PATH_MAX];
  if (::realpath(path.c_str(), real) == nullptr) {
    return ErrnoToStatus(errno, absl::StrCat(source, ": resolving ", path));
  }
  return std::string(real);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandBlendSource(size_t index, const std::string& name) {
  const std::string source = SourceName(index, name);
  if (name.empty()) {
    return Invalid("blend[", index, "]: no name; a source is the absolute path of a token file, ",
                   "a directory or a glob (/data/code/*.bin)");
  }
  if (name[0] != '/') return Invalid(source, ": not an absolute path");
  const size_t slash = name.rfind('/');
  const std::string base = name.substr(slash + 1);
  const std::string parent = slash == 0 ? "/" : name.substr(0, slash);
  std::string dir = name;
  std::string pattern;
  if (base.find_first_of(kPatternChars) != std::string::npos) {
    dir = parent;
    pattern = base;
  } else {
    struct stat st {};
    if (::stat(name.c_str(), &st) != 0) {
      const absl::Status status = ErrnoToStatus(errno, source);
      if (parent.find_first_of(kPatternChars) == std::string::npos) return status;
      return absl::Status(status.code(), absl::StrCat(status.message(),
                                                      " (a pattern may only be in the last "
                                                      "component, /data/code/*.bin)"));
    }
    if (S_ISREG(st.st_mode)) {
      GPUFEED_ASSIGN_OR_RETURN(std::string real, RealPath(source, name));
      return std::vector<std::string>{std::move(real)};
    }
    if (!S_ISDIR(st.st_mode)) {
      return Invalid(source, ": ", FileTypeName(st.st_mode),
                     ", not a token file, a directory or a glob");
    }
  }
  GPUFEED_ASSIGN_OR_RETURN(const std::vector<std::string> names, ListFiles(source, dir, pattern));
  if (names.empty()) {
    return Invalid(source, pattern.empty() ? ": no files in the directory" : ": no files match");
  }
  const std::string prefix = absl::EndsWith(dir, "/") ? dir : absl::StrCat(dir, "/");
  std::vector<std::string> files;
  files.reserve(names.size());
  for (const std::string& n : names) {
    GPUFEED_ASSIGN_OR_RETURN(std::string real, RealPath(source, absl::StrCat(prefix, n)));
    files.push_back(std::move(real));
  }
  return files;
}

namespace {

// AttachOptions.pack's names of the pack modes.
constexpr std::pair<const char*, v1::PackMode> kPack[] = {{"none", v1::PACK_MODE_NONE},
                                                          {"concat", v1::PACK_MODE_CONCAT},
                                                          {"best_fit", v1::PACK_MODE_BEST_FIT}};

}  // namespace

const char* PackModeName(v1::PackMode mode) {
  for (const auto& [name, value] : kPack) {
    if (value == mode) return name;
  }
  return "unknown";
}

absl::Status BlendInto(const AttachOptions& o, v1::DatasetSpec* d) {
  const bool tokens = d->kind() == v1::DATASET_KIND_TOKENS;
  bool known = false;
  for (const auto& [name, value] : kPack) {
    if (o.pack == name) d->set_pack(value), known = true;
  }
  if (!known) return Invalid("pack: want none, concat or best_fit, got '", o.pack, "'");
  if (d->pack() != v1::PACK_MODE_NONE && !tokens) {
    return Invalid("pack: packs the documents of token files, for kind tokens, not ", o.kind);
  }
  constexpr int64_t kMaxU32 = std::numeric_limits<uint32_t>::max();
  if (o.eos_id.has_value()) {
    if (d->pack() == v1::PACK_MODE_NONE) {
      return Invalid("eos_id: ends the documents packing packs; with pack none there is no ",
                     "packing (set pack concat or best_fit)");
    }
    if (*o.eos_id < 0 || *o.eos_id > kMaxU32) {
      return Invalid("eos_id: want a token, 0 to ", kMaxU32, ", got ", *o.eos_id);
    }
    d->set_eos_id(*o.eos_id);
  }
  if (o.pack_lookahead != 0) {
    if (d->pack() != v1::PACK_MODE_BEST_FIT) {
      return Invalid("pack_lookahead: the documents best_fit packs together; pack is ", o.pack);
    }
    if (o.pack_lookahead < 0 || o.pack_lookahead > kMaxU32) {
      return Invalid("pack_lookahead: want 1 to ", kMaxU32, " (0: the daemon's default), got ",
                     o.pack_lookahead);
    }
    d->set_pack_lookahead(static_cast<uint32_t>(o.pack_lookahead));
  }
  if (o.blend.empty()) {
    if (!o.blend_history.empty()) {
      return Invalid("blend_history: ", o.blend_history.size(),
                     " segments of a blend, but no blend given");
    }
    return absl::OkStatus();
  }
  if (!tokens) return Invalid("blend: a blend of token sources is for kind tokens, not ", o.kind);
  if (!o.dataset.empty()) {
    return Invalid("dataset: '", o.dataset, "' and a blend of ", o.blend.size(),
                   " sources given together; give one");
  }
  if (!o.dataset_paths.empty()) {
    return Invalid("dataset.paths: a list of ", o.dataset_paths.size(),
                   " shard files and a blend of ", o.blend.size(),
                   " sources given together; give one");
  }
  if (o.blend.size() > kMaxBlendSources) {
    return Invalid("blend: ", o.blend.size(), " sources, at most ", kMaxBlendSources);
  }
  // Every weight before any file: a typo in one is said without listing directories first.
  for (size_t i = 0; i < o.blend.size(); ++i) {
    const double w = o.blend[i].weight;
    if (!(std::isfinite(w) && w > 0)) {
      return Invalid(SourceName(i, o.blend[i].name), ": weight must be > 0 and finite, got ", w);
    }
  }
  size_t bytes = 0;
  for (size_t i = 0; i < o.blend.size(); ++i) {
    const BlendSource& b = o.blend[i];
    GPUFEED_ASSIGN_OR_RETURN(std::vector<std::string> files, ExpandBlendSource(i, b.name));
    if (files.size() > kMaxListedShards) {
      return Invalid(SourceName(i, b.name), ": ", files.size(), " files, at most ",
                     kMaxListedShards, " a source");
    }
    v1::BlendSource* s = d->add_sources();
    for (std::string& f : files) {
      bytes += f.size();
      s->add_paths(std::move(f));
    }
    s->set_weight(b.weight);
    s->set_name(b.name);
  }
  if (bytes > kMaxListedShardBytes) {
    return Invalid("blend: ", bytes, " bytes of paths in ", o.blend.size(), " sources, at most ",
                   kMaxListedShardBytes, "; name fewer files");
  }
  for (size_t i = 0; i < o.blend_history.size(); ++i) {
    const BlendSegment& s = o.blend_history[i];
    if (s.weights.size() != s.ledger.size() || s.weights.empty()) {
      return Invalid("blend_history[", i, "]: ", s.weights.size(), " weights and ", s.ledger.size(),
                     " ledger entries; a segment has one of each a source");
    }
  }
  BlendHistoryInto(o.blend_history, d);
  return absl::OkStatus();
}

void BlendHistoryInto(const std::vector<BlendSegment>& segments, v1::DatasetSpec* d) {
  d->clear_blend_history();
  for (const BlendSegment& s : segments) {
    v1::BlendSegment* out = d->add_blend_history();
    out->set_start(s.start);
    out->mutable_weights()->Add(s.weights.begin(), s.weights.end());
    out->mutable_ledger()->Add(s.ledger.begin(), s.ledger.end());
  }
}

absl::StatusOr<std::vector<BlendSegment>> BlendSegmentsFromReply(
    const google::protobuf::RepeatedPtrField<v1::BlendSegment>& reply, int sources, int history) {
  if (sources == 0) return std::vector<BlendSegment>{};  // no blend: nothing to keep
  if (reply.size() > history + 1) {
    return absl::InternalError(absl::StrCat("attach: daemon sent ", reply.size(),
                                            " blend segments for a history of ", history));
  }
  std::vector<BlendSegment> segments;
  for (const v1::BlendSegment& s : reply) {
    if (s.weights_size() != sources || s.ledger_size() != sources) {
      return absl::InternalError(absl::StrCat("attach: daemon sent a blend segment of ",
                                              s.weights_size(), " weights and ", s.ledger_size(),
                                              " ledger entries for ", sources, " sources"));
    }
    segments.push_back(BlendSegment{s.start(),
                                    {s.weights().begin(), s.weights().end()},
                                    {s.ledger().begin(), s.ledger().end()}});
  }
  return segments;
}

}  // namespace internal
}  // namespace gpufeed::client
