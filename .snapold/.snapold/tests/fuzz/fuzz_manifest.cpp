// libFuzzer target: the dump manifest reader (strict JSON, then parse_manifest with the case file's loss,
// layout, framework and tolerances parsers). Every input must parse or raise a lossverify::Error (exit code
// 2); a crash, a sanitizer report or any other exception is a finding. Build and run with scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "lossverify/dump/manifest.hpp"
#include "lossverify/dump/tensor_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  lossverify::dump::ManifestLimits limits;
  limits.max_rows = std::int64_t{1} << 16;  // keeps memory within libFuzzer's limit
  try {
    const auto document = lossverify::dump::parse_manifest_text(text, "fuzz/manifest.json");
    const auto manifest = lossverify::dump::parse_manifest(document, "fuzz/manifest.json", limits);
    if (manifest.ranks.empty()) __builtin_trap();
  } catch (const lossverify::Error& e) {
    if (e.code() != lossverify::ExitCode::usage_error) __builtin_trap();
  }
  return 0;
}
