#pragma once
// Readers for the tensor files a training framework dumps: safetensors (what safetensors.torch.save_file
// writes) and NumPy .npy (versions 1-3, little-endian, C order). Every header field is validated against
// the file before any data is read: header lengths past the end of the file, offsets out of range or
// overlapping, sizes that do not match shape x itemsize, unknown dtypes and duplicate names all raise
// DumpError (exit code 2) with a message that names the file and the tensor. Nothing is read out of bounds.
// Only regular files are opened (a FIFO, a folder, a device or a socket is refused without waiting on it).
// Messages never quote a file's bytes before they are known to be a header: a file that is not a tensor file
// (a symlink to /etc/passwd) is "not a safetensors file", its first bytes are not printed as a length; names
// from headers and paths go through printable().
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/core/dtype.hpp"
#include "lossverify/core/errors.hpp"

namespace lossverify::dump {

// A dump or manifest that cannot be checked: malformed, inconsistent or incomplete. Exit code 2.
class DumpError : public Error {
 public:
  explicit DumpError(const std::string& message) : Error(ExitCode::usage_error, message) {}
};

enum class TensorDType { f64, f32, f16, bf16, i64, i32, i16, i8, u64, u32, u16, u8, boolean };

// The tensor dtype that stores a case dtype (F32, BF16, F16).
TensorDType tensor_dtype_of(DType dtype);

// The safetensors spelling: F64, F32, F16, BF16, I64, ..., U8, BOOL.
std::string_view to_string(TensorDType dtype);
std::size_t item_size(TensorDType dtype);
bool is_floating(TensorDType dtype);

enum class FileFormat { safetensors, npy };

struct TensorInfo {
  std::string name;  // the safetensors key; empty for .npy
  TensorDType dtype = TensorDType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;  // absolute offset of the data in the file
  std::uint64_t bytes = 0;   // numel * item size
  std::int64_t numel() const;
  std::string shape_string() const;  // "[64, 300]"
};

// Largest header either format may have (the safetensors library's own limit is 100 MB).
inline constexpr std::uint64_t kMaxHeaderBytes = std::uint64_t{100} << 20;
// Largest element count of one tensor (keeps every size computation far from overflow).
inline constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;

// Parse a header from the first bytes of a file of `file_size` bytes. `prefix` holds at least the whole
// header when it fits in the file (callers read min(file_size, needed) bytes); `source` names the file in
// messages (printable text). Pure functions (no I/O): the fuzzers call them on arbitrary bytes.
//   safetensors: 8-byte little-endian header length n, then n bytes of JSON, then the data buffer.
std::uint64_t safetensors_header_length(std::span<const std::byte> prefix, std::uint64_t file_size,
                                        const std::string& source);
std::vector<TensorInfo> parse_safetensors_header(std::span<const std::byte> prefix, std::uint64_t file_size,
                                                 const std::string& source);
//   npy: "\x93NUMPY", version, header length (2 bytes for v1, 4 for v2/v3), a Python dict literal.
//   Returns the prefix length the header needs (0 when `prefix` already holds it) through `needed`.
std::uint64_t npy_header_end(std::span<const std::byte> prefix, std::uint64_t file_size, const std::string& source);
TensorInfo parse_npy_header(std::span<const std::byte> prefix, std::uint64_t file_size, const std::string& source);

// Element conversions of raw little-endian data (data.size() must be info.bytes). `source` names the tensor
// in messages (e.g. tensor_label(path, name)) when the dtype does not fit the request.
std::vector<double> to_doubles(const TensorInfo& info, std::span<const std::byte> data, const std::string& source);
// Integer (or BOOL) tensors only: floating-point labels or counts are rejected.
std::vector<std::int64_t> to_integers(const TensorInfo& info, std::span<const std::byte> data,
                                      const std::string& source);

// An opened tensor file: its header parsed and validated, data read on demand.
class TensorFile {
 public:
  // Opens and validates; the format comes from the extension (.safetensors or .npy) and is confirmed by
  // the file's magic bytes. Anything but a regular file is a DumpError ("is a FIFO, not a regular file").
  static TensorFile open(const std::string& path);

  const std::string& path() const { return path_; }  // as given, to open; printable(path()) to show
  FileFormat format() const { return format_; }
  std::uint64_t size() const { return size_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The tensor of that name (for .npy: the empty name); DumpError listing what the file holds otherwise.
  const TensorInfo& tensor(const std::string& name) const;
  // Reads the tensor's bytes (info.bytes of them).
  std::vector<std::byte> read(const TensorInfo& info) const;

 private:
  std::string path_;
  FileFormat format_ = FileFormat::safetensors;
  std::uint64_t size_ = 0;
  std::vector<TensorInfo> tensors_;
};

// Strict JSON: invalid text or a key repeated in any object is a DumpError "source: what ...". `quote_text`:
// whether the message may quote the text near the error (a manifest's, yes; a tensor file's header, which
// may be the bytes of any file, no).
nlohmann::json parse_json_without_duplicates(std::string_view text, const std::string& source, const char* what,
                                             bool quote_text);

// The whole of a regular file (a manifest); DumpError "<path>: cannot open <what>: ..." or "<path>: is a
// FIFO, not a regular file" (never waits on a FIFO).
std::string read_regular_file(const std::string& path, const char* what);

// For messages, made printable: 'path: tensor "name"', or 'path' alone for the unnamed tensor of an .npy file.
std::string tensor_label(const std::string& path, const std::string& name);

}  // namespace lossverify::dump
