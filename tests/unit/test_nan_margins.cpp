// A NaN margin is never a pass: every judgement path (the checks' ErrorStats, the gradient's GradJudge in both
// modes, the invariance check) fails an element whose reference or tolerance is not finite unless the value is
// exactly equal, and a run whose float64 reference overflows is refused (exit 2) before any comparison.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/checks/element_judge.hpp"
#include "lossverify/core/errors.hpp"
#include "test_support.hpp"

using namespace lossverify;
using namespace lossverify::testing;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// One element through ErrorStats, the path of loss, rank_agreement, row_sum, stats and the per-token values.
CheckResult judged_alone(double expected, double got, double tolerance) {
  ErrorStats stats;
  stats.add({5, -1, 0, expected, got, tolerance});
  return make_result("loss", stats, Tolerance{}, "");
}

}  // namespace

TEST_CASE("margin_of_is_never_nan_and_a_tolerance_that_is_not_finite_passes_only_an_exact_value") {
  CHECK(margin_of(kInf, kInf) == kInf);  // was inf / inf = NaN, and NaN <= 1 is false: a pass
  CHECK(margin_of(123.0, kInf) == kInf);
  CHECK(margin_of(123.0, kNaN) == kInf);
  CHECK(margin_of(kNaN, 1.0) == kInf);
  CHECK(margin_of(0.0, kInf) == 0.0);  // equal values agree, infinities included (two TP ranks at +inf)
  CHECK(mismatch_of(kInf, kInf));
  CHECK(mismatch_of(123.0, kInf));
  CHECK(mismatch_of(kNaN, kNaN));
  CHECK_FALSE(mismatch_of(0.5, 1.0));
  CHECK(mismatch_of(1.5, 1.0));
}

TEST_CASE("every_check_on_error_stats_fails_an_element_against_an_infinite_reference") {
  for (const double got : {123.0, -42.0, kNaN, -kInf}) {
    CAPTURE(got);
    const CheckResult r = judged_alone(kInf, got, kInf);  // the audit's token: reference +inf, tolerance inf
    CHECK(r.verdict == Verdict::fail);
    CHECK(r.margin == kInf);
    CHECK_FALSE(std::isnan(r.margin));
  }
  CHECK(judged_alone(kNaN, 1.0, 1.0).verdict == Verdict::fail);
  CHECK(judged_alone(1.0, 1.0, kNaN).verdict == Verdict::pass);  // exact
  CHECK(judged_alone(1.0, 1.5, kNaN).verdict == Verdict::fail);
}

TEST_CASE("the_gradient_judgement_fails_against_a_reference_that_is_not_finite_in_both_modes") {
  for (const int max_ulp : {0, 1}) {
    CAPTURE(max_ulp);
    GradJudgement g;
    g.tolerance.atol = 1e-6;
    g.tolerance.rtol = 1e-5;
    g.tolerance.max_ulp = max_ulp;
    g.dtype = max_ulp > 0 ? DType::bf16 : DType::fp32;
    g.quantum = output_quantum(g.dtype);
    const GradJudge judge{g};
    for (const double expected : {kInf, -kInf, kNaN}) {
      for (const double got : {123.0, 0.0, kNaN}) {
        CAPTURE(expected);
        CAPTURE(got);
        bool mismatch = false;
        std::int64_t ulp = 0;
        const double m = judge.judge(got, expected, 1.0, mismatch, ulp);
        CHECK(mismatch);
        CHECK(m == kInf);
      }
    }
    bool mismatch = true;
    std::int64_t ulp = 0;
    CHECK(judge.judge(0.25, 0.25, 1.0, mismatch, ulp) == 0.0);
    CHECK_FALSE(mismatch);
  }
}

TEST_CASE("a_run_whose_float64_reference_overflows_is_refused_before_any_comparison") {
  // The audit's token, as a case: an old log-probability of -1000 under a negative advantage and no dual clip
  // makes the reference's ratio e^(~990): its loss is +inf.
  nlohmann::json j = nlohmann::json::parse(R"({
    "name": "overflow", "shape": {"vocab": 64}, "batch": {"sequence_lengths": [9, 7]},
    "loss": {"kind": "policy", "dual_clip": 0}, "inputs": {"seed": 3, "scale": 1.0,
    "overrides": [{"token": 4, "old_logprob": -1000.0, "advantages": -1.0}]},
    "layout": {"tp": 2, "dp": 2}, "timeout_seconds": 60})");
  const Case c = make_case(j);
  try {
    (void)run_with(c, "correct");
    FAIL("the run was judged");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::usage_error);
    CHECK(std::string(e.what()).find("token 4: the float64 reference's loss (or its weight in L) is not finite") !=
          std::string::npos);
  }
  // The same token at a reachable ratio is judged, and passes.
  j["inputs"]["overrides"][0]["old_logprob"] = -20.0;
  CHECK(run_with(make_case(j), "correct").verdict == Verdict::pass);
}
