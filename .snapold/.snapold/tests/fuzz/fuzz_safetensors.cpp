// libFuzzer target: the safetensors and .npy header parsers and the element conversions on arbitrary bytes.
// Every input must either parse into tensors that lie inside the buffer or raise DumpError; anything else
// (a crash, a sanitizer report, another exception) is a finding. Build and run with scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <span>

#include "lossverify/dump/tensor_file.hpp"

using namespace lossverify::dump;

namespace {

void convert(const TensorInfo& t, std::span<const std::byte> bytes) {
  if (t.offset > bytes.size() || t.bytes > bytes.size() - t.offset) __builtin_trap();  // out of bounds
  if (static_cast<std::uint64_t>(t.numel()) * item_size(t.dtype) != t.bytes) __builtin_trap();
  const auto data = bytes.subspan(t.offset, t.bytes);
  (void)to_doubles(t, data, "fuzz");
  try {
    (void)to_integers(t, data, "fuzz");
  } catch (const DumpError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    for (const TensorInfo& t : parse_safetensors_header(bytes, size, "fuzz.safetensors")) convert(t, bytes);
  } catch (const DumpError&) {
  }
  try {
    convert(parse_npy_header(bytes, size, "fuzz.npy"), bytes);
  } catch (const DumpError&) {
  }
  return 0;
}
