#include "server/reader/token_formats.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/reader/npy.h"

namespace gpufeed::server {
namespace {

uint32_t Le32(absl::string_view b, size_t at) {
  uint32_t v;
  std::memcpy(&v, b.data() + at, 4);
  return v;
}
uint64_t Le64(absl::string_view b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}
uint16_t Le16(absl::string_view b, size_t at) {
  uint16_t v;
  std::memcpy(&v, b.data() + at, 2);
  return v;
}
bool At(absl::string_view b, size_t at, absl::string_view magic) {
  return b.size() >= at + magic.size() && b.substr(at, magic.size()) == magic;
}

// ---- the sniffing table -------------------------------------------------------------------
// What a raw token file looks like, to judge each signature's false positives: token ids,
// little-endian. uint16: each id below the vocabulary (GPT-2 50257 = 0xC451, Llama-2 32000),
// so every odd byte is at most 0xC4 for GPT-2 and 0x7C for Llama-2, and a character-level
// vocabulary makes it 0x00. uint32: every id below 2^24 for any vocabulary in use (Llama-3
// 128256, Gemma 256000), so every fourth byte is 0x00 and the third at most 0x03. A
// signature is listed only when such data cannot make it, or makes it with odds below about
// 2^-24 a file (a specific first token and more: a file's first tokens are a document's
// start, not uniform, so a signature of one likely token would not do). A false positive is
// a refusal naming the format, never wrong data.

// Arrow IPC stream (pyarrow's RecordBatchStreamWriter; Hugging Face `datasets` writes its
// .arrow cache files so): 0xFFFFFFFF, the metadata length L (int32, > 0, a multiple of 8,
// within the file), then a flatbuffer Message whose header_type is Schema (1): the stream's
// first message always is. uint16: 0xFFFF twice is id 65535 twice (past GPT-2's and
// Llama-2's vocabularies); uint32: 0xFFFFFFFF is no id. Data padded with -1 could start so,
// which is why the flatbuffer is followed too: the root offset, the table, its vtable and
// the header_type byte must all land in the metadata and say Schema.
bool IsArrowStream(absl::string_view b, uint64_t size) {
  if (b.size() < 16 || Le32(b, 0) != 0xFFFFFFFFu) return false;
  const uint32_t length = Le32(b, 4);
  if (length == 0 || length % 8 != 0 || length > 0x7FFFFFFFu || 8 + uint64_t{length} > size) {
    return false;
  }
  const absl::string_view m = b.substr(8, std::min<size_t>(length, b.size() - 8));
  if (m.size() < 8) return false;
  const uint32_t table = Le32(m, 0);
  if (table % 4 != 0 || table + 4 > m.size()) return false;
  const int32_t back = static_cast<int32_t>(Le32(m, table));
  const int64_t vtable = static_cast<int64_t>(table) - back;
  if (vtable < 4 || vtable % 2 != 0 || vtable + 8 > static_cast<int64_t>(m.size())) return false;
  const uint16_t vsize = Le16(m, vtable), tsize = Le16(m, vtable + 2);
  if (vsize < 8 || vsize % 2 != 0 || vtable + vsize > static_cast<int64_t>(m.size())) {
    return false;
  }
  const uint16_t at = Le16(m, vtable + 6);  // field 1: header_type (a ubyte)
  if (at == 0 || at >= tsize || table + at >= m.size()) return false;
  return static_cast<unsigned char>(m[table + at]) == 1;  // MessageHeader.Schema
}

// Text: the first 4 KiB (the file being at least 512 bytes) all printable ASCII, tab, CR,
// LF or well-formed UTF-8 (a tokenizer's input, a README, a prepare.py beside the shards).
// uint16 ids would need every byte of 256+ ids in that set: a character-level vocabulary's
// (high bytes 0x00) never is, nor a uint32 file's (every fourth byte 0x00); a GPT-2 stream
// has about even odds a byte, so 2^-512 and less.
bool IsText(absl::string_view b) {
  if (b.size() < 512) return false;
  b = b.substr(0, 4096);
  for (size_t i = 0; i < b.size();) {
    const unsigned char c = static_cast<unsigned char>(b[i]);
    if (c == '\t' || c == '\n' || c == '\r' || (c >= 0x20 && c < 0x7f)) {
      ++i;
      continue;
    }
    const size_t extra = c >= 0xC2 && c <= 0xDF   ? 1
                         : c >= 0xE0 && c <= 0xEF ? 2
                         : c >= 0xF0 && c <= 0xF4 ? 3
                                                  : 0;
    if (extra == 0) return false;
    for (size_t k = 1; k <= extra && i + k < b.size(); ++k) {
      if ((static_cast<unsigned char>(b[i + k]) & 0xC0) != 0x80) return false;
    }
    i += extra + 1;  // a sequence cut by the 4 KiB window counts as text
  }
  return true;
}

// safetensors: the header's length n (uint64, at most 100 MB and within the file), then a
// JSON object of n bytes ('{' first, '}' last before space padding). The length's top six
// bytes are 0 (three uint16 ids 0 in a row, or a uint32 id 0) and '{' is the low byte of
// the fifth uint16 id: a one-in-2^30 start, and the closing brace is another 8 bits.
bool IsSafetensors(absl::string_view b, uint64_t size) {
  if (b.size() < 10) return false;
  const uint64_t n = Le64(b, 0);
  if (n < 2 || n > 100'000'000 || 8 + n > size || b[8] != '{') return false;
  if (8 + n > b.size()) return true;  // a header past 64 KiB: the length and '{' decide
  size_t end = 8 + n - 1;
  while (end > 8 && b[end] == ' ') --end;
  return b[end] == '}';
}

struct SniffRow {
  ForeignFormat format;
  // Whether the file's first bytes `b` (and its size; `tail`, its last 4 bytes) match.
  bool (*matches)(absl::string_view b, uint64_t size, absl::string_view tail);
};

// Archives and compressed streams first, then columnar and tensor files, images, text.
// Every row says what raw tokens would need to match it (see above for their shape).
constexpr SniffRow kForeignFormats[] = {
    // POSIX/GNU tar (Python's tarfile, GNU tar, WebDataset shards): "ustar" then NUL
    // (POSIX) or ' ' (GNU) at byte 257 of the first 512-byte header: 48 bits at a fixed
    // place, ASCII in both halves of three uint16 ids, and impossible for uint32 ids.
    {{"a tar archive",
      "a WebDataset shard is kind webdataset; token files are read as they are, not from an "
      "archive: unpack it"},
     [](absl::string_view b, uint64_t size, absl::string_view) {
       return size >= 512 && (At(b, 257, absl::string_view("ustar\0", 6)) || At(b, 257, "ustar "));
     }},
    // zip (NumPy's .npz, PyTorch's torch.save files): local header PK\3\4, or an empty
    // archive's end record PK\5\6: ids 19280 then 1027 (uint16), an id of 67 million (uint32).
    {{"a zip archive (NumPy .npz and PyTorch .pt files are zip archives)",
      "save the token ids alone: np.save of a uint16/uint32 array, or its raw bytes"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, "PK\x03\x04") || At(b, 0, "PK\x05\x06");
     }},
    // gzip: 1f 8b, method 8 (deflate), the flag byte's reserved bits 5-7 clear: id 35615 then
    // one of 32 ids (uint16), an id of at least 559903 (uint32).
    {{"a gzip-compressed file", "decompress it: token files are read in place"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, "\x1f\x8b\x08") && b.size() > 3 &&
              (static_cast<unsigned char>(b[3]) & 0xE0) == 0;
     }},
    // zstd frame magic 0xFD2FB528: ids 46376 then 64815 (uint16), no uint32 id.
    {{"a zstd-compressed file", "decompress it: token files are read in place"},
     [](absl::string_view b, uint64_t, absl::string_view) { return At(b, 0, "\x28\xb5\x2f\xfd"); }},
    // bzip2: "BZh", the block size '1'-'9', then the first block's magic (BCD pi): 10 bytes.
    {{"a bzip2-compressed file", "decompress it: token files are read in place"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, "BZh") && b.size() >= 10 && b[3] >= '1' && b[3] <= '9' &&
              At(b, 4, "\x31\x41\x59\x26\x53\x59");
     }},
    // xz: fd '7zXZ' 00: 6 bytes.
    {{"an xz-compressed file", "decompress it: token files are read in place"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, absl::string_view("\xfd\x37\x7a\x58\x5a\x00", 6));
     }},
    // Arrow IPC file (pyarrow's RecordBatchFileWriter, Feather v2): "ARROW1" and two pad
    // bytes 0: 64 bits.
    {{"an Apache Arrow IPC file",
      "tokenize its text and write the ids as token files (np.save of a uint16/uint32 array, "
      "or its raw bytes)"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, absl::string_view("ARROW1\0\0", 8));
     }},
    {{"an Apache Arrow IPC stream (Hugging Face datasets' .arrow files are)",
      "tokenize its text and write the ids as token files (np.save of a uint16/uint32 array, "
      "or its raw bytes)"},
     [](absl::string_view b, uint64_t size, absl::string_view) { return IsArrowStream(b, size); }},
    // Parquet: "PAR1" first and last: 64 bits.
    {{"an Apache Parquet file",
      "tokenize its text and write the ids as token files (np.save of a uint16/uint32 array, "
      "or its raw bytes)"},
     [](absl::string_view b, uint64_t size, absl::string_view tail) {
       return size >= 12 && At(b, 0, "PAR1") && tail == "PAR1";
     }},
    // HDF5 superblock at 0: 89 'HDF' CR LF 1a LF: 64 bits.
    {{"an HDF5 file", "write the token ids as token files (np.save, or the raw array)"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, "\x89HDF\r\n\x1a\n");
     }},
    {{"a safetensors file", "write the token ids as token files (np.save, or the raw array)"},
     [](absl::string_view b, uint64_t size, absl::string_view) { return IsSafetensors(b, size); }},
    // Python pickle, protocol 4 or 5 (the default since Python 3.8; nanoGPT's meta.pkl):
    // PROTO 4|5, FRAME and the frame's length (uint64), within the file: ids 1152 or 1408
    // then an id ending 0x95 and three ids 0 (uint16), an id of 9.7 million (uint32).
    {{"a Python pickle", "write the token ids as token files (np.save, or the raw array)"},
     [](absl::string_view b, uint64_t size, absl::string_view) {
       return b.size() >= 11 && (At(b, 0, "\x80\x04\x95") || At(b, 0, "\x80\x05\x95")) &&
              Le64(b, 3) <= size;
     }},
    // JPEG: SOI ff d8, then a marker ff c0-fe: id 55551 (uint16, past GPT-2's and Llama-2's
    // vocabularies) then an id ending 0xff; no uint32 id.
    {{"a JPEG image", "images are kind image_folder or webdataset"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, "\xff\xd8\xff") && b.size() > 3 &&
              static_cast<unsigned char>(b[3]) >= 0xC0 && static_cast<unsigned char>(b[3]) != 0xFF;
     }},
    // PNG: 89 'PNG' CR LF 1a LF: 64 bits.
    {{"a PNG image", "images are kind image_folder or webdataset"},
     [](absl::string_view b, uint64_t, absl::string_view) {
       return At(b, 0, "\x89PNG\r\n\x1a\n");
     }},
    {{"a text file", "tokenize it first (nanoGPT's prepare.py, llm.c's dev/data scripts)"},
     [](absl::string_view b, uint64_t, absl::string_view) { return IsText(b); }},
};

