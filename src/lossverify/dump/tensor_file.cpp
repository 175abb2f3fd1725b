#include "lossverify/dump/tensor_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include "lossverify/case/json_reader.hpp"
#include "lossverify/core/strings.hpp"

static_assert(std::endian::native == std::endian::little, "the dump readers assume a little-endian host");

namespace lossverify::dump {

namespace {

[[noreturn]] void fail(const std::string& source, const std::string& message) {
  throw DumpError(source + ": " + message);
}

// A name from a header or a manifest, for messages: "name", printable.
std::string quote_name(std::string_view name) { return std::string("\"").append(printable(name)).append("\""); }

struct DTypeName {
  TensorDType dtype;
  std::string_view name;
  std::size_t size;
};
constexpr DTypeName kDTypes[] = {
    {TensorDType::f64, "F64", 8},      {TensorDType::f32, "F32", 4}, {TensorDType::f16, "F16", 2},
    {TensorDType::bf16, "BF16", 2},    {TensorDType::i64, "I64", 8}, {TensorDType::i32, "I32", 4},
    {TensorDType::i16, "I16", 2},      {TensorDType::i8, "I8", 1},   {TensorDType::u64, "U64", 8},
    {TensorDType::u32, "U32", 4},      {TensorDType::u16, "U16", 2}, {TensorDType::u8, "U8", 1},
    {TensorDType::boolean, "BOOL", 1},
};

std::uint64_t read_le(std::span<const std::byte> bytes, std::size_t offset, std::size_t width) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < width; ++i) v |= static_cast<std::uint64_t>(bytes[offset + i]) << (8 * i);
  return v;
}

// numel of a shape, with every dimension and the product checked; -1 when out of range.
std::int64_t checked_numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > kMaxElements / d) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

TensorDType tensor_dtype_of(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return TensorDType::bf16;
    case DType::fp16:
      return TensorDType::f16;
    case DType::fp32:
    default:
      return TensorDType::f32;
  }
}

