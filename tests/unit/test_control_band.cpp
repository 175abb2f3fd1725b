// The control band (runner/control_band.hpp, docs/checks.md): how a margin reads against its controls, the
// controls of a bf16 run (the correct implementation on its own float32 control, a layout bug far above both),
// and the 16-bit control's arithmetic (the correct one on fp32, outputs in the dtype on bf16).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/runner/control_band.hpp"
#include "lossverify/runner/launcher.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;
using testing::case_json;
using testing::check_named;
using testing::make_case;

namespace {

CheckResult check_of(const std::string& name, Verdict verdict, double margin) {
  CheckResult c;
  c.name = name;
  c.verdict = verdict;
  c.margin = margin;
  return c;
}

// A run whose one check `grad` has `margin`, under controls float32 = f32 and bf16 = b16.
RunResult synthetic(Verdict verdict, double margin, double f32, double b16) {
  RunResult run;
  run.checks.push_back(check_of("grad", verdict, margin));
  run.controls.push_back({"float32", "correct", {{"grad", f32}}, 0.0});
  run.controls.push_back({"bf16", "correct-16bit", {{"grad", b16}}, 0.0});
  return run;
}

BandReading reading(Verdict verdict, double margin, double f32, double b16) {
  const RunResult run = synthetic(verdict, margin, f32, b16);
  const auto band = band_of(run, run.checks.front());
  REQUIRE(band.has_value());
  return band->reading;
}

// The smoothed bf16 case at tp 4 on which smoothing-partition-vocab shows in the gradient.
Case smoothed_bf16() {
  nlohmann::json j = case_json(256, 512, 4, "bf16");
  j["loss"] = {{"label_smoothing", 0.1}};
  return make_case(j);
}

RunResult run_with_controls(const Case& c, const std::string& impl) {
  RunOptions options;
  options.implementation = impl;
  options.threads = 2;
  options.control = true;
  return run_case(c, options);
}

double control_margin(const RunResult& run, std::size_t control, const std::string& check) {
  for (const auto& [name, margin] : run.controls.at(control).margins) {
    if (name == check) return margin;
  }
  FAIL("control " << control << " has no margin for " << check);
  return 0.0;
}

RankRun ranks_of(const Case& c, const InputSource& inputs, const std::string& impl) {
  RunOptions options;
  options.threads = 1;
  return execute_ranks(c, inputs, *find_implementation(impl), options);
}

}  // namespace

TEST_CASE("a margin reads within its band up to twice the band's top, or below a quarter of the tolerance") {
  CHECK(reading(Verdict::pass, 0.5, 0.5, 8.0) == BandReading::within);
  CHECK(reading(Verdict::fail, 9.4, 0.5, 8.0) == BandReading::within);   // PyTorch eager bf16's gradient
  CHECK(reading(Verdict::fail, 16.0, 0.5, 8.0) == BandReading::within);  // the edge: exactly twice the top
  CHECK(reading(Verdict::fail, 16.1, 0.5, 8.0) == BandReading::above);
  CHECK(reading(Verdict::fail, 1420.0, 0.5, 7.85) == BandReading::above);
  CHECK(reading(Verdict::pass, 0.2, 0.01, 0.02) == BandReading::within);      // under the floor
  CHECK(reading(Verdict::pass, 0.9, 0.05, 0.1) == BandReading::far_above);    // a bug may hide under the tolerance
  CHECK(reading(Verdict::pass, 0.35, 0.05, 0.1) == BandReading::above);       // above, not four times the top
  CHECK(reading(Verdict::fail, 0.9 * 4.5, 0.05, 0.1) == BandReading::above);  // far_above is for passes only
}

TEST_CASE("a check without a judged control margin has no band, and the notes say what the band means") {
  RunResult run = synthetic(Verdict::not_applicable, 0.0, 0.1, 0.2);
  CHECK_FALSE(band_of(run, run.checks.front()).has_value());
  run = synthetic(Verdict::pass, 0.1, 0.1, 0.2);
  run.controls.back().margins.clear();  // the 16-bit control did not judge grad
  CHECK_FALSE(band_of(run, run.checks.front()).has_value());
  CHECK(band_notes(run).empty());
  run.controls.clear();
  CHECK_FALSE(band_of(run, run.checks.front()).has_value());

  const RunResult within = synthetic(Verdict::fail, 9.4, 0.5, 8.0);
  const std::vector<std::string> fail_notes = band_notes(within);
  REQUIRE(fail_notes.size() == 1);
  CHECK(fail_notes[0].find("grad fails within the control band: computing in bf16") != std::string::npos);
  CHECK(fail_notes[0].find("computing in float32 it reaches 0.5") != std::string::npos);
  CHECK(fail_notes[0].find("a kernel that computes in float32 is wrong here") != std::string::npos);
  // A failure within the float32 control's own band does not call a float32 kernel wrong.
  const std::vector<std::string> close = band_notes(synthetic(Verdict::fail, 1.2, 0.9, 8.0));
  REQUIRE(close.size() == 1);
  CHECK(close[0].find("computing in float32 it reaches 0.9") != std::string::npos);
  CHECK(close[0].find("is wrong here") == std::string::npos);
  const std::vector<std::string> pass_notes = band_notes(synthetic(Verdict::pass, 0.9, 0.05, 0.1));
  REQUIRE(pass_notes.size() == 1);
  CHECK(pass_notes[0].find("grad passes 9x above the control band") != std::string::npos);
  CHECK(band_notes(synthetic(Verdict::fail, 1420.0, 0.5, 7.85)).empty());
}

