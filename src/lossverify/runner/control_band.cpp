#include "lossverify/runner/control_band.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "lossverify/core/dtype.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/runner/launcher.hpp"

namespace lossverify {

namespace {

std::vector<std::pair<std::string, double>> judged_margins(const RunResult& run) {
  std::vector<std::pair<std::string, double>> margins;
  for (const CheckResult& check : run.checks) {
    if (check.verdict != Verdict::not_applicable) margins.emplace_back(check.name, check.margin);
  }
  return margins;
}

// The user's own run stands for the float32 control when it is that very computation.
bool is_float32_control(const RunOptions& options, const RunResult& run) {
  return run.implementation != nullptr && run.implementation == find_implementation("correct") &&
         options.device == RunOptions::Device::cpu && options.fault.kind == FaultInjection::Kind::none;
}

// The options a control runs under: the CPU, the run's threads and inputs, no control of its own.
RunOptions control_options(const RunOptions& options, const std::string& implementation) {
  RunOptions control;
  control.implementation = implementation;
  control.threads = options.threads;
  control.shared_inputs = options.shared_inputs;
  return control;
}

// The controls of a case, what each computes in and its implementation: float32 always, the logits' dtype
// for 16-bit logits.
struct Control {
  std::string name, implementation;
};
std::vector<Control> controls_of(const Case& c) {
  std::vector<Control> controls = {{"float32", "correct"}};
  if (c.inputs.dtype != DType::fp32) controls.push_back({std::string(to_string(c.inputs.dtype)), "correct-16bit"});
  return controls;
}

ControlRun run_control(const Case& c, const RunOptions& options, Launcher& launcher, const Control& control) {
  const auto start = std::chrono::steady_clock::now();
  const RunResult result = run_case(c, control_options(options, control.implementation), launcher);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {control.name, control.implementation, judged_margins(result), seconds};
}

std::string format_margin(double v) {
  std::ostringstream s;
  s << std::setprecision(3) << v;
  return s.str();
}

}  // namespace

std::vector<ControlRun> run_controls(const Case& c, const RunOptions& options, Launcher& launcher,
                                     const RunResult& run) {
  std::vector<ControlRun> controls;
  for (const Control& control : controls_of(c)) {
    if (control.implementation == "correct" && is_float32_control(options, run)) {
      controls.push_back({control.name, control.implementation, judged_margins(run), 0.0});
    } else {
      controls.push_back(run_control(c, options, launcher, control));
    }
  }
  return controls;
}

void check_controls(const Case& c, const RunOptions& options, const Launcher& launcher) {
  for (const Control& control : controls_of(c)) {
    try {
      check_run(c, control_options(options, control.implementation), launcher);
    } catch (const CaseError& e) {
      throw CaseError("the control band (" + control.implementation + " on the CPU): " + e.what() +
                      "; --no-control runs without it");
    }
  }
}

std::optional<CheckBand> band_of(const RunResult& run, const CheckResult& check) {
  if (run.controls.empty() || check.verdict == Verdict::not_applicable) return std::nullopt;
  CheckBand band;
  for (const ControlRun& control : run.controls) {
    const auto it = std::find_if(control.margins.begin(), control.margins.end(),
                                 [&](const auto& m) { return m.first == check.name; });
    if (it == control.margins.end()) return std::nullopt;
    band.margins.push_back(it->second);
  }
  band.low = *std::min_element(band.margins.begin(), band.margins.end());
  band.high = *std::max_element(band.margins.begin(), band.margins.end());
  const double m = check.margin;
  if (m <= std::max(kBandWithinFactor * band.high, kBandFloor)) {
    band.reading = BandReading::within;
  } else if (check.verdict == Verdict::pass && m > kBandFarFactor * band.high) {
    band.reading = BandReading::far_above;
  } else {
    band.reading = BandReading::above;
  }
  return band;
}

std::string_view to_string(BandReading reading) {
  switch (reading) {
    case BandReading::within:
      return "within";
    case BandReading::above:
      return "above";
    case BandReading::far_above:
      return "far_above";
  }
  return "?";
}

std::vector<std::string> band_notes(const RunResult& run) {
  std::vector<std::string> notes;
  for (const CheckResult& check : run.checks) {
    const std::optional<CheckBand> band = band_of(run, check);
    if (!band) continue;
    const auto top_index = std::max_element(band->margins.begin(), band->margins.end()) - band->margins.begin();
    const std::string& top = run.controls[static_cast<std::size_t>(top_index)].name;
    if (check.verdict == Verdict::fail && band->reading == BandReading::within) {
      std::string note = check.name + " fails within the control band: computing in " + top + ", the correct " +
                         "implementation reaches " + format_margin(band->high) +
                         " on these inputs, so rounding explains this margin if the kernel computes in " + top;
      const double float32 = band->margins.front();
      if (float32 < band->high) {
        note += "; computing in " + run.controls.front().name + " it reaches " + format_margin(float32);
        // Above the band a float32 control alone would make: a kernel computing in float32 cannot be this far off.
        if (check.margin > std::max(kBandWithinFactor * float32, kBandFloor)) {
          note += ", so a kernel that computes in " + run.controls.front().name + " is wrong here";
        }
      }
      notes.push_back(note);
    } else if (band->reading == BandReading::far_above) {
      notes.push_back(check.name + " passes " + format_margin(check.margin / std::max(band->high, 1e-300)) +
                      "x above the control band: correct implementations reach at most " + format_margin(band->high) +
                      " on these inputs; a bug may hide under the tolerance");
    }
  }
  return notes;
}

}  // namespace lossverify