std::string_view to_string(TensorDType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

std::size_t item_size(TensorDType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 1;
}

bool is_floating(TensorDType dtype) {
  return dtype == TensorDType::f64 || dtype == TensorDType::f32 || dtype == TensorDType::f16 ||
         dtype == TensorDType::bf16;
}

std::int64_t TensorInfo::numel() const { return checked_numel(shape); }

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// Rejects duplicate keys in any object (nlohmann keeps the last one silently).
nlohmann::json parse_json_without_duplicates(std::string_view text, const std::string& source, const char* what,
                                             bool quote_text) {
  detail::StrictJson parsed = detail::parse_json_checked(text);
  if (!parsed.parse_error.empty()) {  // the parser's message quotes the text near the error
    fail(source, std::string(what) + " is not valid JSON" + (quote_text ? ": " + printable(parsed.parse_error) : ""));
  }
  if (!parsed.repeated_key.empty())
    fail(source, std::string(what) + " repeats the key " + quote_name(parsed.repeated_key));
  return std::move(parsed.document);
}

std::string tensor_label(const std::string& path, const std::string& name) {
  return name.empty() ? printable(path) : printable(path) + ": tensor " + quote_name(name);
}

// ---------------------------------------------------------------------------------------------------------
// safetensors

std::uint64_t safetensors_header_length(std::span<const std::byte> prefix, std::uint64_t file_size,
                                        const std::string& source) {
  if (file_size < 8 || prefix.size() < 8) {
    fail(source,
         "truncated safetensors file: " + std::to_string(file_size) + " bytes, too short for the 8-byte header length");
  }
  // n is whatever the first 8 bytes hold, of any file: never printed.
  const std::uint64_t n = read_le(prefix, 0, 8);
  if (n > file_size - 8) {
    fail(source,
         "not a safetensors file (or a truncated one): the header length in its first 8 bytes exceeds the "
         "file's " +
             std::to_string(file_size) + " bytes");
  }
  if (n > kMaxHeaderBytes) {
    fail(source, "not a safetensors file: the header length in its first 8 bytes exceeds the limit of 100 MB");
  }
  if (n < 2) fail(source, "not a safetensors file: the header length in its first 8 bytes is too short for JSON");
  return n;
}

std::vector<TensorInfo> parse_safetensors_header(std::span<const std::byte> prefix, std::uint64_t file_size,
                                                 const std::string& source) {
  const std::uint64_t n = safetensors_header_length(prefix, file_size, source);
  if (prefix.size() < 8 + n) fail(source, "safetensors header: fewer bytes than its length says");
  const std::string_view text(reinterpret_cast<const char*>(prefix.data()) + 8, static_cast<std::size_t>(n));
  if (text.front() != '{') fail(source, "not a safetensors file: its header does not start with '{'");
  const nlohmann::json header = parse_json_without_duplicates(text, source, "safetensors header", false);
  if (!header.is_object()) fail(source, "safetensors header is not a JSON object");
  const std::uint64_t data_begin = 8 + n;
  const std::uint64_t data_size = file_size - data_begin;
  std::vector<TensorInfo> tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(source, "__metadata__ must be an object of strings");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) fail(source, "__metadata__[" + quote_name(key) + "] must be a string");
      }
      continue;
    }
    const std::string where = source + ": tensor " + quote_name(name);
    if (name.empty()) fail(source, "a tensor has an empty name");
    if (!entry.is_object()) throw DumpError(where + ": header entry is not an object");
    for (const auto& [key, value] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        throw DumpError(where + ": unknown header key " + quote_name(key) + " (expected dtype, shape, data_offsets)");
      }
    }
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) throw DumpError(where + ": missing string dtype");
    if (!entry.contains("shape") || !entry["shape"].is_array()) throw DumpError(where + ": missing shape array");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
      throw DumpError(where + ": data_offsets must be an array [begin, end]");
    }
    TensorInfo info;
    info.name = name;
    const std::string dtype = entry["dtype"].get<std::string>();
    bool known = false;
    for (const auto& d : kDTypes) {
      if (d.name == dtype) {
        info.dtype = d.dtype;
        known = true;
      }
    }
    if (!known) {
      std::string list;
      for (const auto& d : kDTypes) append_to_list(list, d.name, "|");
      throw DumpError(where + ": unsupported dtype " + quote_name(dtype) + " (this reader knows " + list + ")");
    }
    if (entry["shape"].size() > 16) throw DumpError(where + ": more than 16 dimensions");
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > static_cast<std::uint64_t>(kMaxElements)) {
        throw DumpError(where + ": shape " + entry["shape"].dump() + " must hold non-negative integers");
      }
      info.shape.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
    }
    const std::int64_t numel = checked_numel(info.shape);
    if (numel < 0) throw DumpError(where + ": shape " + info.shape_string() + " has too many elements");
    const auto& offsets = entry["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      throw DumpError(where + ": data_offsets " + offsets.dump() + " must be non-negative integers");
    }
    const std::uint64_t begin = offsets[0].get<std::uint64_t>();
    const std::uint64_t end = offsets[1].get<std::uint64_t>();
    if (begin > end) throw DumpError(where + ": data_offsets " + offsets.dump() + " end before they begin");
    if (end > data_size) {
      throw DumpError(where + ": data_offsets " + offsets.dump() + " run past the end of the data (" +
                      std::to_string(data_size) + " bytes after the header): the file is truncated");
    }
    info.bytes = static_cast<std::uint64_t>(numel) * item_size(info.dtype);
    if (end - begin != info.bytes) {
      throw DumpError(where + ": data_offsets " + offsets.dump() + " hold " + std::to_string(end - begin) +
                      " bytes, but dtype " + dtype + " and shape " + info.shape_string() + " need " +
                      std::to_string(info.bytes));
    }
    info.offset = data_begin + begin;
    tensors.push_back(std::move(info));
  }
  // No two tensors may share bytes (empty tensors occupy none).
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors) {
    if (t.bytes > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->offset != b->offset ? a->offset < b->offset : a->name < b->name;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& a = *by_offset[i - 1];
    const TensorInfo& b = *by_offset[i];
    if (b.offset < a.offset + a.bytes) {
      fail(source, "tensors " + quote_name(a.name) + " and " + quote_name(b.name) + " overlap (data_offsets [" +
                       std::to_string(a.offset - data_begin) + ", " + std::to_string(a.offset - data_begin + a.bytes) +
                       ") and [" + std::to_string(b.offset - data_begin) + ", " +
                       std::to_string(b.offset - data_begin + b.bytes) + "))");
    }
  }
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return tensors;
}

