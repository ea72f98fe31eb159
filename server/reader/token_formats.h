// Token files: what one file of a tokens dataset is, from its first bytes (raw only when
// nothing else fits). Known token headers are read as their format (llm.c, .npy, Megatron-LM's
// .bin with its .idx); known foreign formats (archives, compressed streams, Arrow, Parquet,
// images, text, ...) are refused naming the format; a file is read as raw token ids only
// when nothing matches. docs/howto/token-files.md's table states the same rules.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/os/file.h"
#include "server/reader/dataset.h"
#include "server/reader/image_folder.h"

namespace gpufeed::server {

inline bool IsTokenDType(DType t) { return t == DType::kUInt16 || t == DType::kUInt32; }

// One token file of a dataset: where its tokens start, how many, of which type, and its
// format (for messages).
struct TokenShard {
  std::unique_ptr<RandomAccessFile> file;
  std::string name;  // as messages name it
  uint64_t data_offset = 0;
  uint64_t tokens = 0;
  DType dtype = DType::kUInt16;
  const char* format = "raw";
  // The documents' sizes, in tokens, in file order, from a Megatron .bin's .idx or the
  // shard's offsets file (S.offsets.npy); only with FileDatasetSpec::for_packing (a packing
  // feed's documents), else empty. `documents_from` names where they came from ("" for none).
  std::vector<uint32_t> sequences;
  std::string documents_from;
};

// A tokens dataset's shards as opened (every one of one token type), for a feed that reads
// them otherwise than as windows: a blend's packing (feed/lm_dataset.h). The tokens dataset
// OpenFileDataset returns implements it (dynamic_cast from Dataset).
class TokenShardsView {
 public:
  virtual ~TokenShardsView() = default;
  virtual const std::vector<TokenShard>& shards() const = 0;
};

// A format a token file is not: its name as messages give it ("a tar archive") and what to do
// instead ("a WebDataset shard is kind webdataset").
struct ForeignFormat {
  const char* name;
  const char* advice;
};

// The foreign format `file` is by its first bytes (`prefix`: its first min(size, 64 KiB)
// bytes) and, for Parquet, its last four; nullopt when none matches. Only signatures long
// or structured enough that token ids do not make them by chance (the table in
// token_formats.cc says why, row by row).
absl::StatusOr<std::optional<ForeignFormat>> SniffForeignFormat(const RandomAccessFile& file,
                                                                absl::string_view prefix);

// A Megatron-LM .idx beside the .bin being probed, and its name for messages.
struct MegatronIdx {
  const RandomAccessFile* file = nullptr;
  std::string name;
};

// A document-offsets file beside the shard being probed (S.offsets.npy beside S.npy, S.bin,
// ...; common/shard_list.h), and its name for messages.
struct DocumentOffsets {
  const RandomAccessFile* file = nullptr;
  std::string name;
};

// One file's format, checked (docs/howto/token-files.md):
// - `idx` set: Megatron-LM's .bin (its .idx says the token type and count; the .bin must hold
//   exactly that many), the .idx's sizes summed under `walk`;
// - else by its first bytes: .npy (its header's dtype, uint16 or uint32), llm.c (the header's
//   token count checked against the size), a foreign format or a Megatron .idx (refused,
//   named), or else raw tokens of token_dtype (uint16 when unset).
// `set_dir`, when the file is one of a directory or glob's ("" for one file), is named in a
// refusal's advice (name only the token files). INVALID_ARGUMENT "dataset.path: NAME ...".
// For a packing feed (spec.for_packing), the documents: the .idx's sequences, or `offsets`
// (ReadDocumentOffsets); a shard with both is refused (which would be its documents?).
absl::StatusOr<TokenShard> ProbeTokenShard(const FileDatasetSpec& spec,
                                           std::unique_ptr<RandomAccessFile> file, std::string name,
                                           const MegatronIdx& idx, const WalkBudget& walk,
                                           absl::string_view set_dir = "",
                                           const DocumentOffsets& offsets = {});

// A shard's document offsets (docs/howto/token-files.md): a 1-D .npy of int32, int64, uint32
// or uint64 in CSR form, documents + 1 entries, the first 0, the last the shard's token count,
// never decreasing; document d is tokens [offsets[d], offsets[d + 1]). Appends the documents'
// sizes to `sizes` (an empty one kept: FindDocuments leaves it out). At most one document a
// token (more is a file of empty documents, refused); read under `walk`.
absl::Status ReadDocumentOffsets(const DocumentOffsets& offsets, const TokenShard& shard,
                                 const WalkBudget& walk, std::vector<uint32_t>* sizes);

}  // namespace gpufeed::server
