#include "server/reader/shards.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/os/file.h"
#include "common/shard_list.h"
#include "common/status.h"

namespace gpufeed::server {
namespace {

// The integers of a range body "A..B" (digits only), zero-padded to the wider bound when a
// bound has a leading zero; nullopt when `body` is no range.
absl::StatusOr<std::optional<std::vector<std::string>>> RangeOf(absl::string_view body,
                                                                size_t max_names) {
  const size_t dots = body.find("..");
  if (dots == absl::string_view::npos) return std::nullopt;
  const absl::string_view a = body.substr(0, dots), b = body.substr(dots + 2);
  auto digits = [](absl::string_view s) {
    return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), absl::ascii_isdigit);
  };
  if (!digits(a) || !digits(b)) return std::nullopt;
  uint64_t from = 0, to = 0;
  for (char c : a) from = from * 10 + static_cast<uint64_t>(c - '0');
  for (char c : b) to = to * 10 + static_cast<uint64_t>(c - '0');
  const uint64_t count = (from <= to ? to - from : from - to) + 1;
  if (count > max_names) {
    return absl::InvalidArgumentError(
        absl::StrCat("the range {", body, "} makes ", count, " names, more than ", max_names));
  }
  const bool padded = (a.size() > 1 && a[0] == '0') || (b.size() > 1 && b[0] == '0');
  const size_t width = padded ? std::max(a.size(), b.size()) : 0;
  std::vector<std::string> out;
  out.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    std::string v = absl::StrCat(from <= to ? from + i : from - i);
    if (v.size() < width) v.insert(0, width - v.size(), '0');
    out.push_back(std::move(v));
  }
  return out;
}

// The last component of the path the directory `fd` was opened by, as this process sees it
// ("" when unknown): a client in a container may name it otherwise.
std::string OpenedBaseName(int fd) {
  char name[PATH_MAX];
  const ssize_t n = ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), name, sizeof(name) - 1);
  const std::string opened = n > 0 ? std::string(name, static_cast<size_t>(n)) : "";
  return opened.substr(opened.find_last_of('/') + 1);
}

}  // namespace

bool HasGlob(absl::string_view name) {
  return name.find_first_of("*?[") != absl::string_view::npos;
}

absl::StatusOr<std::vector<std::string>> ExpandBraces(absl::string_view pattern, size_t max_names) {
  for (size_t open = pattern.find('{'); open != absl::string_view::npos;
       open = pattern.find('{', open + 1)) {
    // The matching brace, and the commas at this brace's own depth.
    size_t depth = 0, close = absl::string_view::npos;
    std::vector<size_t> commas;
    for (size_t i = open; i < pattern.size() && close == absl::string_view::npos; ++i) {
      if (pattern[i] == '{') {
        ++depth;
      } else if (pattern[i] == '}') {
        if (--depth == 0) close = i;
      } else if (pattern[i] == ',' && depth == 1) {
        commas.push_back(i);
      }
    }
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", pattern, "': the '{' at ", open, " has no matching '}'"));
    }
    std::vector<std::string> alternatives;
    if (!commas.empty()) {
      size_t from = open + 1;
      commas.push_back(close);
      for (size_t comma : commas) {
        alternatives.emplace_back(pattern.substr(from, comma - from));
        from = comma + 1;
      }
    } else {
      GPUFEED_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> range,
                               RangeOf(pattern.substr(open + 1, close - open - 1), max_names));
      if (!range.has_value()) continue;  // "{x}": no expansion, as the shell leaves it
      alternatives = std::move(*range);
    }
    const absl::string_view prefix = pattern.substr(0, open);
    GPUFEED_ASSIGN_OR_RETURN(std::vector<std::string> rest,
                             ExpandBraces(pattern.substr(close + 1), max_names));
    if (static_cast<__uint128_t>(alternatives.size()) * rest.size() > max_names) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", pattern, "' makes more than ", max_names, " names"));
    }
    std::vector<std::string> out;
    for (const std::string& alternative : alternatives) {
      GPUFEED_ASSIGN_OR_RETURN(std::vector<std::string> inner,
                               ExpandBraces(alternative, max_names));
      for (const std::string& i : inner) {
        for (const std::string& r : rest) {
          if (out.size() >= max_names) {
            return absl::InvalidArgumentError(
                absl::StrCat("'", pattern, "' makes more than ", max_names, " names"));
          }
          out.push_back(absl::StrCat(prefix, i, r));
        }
      }
    }
    return out;
  }
  return std::vector<std::string>{std::string(pattern)};
}

