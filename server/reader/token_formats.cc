#include "server/reader/token_formats.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/shard_list.h"
#include "common/status.h"
#include "server/reader/le_bytes.h"
#include "server/reader/npy.h"

namespace gpufeed::server {
namespace {

// llm.c (karpathy/llm.c, dev/data/data_common.py `write_datafile`, read by its dataloader.h
// and train_llama3.py): a header of 256 int32, little-endian (1024 bytes): [0] the magic,
// [1] the version, [2] the token count (an int32: < 2^31), the rest 0; then the tokens.
// "gpt-2": magic 20240520, version 1, uint16 tokens; "llama-3": magic 20240801, version 7,
// uint32 tokens. Magic 20240520 version 2 (uint32) is read too, as it was before version 7.
// `write_evalfile` (magic 20240522) writes evaluation examples (HellaSwag), not a stream.
constexpr uint32_t kLlmcMagic = 20240520;
constexpr uint32_t kLlmcLlama3Magic = 20240801;
constexpr uint32_t kLlmcEvalMagic = 20240522;
constexpr uint64_t kLlmcHeaderBytes = 256 * 4;
constexpr char kMegatronMagic[] = "MMIDIDX\0\0";  // a Megatron-LM indexed dataset's .idx

// A declared token_dtype must agree with what a shard's header says.
absl::Status AgreeWithDeclared(const FileDatasetSpec& spec, const std::string& name, DType found,
                               const char* format) {
  if (spec.token_dtype == DType::kUnspecified || spec.token_dtype == found) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "dataset.token_dtype: ", DTypeName(spec.token_dtype), ", but ", name, " is ", format, " of ",
      DTypeName(found), " (its header says so); leave token_dtype unset or set it to ",
      DTypeName(found)));
}

// Megatron-LM's .idx beside a .bin (megatron/core/datasets/indexed_dataset.py): magic,
// version 1 (uint64), the dtype code (uint8), the sequence count and the document count
// (uint64 each), then the sequences' sizes (int32, in tokens), their byte offsets (int64) and
// the document index. Returns the token type and the token count, which the .bin must hold
// exactly. The sizes are summed under `walk`'s deadline and cancel flag (a sparse .idx
// promising 10^12 sequences would otherwise keep the attach threads busy for many minutes).
absl::StatusOr<std::pair<DType, uint64_t>> ReadMegatronIndex(const MegatronIdx& idx,
                                                             const std::string& bin,
                                                             const WalkBudget& walk,
                                                             std::vector<uint32_t>* keep) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", idx.name, " (the .idx beside ", bin, "): ", why));
  };
  constexpr uint64_t kFixed = 9 + 8 + 1 + 8 + 8;
  std::string head(std::min<uint64_t>(kFixed, idx.file->size()), '\0');
  GPUFEED_RETURN_IF_ERROR(idx.file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(head.data()), head.size())));
  if (!absl::StartsWith(head, absl::string_view(kMegatronMagic, 9))) {
    return bad(
        absl::StrCat("not a Megatron-LM index: it starts '", absl::CHexEscape(head.substr(0, 9)),
                     "', not 'MMIDIDX\\0\\0'. A .bin with an .idx of its name beside it is read as "
                     "Megatron-LM's pair: rename the .idx, or name the files another way"));
  }
  if (head.size() < kFixed) return bad("a Megatron .idx shorter than its header");
  uint64_t version, sequences, documents;
  std::memcpy(&version, head.data() + 9, 8);
  const uint8_t code = static_cast<uint8_t>(head[17]);
  std::memcpy(&sequences, head.data() + 18, 8);
  std::memcpy(&documents, head.data() + 26, 8);
  if (version != 1) {
    return bad(absl::StrCat("Megatron .idx version ", version, "; version 1 is read"));
  }
  // Megatron's codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.
  DType dtype;
  if (code == 8) {
    dtype = DType::kUInt16;
  } else if (code == 4) {
    dtype = DType::kUInt32;  // int32 token ids, all >= 0: the same bytes as uint32
  } else {
    return bad(absl::StrCat("Megatron dtype code ", static_cast<int>(code),
                            "; tokens must be uint16 (8) or int32 (4)"));
  }
  const __uint128_t need = kFixed + static_cast<__uint128_t>(sequences) * (4 + 8) +
                           static_cast<__uint128_t>(documents) * 8;
  if (need > idx.file->size()) {
    return bad(absl::StrCat("the .idx promises ", sequences, " sequences and ", documents,
                            " documents but holds ", idx.file->size(), " bytes"));
  }
  uint64_t tokens = 0;
  std::vector<std::byte> sizes(std::min<uint64_t>(sequences, 1 << 16) * 4);
  for (uint64_t done = 0; done < sequences;) {
    GPUFEED_RETURN_IF_ERROR(walk.Poll());
    const uint64_t n = std::min<uint64_t>(sequences - done, sizes.size() / 4);
    GPUFEED_RETURN_IF_ERROR(
        idx.file->ReadAt(kFixed + done * 4, std::span<std::byte>(sizes.data(), n * 4)));
    for (uint64_t i = 0; i < n; ++i) {
      int32_t v;
      std::memcpy(&v, sizes.data() + i * 4, 4);
      if (v < 0) return bad(absl::StrCat("sequence ", done + i, " has a negative size"));
      tokens += static_cast<uint64_t>(v);
      if (keep != nullptr) keep->push_back(static_cast<uint32_t>(v));
    }
    done += n;
  }
  return std::make_pair(dtype, tokens);
}

}  // namespace

