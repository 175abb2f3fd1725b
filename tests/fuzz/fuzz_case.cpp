// libFuzzer target: the case file reader (strict JSON, --set assignments, parse_case, the sweep's layouts and
// the memory estimate). The input is a case file, optionally followed by a line "#set" and one --set
// assignment per line. Every input must parse or raise a lossverify::Error with exit code 2; a crash, a
// sanitizer report or any other exception is a finding (the 1e400 crash of the audit was one). Build and run
// with scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/runner/memory_estimate.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const std::size_t marker = input.find("\n#set\n");
  const std::string text = input.substr(0, marker);
  try {
    nlohmann::json document = lossverify::detail::parse_json_strictly(text, "fuzz/case.json", "case file");
    if (marker != std::string::npos) {
      std::istringstream lines(input.substr(marker + 6));
      std::string line;
      while (std::getline(lines, line)) lossverify::apply_set_override(document, line, "fuzz/case.json");
    }
    const lossverify::Case c = lossverify::parse_case(document, "fuzz/case.json");
    lossverify::check_case(c);
    for (const lossverify::LayoutSpec& layout : lossverify::sweep_layouts(c)) {
      lossverify::Case at = c;
      at.layout = layout;
      (void)lossverify::estimate_memory(at, true);
    }
  } catch (const lossverify::Error& e) {
    if (e.code() != lossverify::ExitCode::usage_error) __builtin_trap();
  }
  return 0;
}
