// Runs one small case with the correct implementation and with a catalogued bug through the installed
// library, and names the plugin ABI version from the installed header.
#include <lossverify/plugin.h>

#include <cstdio>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/runner/run_case.hpp"

int main() {
  const lossverify::Case c =
      lossverify::parse_case(nlohmann::json::parse(R"({"name": "consumer", "shape": {"tokens": 32, "vocab": 64},
                                "loss": {"label_smoothing": 0.1}, "layout": {"tp": 2}})"),
                             "<consumer>");
  lossverify::RunOptions options;
  options.threads = 1;
  const auto right = lossverify::run_case(c, options);
  options.implementation = "smoothing-partition-vocab";
  const auto buggy = lossverify::run_case(c, options);
  std::printf("plugin ABI %u; correct %s, smoothing-partition-vocab %s\n", LV_PLUGIN_ABI_VERSION,
              std::string(lossverify::to_string(right.verdict)).c_str(),
              std::string(lossverify::to_string(buggy.verdict)).c_str());
  return right.verdict == lossverify::Verdict::pass && buggy.verdict == lossverify::Verdict::fail ? 0 : 1;
}