absl::Status ReadDocumentOffsets(const DocumentOffsets& offsets, const TokenShard& shard,
                                 const WalkBudget& walk, std::vector<uint32_t>* sizes) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", offsets.name,
                                                   " (the document offsets of ", shard.name,
                                                   "): ", why));
  };
  const RandomAccessFile& file = *offsets.file;
  std::string prefix(std::min<uint64_t>(file.size(), kNpyMaxHeaderBytes), '\0');
  GPUFEED_RETURN_IF_ERROR(file.ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(prefix.data()), prefix.size())));
  if (!absl::StartsWith(prefix, kNpyMagic)) return bad("not a .npy file");
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(prefix);
  if (!header.ok()) return bad(std::string(header.status().message()));
  const DType t = header->dtype;
  if (t != DType::kInt32 && t != DType::kInt64 && t != DType::kUInt32 && t != DType::kUInt64) {
    return bad(absl::StrCat("an array of ", DTypeName(t), "; offsets are int32, int64, uint32 or ",
                            "uint64"));
  }
  if (header->shape.size() != 1) {
    return bad(absl::StrCat("an array of ", header->shape.size(),
                            " dimensions; offsets are one: documents + 1 entries"));
  }
  const uint64_t entries = static_cast<uint64_t>(header->shape[0]);
  const uint64_t eb = DTypeSize(t);
  if (entries < 1) return bad("no entries; the first must be 0 and the last the token count");
  if (entries - 1 > shard.tokens) {
    return bad(absl::StrCat(entries - 1, " documents for ", shard.tokens,
                            " tokens: more documents than tokens"));
  }
  if (header->data_offset + static_cast<__uint128_t>(entries) * eb > file.size()) {
    return bad(absl::StrCat("truncated: its header promises ", entries, " entries"));
  }
  const bool is_signed = t == DType::kInt32 || t == DType::kInt64;
  std::vector<std::byte> buffer(std::min<uint64_t>(entries, 1 << 16) * eb);
  uint64_t last = 0;
  for (uint64_t done = 0; done < entries;) {
    GPUFEED_RETURN_IF_ERROR(walk.Poll());
    const uint64_t n = std::min<uint64_t>(entries - done, buffer.size() / eb);
    GPUFEED_RETURN_IF_ERROR(file.ReadAt(header->data_offset + done * eb,
                                        std::span<std::byte>(buffer.data(), n * eb)));
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t raw = 0;  // little-endian, 4 or 8 bytes (the .npy header said '<')
      bool negative;
      if (eb == 4) {
        uint32_t v;
        std::memcpy(&v, buffer.data() + i * 4, 4);
        raw = v;
        negative = is_signed && static_cast<int32_t>(v) < 0;
      } else {
        std::memcpy(&raw, buffer.data() + i * 8, 8);
        negative = is_signed && static_cast<int64_t>(raw) < 0;
      }
      const uint64_t at = done + i;
      if (negative || raw > shard.tokens) {
        return bad(absl::StrCat("entry ", at, " is ",
                                negative ? std::string("negative") : absl::StrCat(raw),
                                ", outside the shard's ", shard.tokens, " tokens"));
      }
      if (at == 0 && raw != 0) return bad(absl::StrCat("entry 0 is ", raw, ", not 0"));
      if (raw < last) {
        return bad(absl::StrCat("entry ", at, " (", raw, ") is less than entry ", at - 1, " (",
                                last, "): offsets never decrease"));
      }
      if (at > 0) {
        if (raw - last > 0xffffffffu) {
          return bad(absl::StrCat("document ", at - 1, " holds ", raw - last,
                                  " tokens; at most 2^32 - 1 a document"));
        }
        sizes->push_back(static_cast<uint32_t>(raw - last));
      }
      last = raw;
    }
    done += n;
  }
  if (last != shard.tokens) {
    return bad(absl::StrCat("the last entry is ", last, ", not the shard's token count ",
                            shard.tokens, ": offsets end where the tokens do"));
  }
  return absl::OkStatus();
}

