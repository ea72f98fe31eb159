#include "server/reader/webdataset.h"

#include <fnmatch.h>

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/reader/object_shards.h"
#include "server/reader/shards.h"
#include "server/reader/tar_index.h"

namespace gpufeed::server {
namespace {

bool IsPattern(absl::string_view name) {
  return HasGlob(name) || name.find('{') != absl::string_view::npos;
}

// The shard names of a pattern in the directory: its brace expansion, each name as written
// (it must exist), or, where a name holds a glob, the directory's files that match one.
absl::StatusOr<std::vector<std::string>> PatternNames(const ShardDir& dir) {
  absl::StatusOr<std::vector<std::string>> expanded = ExpandBraces(dir.pattern);
  if (!expanded.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", expanded.status().message()));
  }
  std::vector<std::string> patterns = std::move(*expanded);
  if (std::none_of(patterns.begin(), patterns.end(),
                   [](const std::string& p) { return HasGlob(p); })) {
    std::sort(patterns.begin(), patterns.end());
    patterns.erase(std::unique(patterns.begin(), patterns.end()), patterns.end());
    return patterns;
  }
  return ListShardFiles(dir.fd, dir.dir, [&](const std::string& name) {
    return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) {
      return ::fnmatch(p.c_str(), name.c_str(), FNM_PERIOD) == 0;
    });
  });
}

// An explicit list's tars (spec.paths), in its order, opened beneath the directory passed;
// two names of one file refused.
absl::StatusOr<std::vector<WebDatasetShard>> OpenListedShards(const FileDatasetSpec& spec,
                                                              FileSystem* fs,
                                                              const PeerCred* reader) {
  GPUFEED_ASSIGN_OR_RETURN(const ShardList list, OpenShardList(spec));
  std::vector<WebDatasetShard> out;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, size_t> seen;
  for (size_t i = 0; i < list.relative.size(); ++i) {
    const std::string field = absl::StrCat("dataset.paths[", i, "]");
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file =
        fs->OpenForReadBeneath(list.dir.fd, list.relative[i], spec.paths[i], reader);
    if (!file.ok()) return Annotate(file.status(), field);
    if (const auto id = (*file)->identity(); id.has_value()) {
      const auto [it, fresh] = seen.emplace(*id, i);
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": ", spec.paths[i], " is the same file as dataset.paths[", it->second, "] (",
            spec.paths[it->second], "): each file may appear once"));
      }
    }
    out.push_back({std::move(*file), spec.paths[i]});
  }
  return out;
}

absl::StatusOr<std::vector<WebDatasetShard>> OpenShards(const FileDatasetSpec& spec, FileSystem* fs,
                                                        const PeerCred* reader) {
  if (spec.objects != nullptr) {  // s3:// (docs/howto/object-storage.md)
    GPUFEED_ASSIGN_OR_RETURN(
        const ObjectSelection selection,
        SelectObjects(
            spec, *spec.objects, [](const std::string& n) { return absl::EndsWith(n, ".tar"); },
            /*braces=*/true));
    std::vector<WebDatasetShard> out;
    // One HEAD a shard, each up to the retry bound: within folder_walk_timeout together.
    const WalkBudget walk(spec.walk, spec.path, "opening the shards of");
    for (const std::string& name : selection.names) {
      GPUFEED_RETURN_IF_ERROR(walk.Poll());
      GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                               OpenSelected(selection, *spec.objects, name));
      out.push_back({std::move(file), selection.display(name)});
    }
    return out;
  }
  if (!spec.paths.empty()) return OpenListedShards(spec, fs, reader);
  GPUFEED_ASSIGN_OR_RETURN(std::optional<ShardDir> dir, FindShardDir(spec, IsPattern));
  std::vector<WebDatasetShard> out;
  if (!dir.has_value()) {  // one tar file
    GPUFEED_ASSIGN_OR_RETURN(
        std::unique_ptr<RandomAccessFile> file,
        spec.fd >= 0 ? fs->OpenFromFd(spec.fd, spec.path) : fs->OpenForRead(spec.path));
    out.push_back({std::move(file), spec.path});
    return out;
  }
  std::vector<std::string> names;
  if (dir->pattern.empty()) {
    GPUFEED_ASSIGN_OR_RETURN(names, ListShardFiles(dir->fd, dir->dir, [](const std::string& n) {
                               return absl::EndsWith(n, ".tar");
                             }));
  } else {
    GPUFEED_ASSIGN_OR_RETURN(names, PatternNames(*dir));
  }
  if (names.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", spec.path, ": no ",
        dir->pattern.empty() ? ".tar file in the directory" : "file matches the pattern"));
  }
  if (names.size() > kMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: more than ", kMaxShards, " shards"));
  }
  // Each file once (else one tar hard-linked 700 times is indexed 700 times, in memory): a
  // second name of a shard is refused, not read again.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, size_t> seen;
  for (const std::string& name : names) {
    const std::string display = absl::StrCat(dir->dir == "/" ? "" : dir->dir, "/", name);
    GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs->OpenForReadBeneath(dir->fd, name, display, reader));
    if (const auto id = file->identity(); id.has_value()) {
      const auto [it, fresh] = seen.emplace(*id, out.size());
      if (!fresh) {
        return absl::InvalidArgumentError(
            absl::StrCat("dataset.path: ", display, " is the same file as ", out[it->second].name,
                         " (hard links): each shard may appear once"));
      }
    }
    out.push_back({std::move(file), display});
  }
  return out;
}