// ---------------------------------------------------------------------------------------------------------
// npy

namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";

// A tiny reader for the Python dict literal of an .npy header:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
class PyLiteral {
 public:
  PyLiteral(std::string_view text, const std::string& source) : s_(text), source_(source) {}

  void expect(char c) {
    skip();
    if (i_ >= s_.size() || s_[i_] != c) error(std::string("expected '") + c + "'");
    ++i_;
  }
  bool accept(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  std::string string() {
    skip();
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) error("expected a quoted string");
    const char quote = s_[i_++];
    std::string out;
    while (i_ < s_.size() && s_[i_] != quote) {
      if (s_[i_] == '\\') error("escapes are not supported in .npy headers");
      out += s_[i_++];
      if (out.size() > 64) error("string too long");
    }
    if (i_ >= s_.size()) error("unterminated string");
    ++i_;
    return out;
  }
  bool boolean() {
    skip();
    if (s_.substr(i_, 4) == "True") {
      i_ += 4;
      return true;
    }
    if (s_.substr(i_, 5) == "False") {
      i_ += 5;
      return false;
    }
    error("expected True or False");
  }
  std::vector<std::int64_t> tuple() {
    expect('(');
    std::vector<std::int64_t> out;
    while (!accept(')')) {
      skip();
      std::int64_t v = 0;
      std::size_t digits = 0;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
        if (v > kMaxElements) error("dimension too large");
        v = v * 10 + (s_[i_++] - '0');
        ++digits;
      }
      if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2 longs
      if (digits == 0) error("expected a non-negative dimension");
      out.push_back(v);
      if (out.size() > 16) error("more than 16 dimensions");
      if (!accept(',')) {
        expect(')');
        break;
      }
    }
    return out;
  }
  void end() {
    skip();
    if (i_ != s_.size()) error("trailing characters after the header dict");
  }
  // Quotes the header (past the magic: it is an .npy header), at most its first 200 characters.
  [[noreturn]] void error(const std::string& what) const {
    constexpr std::size_t kQuoted = 200;
    std::string_view shown = s_.substr(0, kQuoted);
    while (!shown.empty() && (shown.back() == ' ' || shown.back() == '\n')) shown.remove_suffix(1);
    fail(source_, ".npy header: " + what + " at offset " + std::to_string(i_) + " of \"" + printable(shown) +
                      (s_.size() > kQuoted ? "..." : "") + "\"");
  }

 private:
  void skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  std::string_view s_;
  const std::string& source_;
  std::size_t i_ = 0;
};

}  // namespace

std::uint64_t npy_header_end(std::span<const std::byte> prefix, std::uint64_t file_size, const std::string& source) {
  if (file_size < 10 || prefix.size() < 10)
    fail(source, "truncated .npy file: " + std::to_string(file_size) + " bytes");
  if (std::memcmp(prefix.data(), kNpyMagic, 6) != 0) fail(source, "not an .npy file (no \\x93NUMPY magic)");
  const auto major = static_cast<unsigned>(prefix[6]);
  if (major < 1 || major > 3) fail(source, ".npy format version " + std::to_string(major) + " is not 1, 2 or 3");
  const std::size_t width = major == 1 ? 2 : 4;
  if (file_size < 8 + width || prefix.size() < 8 + width) fail(source, "truncated .npy header");
  const std::uint64_t n = read_le(prefix, 8, width);  // never printed, as safetensors' header length
  const std::uint64_t end = 8 + width + n;
  if (end > file_size) {
    fail(source,
         "truncated .npy file: its header runs past the end of the file (" + std::to_string(file_size) + " bytes)");
  }
  if (n > kMaxHeaderBytes) fail(source, ".npy header longer than 100 MB");
  return end;
}

