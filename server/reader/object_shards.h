// Which objects an s3:// dataset path names (docs/howto/object-storage.md), in the forms a
// local path takes: `s3://bucket/dir/` (the objects directly in it: keys with no further '/'),
// a glob (`s3://bucket/dir/train_*.bin`) or braces (`s3://bucket/dir/train-{000..146}.tar`,
// each name an object that must exist unless it holds a glob itself) in the last component,
// or one object. A directory's names starting with '.' are left out, as local ones are.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/objstore/object_store.h"
#include "server/reader/dataset.h"

namespace gpufeed::server {

struct ObjectSelection {
  std::string bucket;
  std::string dir;  // the keys' common prefix, "" or ending in '/'
  // The selected names (keys less `dir`), in name order.
  std::vector<std::string> names;
  // Every name directly in `dir` where it was listed (a directory or a glob), sorted: where
  // companions (a Megatron X.idx, an S.offsets.npy) are looked for; empty for braces or one
  // object, whose companions are looked for by HEAD.
  std::vector<std::string> listed;
  bool one_object = false;                             // the path named one object
  std::string display(const std::string& name) const;  // "s3://bucket/dir/name"
};

// The objects `spec.path` names through `source`. `in_dir` says which names a bare directory
// selects (WebDataset: *.tar). `braces`: the last component may hold braces (WebDataset's
// form). INVALID_ARGUMENT naming dataset.path for a malformed path or when nothing matches
// (a path without '/' at the end that names no object but is a directory says so).
absl::StatusOr<ObjectSelection> SelectObjects(const FileDatasetSpec& spec,
                                              const objstore::ObjectSource& source,
                                              const std::function<bool(const std::string&)>& in_dir,
                                              bool braces);

// Opens `name` of `selection` (its HEAD with the caller's access). A one-object path that is
// no object but a directory is refused saying to end it with '/'.
absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenSelected(const ObjectSelection& selection,
                                                               const objstore::ObjectSource& source,
                                                               const std::string& name);

}  // namespace gpufeed::server