// ---- the token formats --------------------------------------------------------------------

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
// exactly. The sizes are summed under `walk`'s deadline and cancel flag (issue 30: a sparse
// .idx promising 10^12 sequences kept both attach threads busy ~23 minutes).
absl::StatusOr<std::pair<DType, uint64_t>> ReadMegatronIndex(const MegatronIdx& idx,
                                                             const std::string& bin,
                                                             const WalkBudget& walk) {
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
    }
    done += n;
  }
  return std::make_pair(dtype, tokens);
}

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

absl::StatusOr<std::optional<ForeignFormat>> SniffForeignFormat(const RandomAccessFile& file,
                                                                absl::string_view prefix) {
  std::string tail(4, '\0');
  if (file.size() >= 12 && At(prefix, 0, "PAR1")) {  // one more read, for Parquet alone
    GPUFEED_RETURN_IF_ERROR(file.ReadAt(
        file.size() - 4, std::span<std::byte>(reinterpret_cast<std::byte*>(tail.data()), 4)));
  }
  for (const SniffRow& row : kForeignFormats) {
    if (row.matches(prefix, file.size(), tail)) return row.format;
  }
  return std::nullopt;
}

absl::StatusOr<TokenShard> ProbeTokenShard(const FileDatasetSpec& spec,
                                           std::unique_ptr<RandomAccessFile> file, std::string name,
                                           const MegatronIdx& idx, const WalkBudget& walk,
                                           absl::string_view set_dir) {
  if (file->size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", name, " is empty"));
  }
  TokenShard shard;
  shard.name = std::move(name);
  const std::string& n = shard.name;
  std::string prefix(std::min<uint64_t>(file->size(), kNpyMaxHeaderBytes), '\0');
  GPUFEED_RETURN_IF_ERROR(file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(prefix.data()), prefix.size())));
  shard.dtype = spec.token_dtype == DType::kUnspecified ? DType::kUInt16 : spec.token_dtype;
  const uint32_t magic = prefix.size() >= 4 ? Le32(prefix, 0) : 0;
  if (idx.file != nullptr) {
    // Megatron's .bin is bare token ids: its .idx alone says what they are.
    GPUFEED_ASSIGN_OR_RETURN(const auto index, ReadMegatronIndex(idx, n, walk));
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
          " (README.md, \"Token files\", lists what is read)"));
    }
    const uint64_t token_bytes = DTypeSize(shard.dtype);
    if (file->size() % token_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat("dataset.path: ", n, " holds ", file->size(),
                                                     " bytes, not a whole number of ",
                                                     DTypeName(shard.dtype), " tokens"));
    }
    shard.tokens = file->size() / token_bytes;
  }
  shard.file = std::move(file);
  return shard;
}

}  // namespace gpufeed::server