TensorInfo parse_npy_header(std::span<const std::byte> prefix, std::uint64_t file_size, const std::string& source) {
  const std::uint64_t end = npy_header_end(prefix, file_size, source);
  if (prefix.size() < end) fail(source, ".npy header: fewer bytes than its length says");
  const std::size_t width = static_cast<unsigned>(prefix[6]) == 1 ? 2 : 4;
  const std::string_view text(reinterpret_cast<const char*>(prefix.data()) + 8 + width,
                              static_cast<std::size_t>(end - 8 - width));
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) fail(source, ".npy header is not ASCII");
  }
  PyLiteral p(text, source);
  std::string descr;
  bool fortran = false;
  std::vector<std::int64_t> shape;
  bool has_descr = false, has_fortran = false, has_shape = false;
  p.expect('{');
  while (!p.accept('}')) {
    const std::string key = p.string();
    p.expect(':');
    if (key == "descr" && !has_descr) {
      descr = p.string();
      has_descr = true;
    } else if (key == "fortran_order" && !has_fortran) {
      fortran = p.boolean();
      has_fortran = true;
    } else if (key == "shape" && !has_shape) {
      shape = p.tuple();
      has_shape = true;
    } else {
      p.error("unexpected or repeated key '" + printable(key) + "'");
    }
    if (!p.accept(',')) {
      p.expect('}');
      break;
    }
  }
  p.end();
  if (!has_descr || !has_fortran || !has_shape) fail(source, ".npy header lacks descr, fortran_order or shape");
  if (fortran) {
    fail(source,
         ".npy array is stored in Fortran (column-major) order; save a C-contiguous array "
         "(numpy.ascontiguousarray, or tensor.contiguous() before .numpy())");
  }
  static const struct {
    std::string_view code;
    TensorDType dtype;
  } codes[] = {{"f8", TensorDType::f64}, {"f4", TensorDType::f32}, {"f2", TensorDType::f16},
               {"i8", TensorDType::i64}, {"i4", TensorDType::i32}, {"i2", TensorDType::i16},
               {"i1", TensorDType::i8},  {"u8", TensorDType::u64}, {"u4", TensorDType::u32},
               {"u2", TensorDType::u16}, {"u1", TensorDType::u8},  {"b1", TensorDType::boolean}};
  if (descr.size() < 3) fail(source, ".npy dtype '" + printable(descr) + "' is not supported");
  const char order = descr[0];
  const std::string_view code = std::string_view(descr).substr(1);
  TensorInfo info;
  bool known = false;
  for (const auto& c : codes) {
    if (c.code == code) {
      info.dtype = c.dtype;
      known = true;
    }
  }
  if (!known) {
    fail(source, ".npy dtype '" + printable(descr) + "' is not supported (floating, integer or bool arrays only)");
  }
  const bool single_byte = item_size(info.dtype) == 1;
  if (order == '>' && !single_byte) {
    fail(source, ".npy array is big-endian ('" + descr + "'); save it little-endian (array.astype('<" +
                     std::string(code) + "'))");
  }
  if (order != '<' && order != '|' && !(order == '>' && single_byte)) {
    fail(source, ".npy dtype '" + printable(descr) + "' has an unknown byte-order mark");
  }
  info.shape = shape;
  const std::int64_t numel = checked_numel(shape);
  if (numel < 0) fail(source, ".npy shape " + info.shape_string() + " has too many elements");
  info.bytes = static_cast<std::uint64_t>(numel) * item_size(info.dtype);
  info.offset = end;
  if (file_size - end != info.bytes) {
    fail(source, ".npy data holds " + std::to_string(file_size - end) + " bytes, but dtype '" + descr + "' and shape " +
                     info.shape_string() + " need " + std::to_string(info.bytes) +
                     (file_size - end < info.bytes ? ": the file is truncated" : ""));
  }
  return info;
}

