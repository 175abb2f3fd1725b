#pragma once
// The control band (docs/checks.md, "The control band"): beside each check's margin, the margins that
// lossverify's correct implementation reaches on the run's own inputs, dtype and layout -- computing in
// float32, and computing in the case's 16-bit dtype where it has one (the 16-bit control, correct-16bit).
// Rounding a correct kernel cannot avoid reads within the band; a layout bug reads far above it.
#include <optional>
#include <string>
#include <vector>

#include "lossverify/runner/run_case.hpp"

namespace lossverify {

class Launcher;

// The controls of a run of `c` under `options` (their backend is the CPU, their ranks the launcher's):
// `float32` (correct) and, for 16-bit logits, the dtype's name (correct-16bit). `run` is the user's own
// result: when it is lossverify's correct implementation on the CPU, its margins are the float32 control's.
std::vector<ControlRun> run_controls(const Case& c, const RunOptions& options, Launcher& launcher,
                                     const RunResult& run);

// What run_controls would refuse, found before any work: CaseError naming the control band and --no-control.
void check_controls(const Case& c, const RunOptions& options, const Launcher& launcher);

// How a check's margin reads against its band [low, high] (the controls' smallest and largest margins):
// within at most twice the band's top, or below a quarter of the tolerance (rounding that small is not the
// band's to judge: correct kernels with another order of operations reach it); far above when it passes yet
// exceeds four times the top (a bug may hide under the tolerance); above otherwise.
enum class BandReading { within, above, far_above };
struct CheckBand {
  double low = 0.0, high = 0.0;
  std::vector<double> margins;  // each control's, in the run's controls' order
  BandReading reading = BandReading::within;
};
inline constexpr double kBandWithinFactor = 2.0;
inline constexpr double kBandFarFactor = 4.0;
inline constexpr double kBandFloor = 0.25;
// None when the run has no controls, the check was not judged, or no control reports it.
std::optional<CheckBand> band_of(const RunResult& run, const CheckResult& check);
std::string_view to_string(BandReading reading);

// One line per failing check within its band and per passing check far above it (empty: nothing to say).
std::vector<std::string> band_notes(const RunResult& run);

}  // namespace lossverify