absl::StatusOr<std::optional<ShardDir>> FindShardDir(
    const FileDatasetSpec& spec, const std::function<bool(absl::string_view)>& is_pattern) {
  const size_t slash = spec.path.find_last_of('/');
  const std::string base = spec.path.substr(slash + 1);
  const std::string parent = spec.path.substr(0, std::max<size_t>(slash, 1));
  ShardDir out;
  bool pattern = false;
  struct stat st {};
  if (spec.fd >= 0) {
    if (::fstat(spec.fd, &st) != 0 || !S_ISDIR(st.st_mode)) return std::nullopt;
    out.fd = spec.fd;
    pattern = is_pattern(base) && OpenedBaseName(spec.fd) != base;
  } else if (::stat(spec.path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) return std::nullopt;
    out.own.Reset(::open(spec.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!out.own.valid()) {
      return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", spec.path));
    }
    out.fd = out.own.get();
  } else if (is_pattern(base)) {
    out.own.Reset(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!out.own.valid()) return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", parent));
    out.fd = out.own.get();
    pattern = true;
  } else {
    return std::nullopt;  // no such file: the single-file open words the error
  }
  out.dir = pattern ? parent : spec.path;
  if (pattern) out.pattern = base;
  return out;
}

absl::StatusOr<std::optional<ShardDir>> FindPairedFile(const FileDatasetSpec& spec,
                                                       absl::string_view suffix,
                                                       absl::string_view companion) {
  const size_t slash = spec.path.find_last_of('/');
  const std::string base = spec.path.substr(slash + 1);
  const std::string parent = spec.path.substr(0, std::max<size_t>(slash, 1));
  if (slash == std::string::npos || base.size() <= suffix.size() || !absl::EndsWith(base, suffix) ||
      HasGlob(base)) {
    return std::nullopt;
  }
  ShardDir out;
  struct stat st {};
  if (spec.fd >= 0) {
    if (::fstat(spec.fd, &st) != 0 || !S_ISDIR(st.st_mode) || OpenedBaseName(spec.fd) == base ||
        ::fstatat(spec.fd, base.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return std::nullopt;
    }
    out.fd = spec.fd;
  } else {
    if (::stat(spec.path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
    out.own.Reset(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!out.own.valid()) return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", parent));
    const std::string beside = absl::StrCat(base.substr(0, base.size() - suffix.size()), companion);
    if (::fstatat(out.own.get(), beside.c_str(), &st, 0) != 0 || !S_ISREG(st.st_mode)) {
      return std::nullopt;
    }
    out.fd = out.own.get();
  }
  out.dir = parent;
  out.pattern = base;
  out.exact = true;
  return out;
}

absl::Status ValidateShardPaths(const FileDatasetSpec& spec) {
  const std::vector<std::string>& paths = spec.paths;
  if (paths.empty()) return absl::OkStatus();
  if (spec.kind != DatasetKind::kTokens && spec.kind != DatasetKind::kWebDataset) {
    return absl::InvalidArgumentError(
        "dataset.paths: only for kind tokens and webdataset (an explicit list of shard files)");
  }
  if (paths.size() > kMaxListedShards) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.paths: ", paths.size(),
                                                   " files, at most ", kMaxListedShards,
                                                   "; name their directory or a glob instead"));
  }
  size_t bytes = 0;
  for (const std::string& p : paths) bytes += p.size();
  if (bytes > kMaxListedShardBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.paths: ", bytes, " bytes of paths, at most ", kMaxListedShardBytes,
                     "; name their directory or a glob instead"));
  }
  const std::string& dir = spec.path;
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: with dataset.paths, the absolute directory the files lie beneath (the "
        "client library sets it), got '",
        absl::CHexEscape(dir.substr(0, 256)), "'"));
  }
  const std::string prefix = dir == "/" ? "/" : absl::StrCat(dir, "/");
  absl::flat_hash_map<absl::string_view, size_t> seen;
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::string& p = paths[i];
    const std::string field = absl::StrCat("dataset.paths[", i, "]");
    if (!absl::StartsWith(p, prefix) || p.size() == prefix.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", absl::CHexEscape(p.substr(0, 256)),
                       "' is not a file beneath dataset.path ", dir, " (the directory passed)"));
    }
    for (absl::string_view part : absl::StrSplit(absl::string_view(p).substr(prefix.size()), '/')) {
      if (part.empty() || part == "." || part == ".." || part.size() > 255 ||
          part.find('\0') != absl::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": '", absl::CHexEscape(p.substr(0, 256)),
            "' is not an absolute path of names (no empty, '.' or '..' component, no NUL, at "
            "most 255 bytes each)"));
      }
    }
    const auto [it, fresh] = seen.emplace(p, i);
    if (!fresh) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", p, " is dataset.paths[", it->second, "] again; each file may appear once"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardList> OpenShardList(const FileDatasetSpec& spec) {
  GPUFEED_RETURN_IF_ERROR(ValidateShardPaths(spec));
  ShardList out;
  if (spec.fd >= 0) {
    GPUFEED_RETURN_IF_ERROR(
        CheckFileKind(spec.fd, FileKind::kDirectory, spec.path, "dataset.path").status());
    out.dir.fd = spec.fd;
  } else {
    out.dir.own.Reset(::open(spec.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!out.dir.own.valid()) {
      return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", spec.path));
    }
    out.dir.fd = out.dir.own.get();
  }
  out.dir.dir = spec.path;
  const size_t skip = spec.path == "/" ? 1 : spec.path.size() + 1;
  for (const std::string& p : spec.paths) out.relative.push_back(p.substr(skip));
  return out;
}