// ---------------------------------------------------------------------------------------------------------
// conversions

namespace {

template <class T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

double element_as_double(TensorDType dtype, const std::byte* p) {
  switch (dtype) {
    case TensorDType::f64:
      return load<double>(p);
    case TensorDType::f32:
      return static_cast<double>(load<float>(p));
    case TensorDType::f16:
      return static_cast<double>(static_cast<float>(load<Eigen::half>(p)));
    case TensorDType::bf16:
      return static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(load<std::uint16_t>(p)) << 16));
    case TensorDType::i64:
      return static_cast<double>(load<std::int64_t>(p));
    case TensorDType::i32:
      return static_cast<double>(load<std::int32_t>(p));
    case TensorDType::i16:
      return static_cast<double>(load<std::int16_t>(p));
    case TensorDType::i8:
      return static_cast<double>(load<std::int8_t>(p));
    case TensorDType::u64:
      return static_cast<double>(load<std::uint64_t>(p));
    case TensorDType::u32:
      return static_cast<double>(load<std::uint32_t>(p));
    case TensorDType::u16:
      return static_cast<double>(load<std::uint16_t>(p));
    case TensorDType::u8:
    case TensorDType::boolean:
      return static_cast<double>(load<std::uint8_t>(p));
  }
  return 0.0;
}

void check_size(const TensorInfo& info, std::span<const std::byte> data, const std::string& source) {
  if (data.size() != info.bytes) {
    throw DumpError(source + ": holds " + std::to_string(data.size()) + " bytes, expected " +
                    std::to_string(info.bytes));
  }
}

}  // namespace

std::vector<double> to_doubles(const TensorInfo& info, std::span<const std::byte> data, const std::string& source) {
  check_size(info, data, source);
  const std::size_t size = item_size(info.dtype);
  std::vector<double> out(data.size() / size);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = element_as_double(info.dtype, data.data() + i * size);
  return out;
}

