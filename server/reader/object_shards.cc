#include "server/reader/object_shards.h"

#include <fnmatch.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/objstore/s3_uri.h"
#include "server/reader/image_folder.h"
#include "server/reader/shards.h"

namespace gpufeed::server {
namespace {

bool HasBrace(absl::string_view name) { return name.find('{') != absl::string_view::npos; }

// The names directly in `dir` (no further '/'), sorted, from a listing of `prefix` (which
// starts with `dir`).
absl::StatusOr<std::vector<std::string>> NamesIn(const objstore::ObjectSource& source,
                                                 const std::string& bucket, const std::string& dir,
                                                 const std::string& prefix,
                                                 const WalkBudget& walk) {
  GPUFEED_ASSIGN_OR_RETURN(std::vector<objstore::ObjectEntry> listed,
                           source.List(bucket, prefix, [&walk] { return walk.Poll(); }));
  std::vector<std::string> names;
  for (objstore::ObjectEntry& e : listed) {
    std::string name = e.key.substr(dir.size());
    if (name.empty() || name.find('/') != std::string::npos) continue;
    names.push_back(std::move(name));
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

std::string ObjectSelection::display(const std::string& name) const {
  // Keys as the store listed them may hold any byte: escaped as S3Url does.
  return objstore::S3Url(bucket, absl::StrCat(dir, name));
}

absl::StatusOr<ObjectSelection> SelectObjects(const FileDatasetSpec& spec,
                                              const objstore::ObjectSource& source,
                                              const std::function<bool(const std::string&)>& in_dir,
                                              bool braces) {
  GPUFEED_ASSIGN_OR_RETURN(const objstore::S3Path path,
                           objstore::ParseS3Path(spec.path, "dataset.path"));
  ObjectSelection out;
  out.bucket = path.bucket;
  const WalkBudget walk(spec.walk, spec.path, "listing");
  const size_t slash = path.key.find_last_of('/');
  out.dir = slash == std::string::npos ? "" : path.key.substr(0, slash + 1);
  const std::string last = path.key.substr(out.dir.size());
  if (HasGlob(out.dir) || (braces && HasBrace(out.dir))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", spec.path, ": a pattern may stand only in the last component"));
  }
  if (last.empty()) {  // a directory
    if (in_dir == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.path: ", spec.path, ": name one object, not a directory"));
    }
    GPUFEED_ASSIGN_OR_RETURN(out.listed, NamesIn(source, out.bucket, out.dir, out.dir, walk));
    for (const std::string& n : out.listed) {
      if (n[0] != '.' && in_dir(n)) out.names.push_back(n);
    }
  } else if (HasGlob(last) || (braces && HasBrace(last))) {
    std::vector<std::string> patterns = {last};
    if (braces) {
      absl::StatusOr<std::vector<std::string>> expanded = ExpandBraces(last);
      if (!expanded.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("dataset.path: ", expanded.status().message()));
      }
      patterns = *std::move(expanded);
    }
    if (std::none_of(patterns.begin(), patterns.end(),
                     [](const std::string& p) { return HasGlob(p); })) {
      std::sort(patterns.begin(), patterns.end());
      patterns.erase(std::unique(patterns.begin(), patterns.end()), patterns.end());
      out.names = std::move(patterns);  // each HEADed when opened: a missing one is named
    } else {
      // List only what the patterns' common literal start allows.
      size_t literal = last.find_first_of(braces ? "*?[{" : "*?[");
      GPUFEED_ASSIGN_OR_RETURN(out.listed,
                               NamesIn(source, out.bucket, out.dir,
                                       absl::StrCat(out.dir, last.substr(0, literal)), walk));
      for (const std::string& n : out.listed) {
        if (std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) {
              return ::fnmatch(p.c_str(), n.c_str(), FNM_PERIOD) == 0;
            })) {
          out.names.push_back(n);
        }
      }
    }
  } else {
    out.names = {last};
    out.one_object = true;
    return out;
  }
  if (out.names.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", spec.path,
        last.empty() ? ": no objects in that directory" : ": no object matches the pattern"));
  }
  if (out.names.size() > kMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: more than ", kMaxShards, " shards"));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenSelected(const ObjectSelection& selection,
                                                               const objstore::ObjectSource& source,
                                                               const std::string& name) {
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
      source.Open(selection.bucket, absl::StrCat(selection.dir, name));
  if (!file.ok() && absl::IsNotFound(file.status()) && selection.one_object) {
    const std::string as_dir = absl::StrCat(selection.dir, name, "/");
    // One entry tells (more is RESOURCE_EXHAUSTED, which tells too): no full listing.
    absl::StatusOr<std::vector<objstore::ObjectEntry>> inside =
        source.List(selection.bucket, as_dir, nullptr, 1);
    if ((inside.ok() && !inside->empty()) || absl::IsResourceExhausted(inside.status())) {
      return absl::NotFoundError(absl::StrCat(
          "dataset.path: ", selection.display(name), " is no object, but ", selection.display(name),
          "/ holds objects: end the path with '/' to read them"));
    }
  }
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("dataset.path: ", file.status().message()));
  }
  return file;
}

}  // namespace gpufeed::server