TEST_CASE("bf16: the correct run sits on its float32 control, a layout bug far above both controls") {
  const Case c = smoothed_bf16();
  const RunResult correct = run_with_controls(c, "correct");
  REQUIRE(correct.controls.size() == 2);
  CHECK(correct.controls[0].name == "float32");
  CHECK(correct.controls[1].name == "bf16");
  CHECK(correct.controls[1].implementation == "correct-16bit");
  for (const CheckResult& check : correct.checks) {
    if (check.verdict == Verdict::not_applicable) continue;
    CAPTURE(check.name);
    CHECK(control_margin(correct, 0, check.name) == check.margin);  // it is its own float32 control
    const auto band = band_of(correct, check);
    REQUIRE(band.has_value());
    CHECK(band->reading == BandReading::within);
  }
  // Computing in bf16 costs the gradient several ulps: the band's top is well above the float32 control's half ulp.
  CHECK(control_margin(correct, 0, "grad") <= 0.51);
  CHECK(control_margin(correct, 1, "grad") > 2.0);

  const RunResult bug = run_with_controls(c, "smoothing-partition-vocab");
  const CheckResult& grad = check_named(bug, "grad");
  REQUIRE(grad.verdict == Verdict::fail);
  const auto band = band_of(bug, grad);
  REQUIRE(band.has_value());
  CHECK(band->reading == BandReading::above);
  CHECK(grad.margin > 10.0 * band->high);
  // The controls ran on the same inputs: the same margins as the correct run's.
  CHECK(control_margin(bug, 0, "grad") == control_margin(correct, 0, "grad"));
  CHECK(control_margin(bug, 1, "grad") == control_margin(correct, 1, "grad"));
}

TEST_CASE("an fp32 run has the float32 control only; --no-control has none") {
  const Case c = make_case(case_json(64, 96, 2));
  const RunResult run = run_with_controls(c, "mean-over-all-rows");
  REQUIRE(run.controls.size() == 1);
  CHECK(run.controls[0].name == "float32");
  CHECK(run.controls[0].seconds > 0.0);  // a run of its own, not the user's
  RunOptions options;
  options.threads = 2;
  CHECK(run_case(c, options).controls.empty());
}

TEST_CASE("the 16-bit control: the correct implementation on fp32, every stored output in the dtype on bf16") {
  const Case fp32 = make_case(case_json(48, 80, 2));
  const InputSource fp32_inputs(fp32);
  const RankRun a = ranks_of(fp32, fp32_inputs, "correct");
  const RankRun b = ranks_of(fp32, fp32_inputs, "correct-16bit");
  for (std::size_t r = 0; r < a.outputs.size(); ++r) {
    CHECK(a.outputs[r].grad == b.outputs[r].grad);
    CHECK(a.outputs[r].token_loss == b.outputs[r].token_loss);
  }

  for (const char* kind : {"cross_entropy", "kd"}) {
    CAPTURE(kind);
    nlohmann::json j = case_json(48, 80, 2, "bf16");
    j["loss"] = {{"kind", kind}};
    const Case c = make_case(j);
    const InputSource inputs(c);
    const RankRun correct = ranks_of(c, inputs, "correct");
    const RankRun control = ranks_of(c, inputs, "correct-16bit");
    bool differs = false;
    for (std::size_t r = 0; r < control.outputs.size(); ++r) {
      for (const float loss : control.outputs[r].token_loss) {
        CHECK(round_to_dtype(loss, DType::bf16) == loss);  // each token's loss stored in bf16
      }
      differs = differs || control.outputs[r].grad != correct.outputs[r].grad;
    }
    CHECK(differs);  // computing in bf16 moves gradient elements the float32 kernel rounds once
  }
}

TEST_CASE("the 16-bit control runs on the CPU backend only") {
  const Case c = make_case(case_json(16, 32, 1, "bf16"));
  RunOptions options;
  options.implementation = "correct-16bit";
  options.device = RunOptions::Device::cuda;
  CHECK_THROWS_AS(check_run(c, options), CaseError);
  CHECK(std::none_of(implementations().begin(), implementations().end(),
                     [](const Implementation& impl) { return impl.bugs.compute_in_input_dtype; }));  // not in the gate
}

TEST_CASE("a control the machine cannot run is refused before any work, naming the band and --no-control") {
  const Case huge = make_case(case_json(1 << 20, 1 << 20, 1));  // 4 TiB of float32 logits on one rank
  RunOptions options;
  options.control = true;
  try {
    check_run(huge, options);
    FAIL("a 4 TiB case passed check_run");
  } catch (const CaseError& e) {
    const std::string message = e.what();
    CAPTURE(message);
    CHECK(message.find("this machine has") != std::string::npos);  // the main run itself is refused first
  }
  try {
    check_controls(huge, RunOptions{}, *thread_launcher());
    FAIL("a 4 TiB control passed check_controls");
  } catch (const CaseError& e) {
    const std::string message = e.what();
    CAPTURE(message);
    CHECK(message.find("the control band (correct on the CPU)") != std::string::npos);
    CHECK(message.find("--no-control") != std::string::npos);
  }
}
