#include "server/images/dataset.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed::server {

absl::StatusOr<std::unique_ptr<Dataset>> OpenDataset(const DatasetSpec& spec, FileSystem* fs) {
  if (spec.kind != DatasetKind::kTokens && spec.kind != DatasetKind::kRecords &&
      !IsImageKind(spec.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.kind: unknown kind ", static_cast<int>(spec.kind),
                     " (want tokens, records, image_folder or webdataset)"));
  }
  if (spec.objects == nullptr && (spec.path.empty() || spec.path[0] != '/')) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: must be an absolute path, got '", spec.path, "'"));
  }
  if (IsImageKind(spec.kind)) {
    GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<ImageDataset> images,
                             spec.kind == DatasetKind::kImageFolder ? OpenImageFolder(spec, fs)
                                                                    : OpenWebDataset(spec, fs));
    return std::unique_ptr<Dataset>(std::move(images));
  }
  return OpenFileDataset(spec, fs, spec.reader.has_value() ? &*spec.reader : nullptr);
}

}  // namespace gpufeed::server