std::string ShardPathsIdentity(const std::vector<std::string>& paths) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a, as ShardsIdentity
  for (const std::string& p : paths) {
    for (unsigned char c : p) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0) * 1099511628211ull;
  }
  return absl::StrCat(paths.size(), " files, fnv1a64 ", absl::Hex(h, absl::kZeroPad16));
}

absl::StatusOr<std::vector<std::string>> ListShardFiles(
    int dirfd, const std::string& dir, const std::function<bool(const std::string&)>& keep) {
  UniqueFd listing(::dup(dirfd));
  if (!listing.valid()) return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", dir));
  DIR* d = ::fdopendir(listing.get());
  if (d == nullptr) return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", dir));
  ::rewinddir(d);  // a dup shares the offset: start at the beginning whatever came before
  const int fd = listing.Release();  // the DIR owns it now
  std::vector<std::string> names;
  absl::Status status;
  while (true) {
    errno = 0;
    const dirent* e = ::readdir(d);
    if (e == nullptr) {
      if (errno != 0) status = ErrnoToStatus(errno, absl::StrCat("dataset.path: ", dir));
      break;
    }
    const std::string name = e->d_name;
    if (name.empty() || name[0] == '.' || !keep(name)) continue;
    struct stat st {};
    if (::fstatat(fd, e->d_name, &st, 0) != 0 || !S_ISREG(st.st_mode)) continue;
    names.push_back(name);
    if (names.size() > kMaxShards) {
      status = absl::InvalidArgumentError(
          absl::StrCat("dataset.path: ", dir, " holds more than ", kMaxShards, " files"));
      break;
    }
  }
  ::closedir(d);
  GPUFEED_RETURN_IF_ERROR(status);
  std::sort(names.begin(), names.end());
  return names;
}

namespace {

// Where a marker of `markers` is a part of `name` (split at '_', '-', '.'): [begin, end).
std::optional<std::pair<size_t, size_t>> MarkerIn(
    absl::string_view name, std::initializer_list<absl::string_view> markers) {
  size_t begin = 0;
  for (size_t i = 0; i <= name.size(); ++i) {
    if (i < name.size() && name[i] != '_' && name[i] != '-' && name[i] != '.') continue;
    const absl::string_view part = name.substr(begin, i - begin);
    for (absl::string_view m : markers) {
      if (absl::EqualsIgnoreCase(part, m)) return std::make_pair(begin, i);
    }
    begin = i + 1;
  }
  return std::nullopt;
}

}  // namespace

