#include "server/reader/npy.h"

#include <cctype>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gpufeed::server {
namespace {

absl::Status Malformed(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("malformed .npy header: ", why));
}

// The values a .npy header dict holds: a string, a bool, or a tuple of integers. A small
// recursive-descent reader of exactly that subset of Python literals; anything else
// (e.g. the list a structured dtype uses) is reported as such.
struct Value {
  enum Kind { kString, kBool, kTuple, kOther } kind = kOther;
  std::string text;
  bool flag = false;
  std::vector<int64_t> items;
};

class Parser {
 public:
  explicit Parser(absl::string_view s) : s_(s) {}

  absl::StatusOr<std::map<std::string, Value>> Dict() {
    std::map<std::string, Value> out;
    Skip();
    if (!Eat('{')) return Malformed("expected '{'");
    Skip();
    while (!Peek('}')) {
      auto key = String();
      if (!key.ok()) return key.status();
      Skip();
      if (!Eat(':')) return Malformed("expected ':' after a key");
      Skip();
      auto value = Any();
      if (!value.ok()) return value.status();
      out[*key] = *value;
      Skip();
      if (!Eat(',')) break;
      Skip();
    }
    if (!Eat('}')) return Malformed("expected '}'");
    return out;
  }

 private:
  void Skip() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Peek(char c) const { return pos_ < s_.size() && s_[pos_] == c; }
  bool Eat(char c) {
    if (!Peek(c)) return false;
    ++pos_;
    return true;
  }

  absl::StatusOr<std::string> String() {
    if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"')) {
      return Malformed("expected a quoted string");
    }
    const char quote = s_[pos_++];
    const size_t end = s_.find(quote, pos_);
    if (end == absl::string_view::npos) return Malformed("unterminated string");
    std::string out(s_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return out;
  }

  absl::StatusOr<Value> Any() {
    Value v;
    if (Peek('\'') || Peek('"')) {
      auto s = String();
      if (!s.ok()) return s.status();
      v.kind = Value::kString;
      v.text = *s;
      return v;
    }
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      v.kind = Value::kBool;
      v.flag = true;
      return v;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      v.kind = Value::kBool;
      return v;
    }
    if (Eat('(')) {
      v.kind = Value::kTuple;
      Skip();
      while (!Peek(')')) {
        const size_t start = pos_;
        while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
        int64_t item;
        if (start == pos_ || !absl::SimpleAtoi(s_.substr(start, pos_ - start), &item)) {
          return Malformed("shape must be a tuple of non-negative integers");
        }
        v.items.push_back(item);
        Skip();
        if (!Eat(',')) break;
        Skip();
      }
      if (!Eat(')')) return Malformed("unterminated tuple");
      return v;
    }
    // Something we do not serve (a list for a structured dtype, a number, ...): skip to the
    // next top-level ',' or '}' so the caller can name the offending key.
    int depth = 0;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '[' || c == '(' || c == '{') ++depth;
      if (c == ']' || c == ')' || c == '}') {
        if (depth == 0) break;
        --depth;
      }
      if (c == ',' && depth == 0) break;
      ++pos_;
    }
    return v;
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

absl::StatusOr<DType> DTypeFromDescr(const std::string& descr) {
  if (descr.size() >= 2 && descr[1] == 'O') {
    return absl::InvalidArgumentError("object dtype ('O') is not fixed-size numeric data");
  }
  if (descr.size() < 3) {
    return absl::InvalidArgumentError(absl::StrCat(".npy descr '", descr, "' is not supported"));
  }
  const char order = descr[0];
  const char kind = descr[1];
  int size = 0;
  if (!absl::SimpleAtoi(absl::string_view(descr).substr(2), &size)) size = -1;
  if (order == '>' && size > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("big-endian dtype '", descr, "' is not supported; save it little-endian"));
  }
  if (order != '<' && order != '|' && order != '=' && order != '>') {
    return absl::InvalidArgumentError(absl::StrCat(".npy descr '", descr, "' is not supported"));
  }
  struct Entry {
    char kind;
    int size;
    DType dtype;
  };
  static constexpr Entry kTable[] = {
      {'b', 1, DType::kBool},       {'i', 1, DType::kInt8},       {'u', 1, DType::kUInt8},
      {'i', 2, DType::kInt16},      {'u', 2, DType::kUInt16},     {'i', 4, DType::kInt32},
      {'u', 4, DType::kUInt32},     {'i', 8, DType::kInt64},      {'u', 8, DType::kUInt64},
      {'f', 2, DType::kFloat16},    {'f', 4, DType::kFloat32},    {'f', 8, DType::kFloat64},
      {'c', 8, DType::kComplex64},  {'c', 16, DType::kComplex128},
  };
  for (const Entry& e : kTable) {
    if (e.kind == kind && e.size == size) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      ".npy dtype '", descr, "' is not a fixed-size numeric dtype gpufeed serves"));
}

}  // namespace

absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view prefix) {
  static constexpr absl::string_view kMagic = "\x93NUMPY";
  if (prefix.size() < 10 || prefix.substr(0, 6) != kMagic) {
    return absl::InvalidArgumentError("not a .npy file (bad magic)");
  }
  const int major = static_cast<unsigned char>(prefix[6]);
  uint64_t header_len = 0;
  uint64_t fixed = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(prefix[8]) |
                 (static_cast<uint64_t>(static_cast<unsigned char>(prefix[9])) << 8);
    fixed = 10;
  } else if (major == 2 || major == 3) {
    if (prefix.size() < 12) return Malformed("truncated");
    for (int i = 0; i < 4; ++i) {
      header_len |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[8 + i])) << (8 * i);
    }
    fixed = 12;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(".npy version ", major, " is not supported"));
  }
  if (fixed + header_len > prefix.size()) {
    return Malformed(absl::StrCat("header of ", header_len, " bytes runs past the file's end"));
  }
  Parser parser(prefix.substr(fixed, header_len));
  auto dict = parser.Dict();
  if (!dict.ok()) return dict.status();

  NpyHeader header;
  header.data_offset = fixed + header_len;
  const auto descr = dict->find("descr");
  if (descr == dict->end()) return Malformed("no 'descr' key");
  if (descr->second.kind != Value::kString) {
    return absl::InvalidArgumentError("structured dtypes are not supported (descr is not a string)");
  }
  auto dtype = DTypeFromDescr(descr->second.text);
  if (!dtype.ok()) return dtype.status();
  header.dtype = *dtype;

  const auto fortran = dict->find("fortran_order");
  if (fortran == dict->end() || fortran->second.kind != Value::kBool) {
    return Malformed("no boolean 'fortran_order' key");
  }
  header.fortran_order = fortran->second.flag;
  if (header.fortran_order) {
    return absl::InvalidArgumentError(
        "Fortran-ordered arrays are not supported; save with np.ascontiguousarray");
  }
  const auto shape = dict->find("shape");
  if (shape == dict->end() || shape->second.kind != Value::kTuple) {
    return Malformed("no tuple 'shape' key");
  }
  header.shape = shape->second.items;
  if (header.shape.empty()) {
    return absl::InvalidArgumentError("a 0-d array has no rows to serve");
  }
  return header;
}

}  // namespace gpufeed::server
