// SniffForeignFormat (token_formats.h): the formats a token shard is not, by their first bytes.

#include "server/reader/token_formats.h"

#include <span>
#include <string>

#include "common/status.h"
#include "server/reader/le_bytes.h"

namespace gpufeed::server {
namespace {

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

}  // namespace gpufeed::server