// The members of one key as they are grouped.
struct Group {
  std::string key;
  const TarMember* image = nullptr;
  const TarMember* label = nullptr;
  // Members named as an image after a second dot (`001.jpg`), and the first of them.
  int64_t dotted_images = 0;
  const TarMember* dotted = nullptr;
};

bool IsImageExtension(absl::string_view ext) {
  return ext == "jpg" || ext == "jpeg" || ext == "png";
}

// What a user whose keys hold dots reads, for `member` (img.001.jpg): how WebDataset split it.
std::string DottedHint(absl::string_view member) {
  const size_t base = member.find_last_of('/') + 1;
  const size_t dot = member.find('.', base);
  return absl::StrCat(EscapeForLog(member), " is key ", EscapeForLog(member.substr(0, dot)),
                      " with extension ", EscapeForLog(member.substr(dot + 1)),
                      "; WebDataset (and gpufeed) split a member's name at the first dot of its "
                      "last component: name keys without dots (img_001.jpg)");
}

}  // namespace

std::vector<DatasetNotice> WebDatasetNotices(const WebDatasetIndex& index) {
  const Skipped& left = index.without_image;
  if (left.count == 0) return {};
  DatasetNotice n;
  n.reason = "no_image";
  n.count = left.count;
  n.example = EscapeForLog(left.first);
  n.message =
      absl::StrCat(left.count, left.count == 1 ? " WebDataset key has" : " WebDataset keys have",
                   " no image (.jpg, .jpeg or .png) and ", left.count == 1 ? "is" : "are",
                   " left out (first: ", n.example, ")");
  if (index.dotted_keys > 0) {
    absl::StrAppend(
        &n.message, "; ", index.dotted_keys, " of them hold ", index.dotted_images,
        index.dotted_images == 1 ? " image" : " images", " whose names have more than one dot: in ",
        EscapeForLog(index.first_dotted_shard), ", ", DottedHint(index.first_dotted_member));
  } else {
    absl::StrAppend(&n.message,
                    "; only .jpg, .jpeg and .png members are images to gpufeed (bad_sample "
                    "\"fail\" refuses such keys)");
  }
  return {std::move(n)};
}

std::string WebDatasetIndex::display(uint64_t id) const {
  return absl::StrCat(shards[samples[id].shard].name, ":", member(id));
}