namespace {

// An llm.c shard (the magic read already): version 1 or 2 of kLlmcMagic, 7 of
// kLlmcLlama3Magic; the header's count must make the file's size exactly.
absl::Status ReadLlmc(const FileDatasetSpec& spec, absl::string_view prefix, uint64_t size,
                      TokenShard& shard) {
  const std::string& name = shard.name;
  const uint32_t magic = Le32(prefix, 0);
  const uint32_t version = prefix.size() >= 8 ? Le32(prefix, 4) : 0;
  if (prefix.size() < kLlmcHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", name, " starts with llm.c's magic ", magic, " but holds ",
                     size, " bytes, less than llm.c's 1024-byte header: a truncated llm.c shard"));
  }
  DType found;
  if (magic == kLlmcMagic && (version == 1 || version == 2)) {
    found = version == 1 ? DType::kUInt16 : DType::kUInt32;
  } else if (magic == kLlmcLlama3Magic && version == 7) {
    found = DType::kUInt32;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", name, ": llm.c shard of magic ", magic, " version ", version,
        "; read are magic 20240520 version 1 (uint16 tokens, GPT-2) or 2 (uint32), and magic "
        "20240801 version 7 (uint32 tokens, Llama 3)"));
  }
  GPUFEED_RETURN_IF_ERROR(AgreeWithDeclared(spec, name, found, "an llm.c shard"));
  shard.dtype = found;
  shard.format = "llm.c";
  shard.data_offset = kLlmcHeaderBytes;
  shard.tokens = Le32(prefix, 8);
  const __uint128_t need =
      kLlmcHeaderBytes + static_cast<__uint128_t>(shard.tokens) * DTypeSize(found);
  if (need != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", name, ": its llm.c header counts ", shard.tokens, " tokens (",
        static_cast<uint64_t>(need), " bytes with the header), the file holds ", size, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ReadNpy(const FileDatasetSpec& spec, absl::string_view prefix, uint64_t size,
                     TokenShard& shard) {
  const std::string& name = shard.name;
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(prefix);
  if (!header.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", name, ": ", header.status().message()));
  }
  if (!IsTokenDType(header->dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", name, " is a .npy array of ",
                                                   DTypeName(header->dtype),
                                                   "; tokens must be uint16 or uint32"));
  }
  GPUFEED_RETURN_IF_ERROR(AgreeWithDeclared(spec, name, header->dtype, "a .npy array"));
  shard.dtype = header->dtype;
  shard.format = "npy";
  __uint128_t count = 1;
  for (int64_t d : header->shape) count *= static_cast<uint64_t>(d);
  const __uint128_t need = header->data_offset + count * DTypeSize(shard.dtype);
  if (need > size) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.path: ", name, " is truncated: its .npy header promises ",
                     static_cast<uint64_t>(count), " tokens, the file holds ",
                     (size - header->data_offset) / DTypeSize(shard.dtype)));
  }
  shard.data_offset = header->data_offset;
  shard.tokens = static_cast<uint64_t>(count);
  return absl::OkStatus();
}

// "/d/x.idx" -> "/d/x.bin".
std::string BinOf(const std::string& idx_name) {
  return absl::EndsWith(idx_name, ".idx")
             ? absl::StrCat(idx_name.substr(0, idx_name.size() - 4), ".bin")
             : "X.bin (the data beside X.idx)";
}

}  // namespace