std::vector<std::int64_t> to_integers(const TensorInfo& info, std::span<const std::byte> data,
                                      const std::string& source) {
  check_size(info, data, source);
  if (is_floating(info.dtype)) {
    throw DumpError(source + ": dtype " + std::string(to_string(info.dtype)) +
                    " where an integer tensor is expected (I64, I32, ..., U8 or BOOL)");
  }
  const std::size_t size = item_size(info.dtype);
  std::vector<std::int64_t> out(data.size() / size);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::byte* p = data.data() + i * size;
    if (info.dtype == TensorDType::u64) {
      const std::uint64_t u = load<std::uint64_t>(p);
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        throw DumpError(source + ": element " + std::to_string(i) + " exceeds 2^63 - 1");
      }
      out[i] = static_cast<std::int64_t>(u);
    } else if (info.dtype == TensorDType::i64) {
      out[i] = load<std::int64_t>(p);
    } else {
      out[i] = static_cast<std::int64_t>(element_as_double(info.dtype, p));  // exact below 2^53
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// files

namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd& operator=(Fd&&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// What a file that is not a regular file is, for messages.
const char* file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

// Opens a regular file for reading and nothing else; its size goes to `size`. stat first refuses a FIFO
// (whose open would wait for a writer), a device or a socket unopened; O_NONBLOCK and fstat refuse one that
// took the file's place in between. `cannot_open` starts the message of a failure ("cannot open manifest").
Fd open_regular_file(const std::string& path, const std::string& cannot_open, std::uint64_t& size) {
  const std::string shown = printable(path);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw DumpError(shown + ": " + cannot_open + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw DumpError(shown + ": is " + file_kind(st.st_mode) + ", not a regular file");
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (fd.get() < 0) throw DumpError(shown + ": " + cannot_open + ": " + std::strerror(errno));
  if (::fstat(fd.get(), &st) != 0) throw DumpError(shown + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw DumpError(shown + ": is " + file_kind(st.st_mode) + ", not a regular file");
  size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

// Reads exactly `bytes` bytes at `offset`, or fails naming the file (`what`: printable).
void read_exactly(int fd, std::uint64_t offset, std::byte* out, std::uint64_t bytes, const std::string& what) {
  std::uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, out + done, static_cast<std::size_t>(std::min<std::uint64_t>(bytes - done, 1u << 30)),
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw DumpError(what + ": read error: " + std::strerror(errno));
    }
    if (n == 0) throw DumpError(what + ": the file ended early (truncated while reading)");
    done += static_cast<std::uint64_t>(n);
  }
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string read_regular_file(const std::string& path, const char* what) {
  std::uint64_t size = 0;
  const Fd fd = open_regular_file(path, std::string("cannot open ") + what, size);
  std::string text(static_cast<std::size_t>(size), '\0');
  read_exactly(fd.get(), 0, reinterpret_cast<std::byte*>(text.data()), size, printable(path));
  return text;
}

TensorFile TensorFile::open(const std::string& path) {
  TensorFile f;
  f.path_ = path;
  const std::string shown = printable(path);
  if (ends_with(path, ".safetensors")) {
    f.format_ = FileFormat::safetensors;
  } else if (ends_with(path, ".npy")) {
    f.format_ = FileFormat::npy;
  } else {
    throw DumpError(shown + ": unknown tensor file type (expected .safetensors or .npy)");
  }
  const Fd fd = open_regular_file(path, "cannot open", f.size_);
  if (f.format_ == FileFormat::safetensors) {
    std::vector<std::byte> head(static_cast<std::size_t>(std::min<std::uint64_t>(f.size_, 8)));
    read_exactly(fd.get(), 0, head.data(), head.size(), shown);
    const std::uint64_t n = safetensors_header_length(head, f.size_, shown);
    head.resize(static_cast<std::size_t>(8 + n));
    read_exactly(fd.get(), 8, head.data() + 8, n, shown);
    f.tensors_ = parse_safetensors_header(head, f.size_, shown);
  } else {
    std::vector<std::byte> head(static_cast<std::size_t>(std::min<std::uint64_t>(f.size_, 12)));
    read_exactly(fd.get(), 0, head.data(), head.size(), shown);
    const std::uint64_t end = npy_header_end(head, f.size_, shown);
    const std::size_t have = head.size();
    head.resize(static_cast<std::size_t>(end));
    if (end > have) read_exactly(fd.get(), have, head.data() + have, end - have, shown);
    f.tensors_ = {parse_npy_header(head, f.size_, shown)};
  }
  return f;
}

const TensorInfo& TensorFile::tensor(const std::string& name) const {
  const std::string shown = printable(path_);
  if (format_ == FileFormat::npy) {
    if (!name.empty()) {
      throw DumpError(shown + ": an .npy file holds one unnamed tensor; the manifest names " + quote_name(name) +
                      " (give only \"file\")");
    }
    return tensors_.front();
  }
  if (name.empty()) throw DumpError(shown + ": a safetensors file needs a tensor name (\"name\" in the manifest)");
  for (const auto& t : tensors_) {
    if (t.name == name) return t;
  }
  std::string list;
  for (const auto& t : tensors_) {
    if (list.size() > 400) {
      list += ", ...";
      break;
    }
    append_to_list(list, quote_name(t.name));
  }
  throw DumpError(shown + ": no tensor " + quote_name(name) + " (the file holds " + (list.empty() ? "none" : list) +
                  ")");
}

std::vector<std::byte> TensorFile::read(const TensorInfo& info) const {
  std::uint64_t size = 0;
  const Fd fd = open_regular_file(path_, "cannot open", size);
  std::vector<std::byte> out(static_cast<std::size_t>(info.bytes));
  read_exactly(fd.get(), info.offset, out.data(), info.bytes, tensor_label(path_, info.name));
  return out;
}

}  // namespace lossverify::dump