absl::StatusOr<WebDatasetIndex> IndexWebDataset(const FileDatasetSpec& spec, FileSystem* fs,
                                                const PeerCred* reader,
                                                const FolderWalkLimits& walk, bool skip_imageless) {
  WebDatasetIndex index;
  GPUFEED_ASSIGN_OR_RETURN(index.shards, OpenShards(spec, fs, reader));
  WalkBudget budget(walk, spec.path, "indexing");
  GPUFEED_ASSIGN_OR_RETURN(index.charge, TakeIndexCharge(walk));
  // What the index holds so far is charged after each shard: its growth is bounded by one
  // shard's members, themselves bounded by the shard's size and max_folder_entries.
  const auto charge_index = [&]() -> absl::Status {
    if (index.charge == nullptr) return absl::OkStatus();
    return index.charge->GrowTo(
        index.samples.capacity() * sizeof(WebDatasetSample) + index.names.capacity(),
        absl::StrCat("the index of ", spec.path, " (", index.samples.size(), " samples so far)"));
  };
  for (size_t k = 0; k < index.shards.size(); ++k) {
    GPUFEED_RETURN_IF_ERROR(charge_index());
    const WebDatasetShard& shard = index.shards[k];
    GPUFEED_ASSIGN_OR_RETURN(const std::vector<TarMember> members,
                             IndexTar(*shard.file, shard.name, &budget));
    const auto refuse = [&](const Group& g, const std::string& why) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.path: ", shard.name, ": key ", EscapeForLog(g.key), " ", why));
    };
    const auto finish = [&](const Group& g) -> absl::Status {
      if (g.key.empty()) return absl::OkStatus();
      if (g.image == nullptr) {
        if (skip_imageless) {
          index.without_image.Add(absl::StrCat(shard.name, ":", g.key));
          if (g.dotted != nullptr) {
            ++index.dotted_keys;
            index.dotted_images += g.dotted_images;
            if (index.dotted_keys == 1) {
              index.first_dotted_shard = shard.name;
              index.first_dotted_member = g.dotted->path;
            }
          }
          return absl::OkStatus();
        }
        return refuse(
            g, absl::StrCat(
                   "has no image (.jpg, .jpeg or .png); bad_sample: fail "
                   "refuses it",
                   g.dotted == nullptr ? "" : absl::StrCat(" (", DottedHint(g.dotted->path), ")")));
      }
      if (g.label == nullptr) {
        return refuse(g, absl::StrCat("(", EscapeForLog(g.image->path),
                                      ") has no label: a .cls member with its class index"));
      }
      if (g.label->data.size() != g.label->size) {
        return refuse(g, absl::StrCat("has a .cls of ", g.label->size,
                                      " bytes; a label is an ASCII integer"));
      }
      int64_t label = 0;
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(g.label->data), &label)) {
        return refuse(g, absl::StrCat("has a .cls of '", EscapeForLog(g.label->data, 64),
                                      "', not an integer"));
      }
      WebDatasetSample s;
      s.offset = g.image->offset;
      s.size = g.image->size;
      s.label = label;
      s.name_at = index.names.size();
      s.name_bytes = static_cast<uint32_t>(g.image->path.size());
      s.shard = static_cast<uint32_t>(k);
      index.names += g.image->path;
      index.samples.push_back(s);
      return index.samples.size() % 4096 == 0 ? charge_index() : absl::OkStatus();
    };
    Group group;
    for (const TarMember& m : members) {
      // WebDataset's split: the key up to the first '.' of the last component; a member
      // without one (or a dot file) belongs to no sample.
      const size_t base = m.path.find_last_of('/') + 1;
      const size_t dot = m.path.find('.', base);
      if (dot == std::string::npos || dot == base) continue;
      const absl::string_view key = absl::string_view(m.path).substr(0, dot);
      const std::string ext = absl::AsciiStrToLower(absl::string_view(m.path).substr(dot + 1));
      if (key != group.key) {
        GPUFEED_RETURN_IF_ERROR(finish(group));
        group = Group{std::string(key)};
      }
      if (IsImageExtension(ext)) {
        if (group.image != nullptr) {
          return refuse(group, absl::StrCat("has two images, ", EscapeForLog(group.image->path),
                                            " and ", EscapeForLog(m.path)));
        }
        group.image = &m;
      } else if (ext == "cls") {
        if (group.label != nullptr) return refuse(group, "has two .cls members");
        group.label = &m;
      } else if (const size_t last = ext.rfind('.');
                 last != std::string::npos &&
                 IsImageExtension(absl::string_view(ext).substr(last + 1))) {
        if (group.dotted_images++ == 0) group.dotted = &m;
      }
    }
    GPUFEED_RETURN_IF_ERROR(finish(group));
  }
  GPUFEED_RETURN_IF_ERROR(charge_index());
  if (index.samples.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", spec.path, ": the ", index.shards.size(),
        " shards hold no sample (a key with a .jpg, .jpeg or .png and a .cls)",
        index.dotted_keys == 0 ? "" : absl::StrCat("; ", DottedHint(index.first_dotted_member))));
  }
  return index;
}

}  // namespace gpufeed::server