absl::StatusOr<TokenShard> ProbeTokenShard(const FileDatasetSpec& spec,
                                           std::unique_ptr<RandomAccessFile> file, std::string name,
                                           const MegatronIdx& idx, const WalkBudget& walk,
                                           absl::string_view set_dir,
                                           const DocumentOffsets& offsets) {
  if (file->size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", name, " is empty"));
  }
  TokenShard shard;
  shard.name = std::move(name);
  const std::string& n = shard.name;
  if (absl::EndsWith(n, kOffsetsSuffix)) {
    // Read as tokens, a uint32 offsets array would pass for a shard: refused by its name.
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", n, " is a document-offsets file (read with the token shard of its name ",
        "beside it, S.offsets.npy with S.npy or S.bin), not token ids, and no such shard is ",
        "read: name the shard, or rename the file"));
  }
  std::string prefix(std::min<uint64_t>(file->size(), kNpyMaxHeaderBytes), '\0');
  GPUFEED_RETURN_IF_ERROR(file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(prefix.data()), prefix.size())));
  shard.dtype = spec.token_dtype == DType::kUnspecified ? DType::kUInt16 : spec.token_dtype;
  const uint32_t magic = prefix.size() >= 4 ? Le32(prefix, 0) : 0;
  if (idx.file != nullptr) {
    // Megatron's .bin is bare token ids: its .idx alone says what they are.
    GPUFEED_ASSIGN_OR_RETURN(
        const auto index,
        ReadMegatronIndex(idx, n, walk, spec.for_packing ? &shard.sequences : nullptr));
    GPUFEED_RETURN_IF_ERROR(AgreeWithDeclared(spec, n, index.first, "a Megatron dataset"));
    shard.dtype = index.first;
    shard.format = "megatron";
    if (static_cast<__uint128_t>(index.second) * DTypeSize(shard.dtype) != file->size()) {
      return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", n, " holds ", file->size(),
                                                     " bytes, but its .idx counts ", index.second,
                                                     " ", DTypeName(shard.dtype), " tokens"));
    }
    shard.tokens = index.second;
  } else if (absl::StartsWith(prefix, kNpyMagic)) {
    GPUFEED_RETURN_IF_ERROR(ReadNpy(spec, prefix, file->size(), shard));
  } else if (magic == kLlmcMagic || magic == kLlmcLlama3Magic) {
    GPUFEED_RETURN_IF_ERROR(ReadLlmc(spec, prefix, file->size(), shard));
  } else if (magic == kLlmcEvalMagic && prefix.size() >= 8 && Le32(prefix, 4) == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", n,
        " is an llm.c evaluation file (magic 20240522: HellaSwag-style examples), not a token "
        "stream; name the token shards (magic 20240520 or 20240801)"));
  } else if (absl::StartsWith(prefix, absl::string_view(kMegatronMagic, 9))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: ", n, " is a Megatron-LM index (.idx, magic MMIDIDX), not token ids; ",
        "name its .bin (", BinOf(n), ") or their directory: the .bin is read with the .idx ",
        "beside it"));
  } else {
    GPUFEED_ASSIGN_OR_RETURN(const std::optional<ForeignFormat> foreign,
                             SniffForeignFormat(*file, prefix));
    if (foreign.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", n, " is ", foreign->name, ", not token ids: ", foreign->advice,
          set_dir.empty() ? ""
                          : absl::StrCat("; or name only the token files (a glob such as ", set_dir,
                                         set_dir == "/" ? "" : "/", "*.bin)"),
          " (docs/howto/token-files.md lists what is read)"));
    }
    const uint64_t token_bytes = DTypeSize(shard.dtype);
    if (file->size() % token_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", n, " holds ", file->size(),
                                                     " bytes, not a whole number of ",
                                                     DTypeName(shard.dtype), " tokens"));
    }
    shard.tokens = file->size() / token_bytes;
  }
  if (spec.for_packing && idx.file != nullptr) shard.documents_from = idx.name;
  if (spec.for_packing && offsets.file != nullptr) {
    if (idx.file != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.path: ", n, " has two sets of documents, its Megatron .idx (", idx.name,
          ") and an offsets file (", offsets.name, "): remove or rename one"));
    }
    shard.sequences.clear();
    GPUFEED_RETURN_IF_ERROR(ReadDocumentOffsets(offsets, shard, walk, &shard.sequences));
    shard.documents_from = offsets.name;
  }
  shard.file = std::move(file);
  return shard;
}

}  // namespace gpufeed::server