std::optional<DatasetNotice> MixedSplitNotice(const std::string& dir,
                                              const std::vector<std::string>& names) {
  const std::string* train = nullptr;
  const std::string* held_out = nullptr;
  std::pair<size_t, size_t> at;
  for (const std::string& name : names) {
    if (train == nullptr) {
      if (auto m = MarkerIn(name, {"train", "training"}); m.has_value()) {
        train = &name;
        at = *m;
        continue;
      }
    }
    if (held_out == nullptr && MarkerIn(name, {"val", "valid", "validation", "test"})) {
      held_out = &name;
    }
  }
  if (train == nullptr || held_out == nullptr) return std::nullopt;
  // The training name with what surrounds its marker made a wildcard: fineweb_train_000001.bin
  // gives *_train_*.bin, train.bin itself.
  const std::string& t = *train;
  const size_t dot = t.find_last_of('.');
  const std::string extension = dot != std::string::npos && dot >= at.second ? t.substr(dot) : "";
  std::string glob = at.first > 0 ? absl::StrCat("*", t.substr(at.first - 1, 1)) : "";
  absl::StrAppend(&glob, t.substr(at.first, at.second - at.first));
  if (at.second < t.size()) {
    absl::StrAppend(
        &glob, at.second == dot ? extension : absl::StrCat(t.substr(at.second, 1), "*", extension));
  }
  const std::string prefix = dir == "/" ? "/" : absl::StrCat(dir, "/");
  DatasetNotice notice;
  notice.reason = "warning";
  notice.example = absl::StrCat(prefix, *held_out);
  notice.message =
      absl::StrCat("dataset.path: ", dir, " holds training and held-out files together (", prefix,
                   t, " and ", notice.example,
                   "), and all of them are read as training data; to train on the training "
                   "split alone, name it: ",
                   prefix, glob);
  return notice;
}

std::string ShardsIdentity(size_t count, absl::FunctionRef<const std::string&(size_t)> name,
                           absl::FunctionRef<const RandomAccessFile&(size_t)> file) {
  // FNV-1a: a short, stable name for the list, not a defence against a forger (whoever can
  // write the shards can write a checkpoint too).
  uint64_t h = 14695981039346656037ull, t = h;
  auto mix = [](uint64_t& into, absl::string_view bytes) {
    for (unsigned char c : bytes) into = (into ^ c) * 1099511628211ull;
  };
  const absl::string_view nul("\0", 1);
  for (size_t k = 0; k < count; ++k) {
    const std::string& n = name(k);
    mix(h, absl::string_view(n).substr(n.find_last_of('/') + 1));
    mix(h, nul);
    mix(h, absl::StrCat(file(k).size()));
    mix(h, nul);
    // An object's ETag (its content's version; "" for a file).
    if (const std::string v = file(k).version(); !v.empty()) {
      mix(h, v);
      mix(h, nul);
    }
    mix(t, absl::StrCat(file(k).modified_ns()));
    mix(t, nul);
  }
  return absl::StrCat(count, " files, fnv1a64 ", absl::Hex(h, absl::kZeroPad16), kShardTimesPart,
                      absl::Hex(t, absl::kZeroPad16));
}

absl::Status CheckShardsNotShrunk(size_t count, std::span<const int64_t> ids,
                                  absl::FunctionRef<const RandomAccessFile&(size_t)> file,
                                  absl::FunctionRef<size_t(int64_t)> shard_of) {
  bool every_leased = count <= 4 * std::max<size_t>(ids.size(), 1);
  for (size_t k = 0; every_leased && k < count; ++k) every_leased = file(k).watched_by_lease();
  if (every_leased) return absl::OkStatus();
  std::vector<size_t> read;
  if (ids.empty()) {
    for (size_t k = 0; k < count; ++k) read.push_back(k);
  }
  read.reserve(read.size() + ids.size());
  for (int64_t id : ids) read.push_back(shard_of(id));
  std::sort(read.begin(), read.end());
  read.erase(std::unique(read.begin(), read.end()), read.end());
  for (size_t k : read) GPUFEED_RETURN_IF_ERROR(file(k).CheckNotShrunk());
  return absl::OkStatus();
}

}  // namespace gpufeed::server
