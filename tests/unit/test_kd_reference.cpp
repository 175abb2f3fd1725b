// The float64 KD reference (forward KL with temperature, docs/spec.md §3) against an independent long-double
// computation written from the definition k = T^s sum_v P_v (log P_v - log Q_v), P = softmax(y/T),
// Q = softmax(x/T), and its gradient against central finite differences of that long-double function.
// Then the sharded KD implementation against the reference at several TP sizes and dtypes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

// k(x) for a fixed teacher row y, in long double, straight from the definition (no max shift: the logits
// here are at most a few tens after dividing by T, far from long double's exp range).
struct LongDoubleKd {
  std::vector<long double> y;
  long double temperature;
  long double s;  // 2 with T^2 scaling, else 0

  long double operator()(const std::vector<long double>& x) const {
    long double sum_p = 0;
    long double sum_q = 0;
    for (std::size_t v = 0; v < x.size(); ++v) {
      sum_p += expl(y[v] / temperature);
      sum_q += expl(x[v] / temperature);
    }
    const long double lse_p = logl(sum_p);
    const long double lse_q = logl(sum_q);
    long double k = 0;
    for (std::size_t v = 0; v < x.size(); ++v) {
      const long double log_p = y[v] / temperature - lse_p;
      const long double log_q = x[v] / temperature - lse_q;
      const long double p = expl(log_p);
      if (p > 0) k += p * (log_p - log_q);
    }
    return powl(temperature, s) * k;
  }
};

nlohmann::json kd_json(std::int64_t tokens, std::int64_t vocab, int tp, double temperature, bool t2_scaling,
                       const std::string& dtype = "fp32") {
  auto j = testing::case_json(tokens, vocab, tp, dtype);
  j["loss"] = {{"kind", "kd"}, {"temperature", temperature}, {"t2_scaling", t2_scaling}};
  // A teacher unlike the student (student logits: mean 0, scale 2), so KL is O(1) on every token.
  j["inputs"]["teacher"] = {{"mean", 0.5}, {"scale", 3.0}};
  return j;
}

// Returns the number of valid tokens compared.
std::int64_t compare_with_long_double(const nlohmann::json& j) {
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  REQUIRE(reference.needs_teacher());
  const auto vocab = c.shape.vocab;
  const long double temperature = static_cast<long double>(kd_options(c.loss).temperature);
  const long double s = kd_options(c.loss).t2_scaling ? 2.0L : 0.0L;
  // The natural scale of one token's gradient: |Q_v - P_v| <= 1, times T^(s-1).
  const double grad_scale = std::pow(kd_options(c.loss).temperature, static_cast<double>(s) - 1.0);
  std::vector<double> x(static_cast<std::size_t>(vocab));
  std::vector<double> y(static_cast<std::size_t>(vocab));
  std::vector<double> grad(static_cast<std::size_t>(vocab));
  std::int64_t compared = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    CAPTURE(t);
    inputs.logits(t, 0, vocab, x.data());
    inputs.teacher_logits(t, 0, vocab, y.data());
    const ReferenceToken r = reference.evaluate(t, x, y, grad);
    if (!r.valid) {
      // Masked: 0 loss and exactly 0 gradient (docs/spec.md §3).
      CHECK(inputs.masked(t));
      CHECK(r.loss == 0.0);
      CHECK(r.weight == 0.0);
      for (double g : grad) CHECK(g == 0.0);
      continue;
    }
    ++compared;
    const LongDoubleKd f{std::vector<long double>(y.begin(), y.end()), temperature, s};
    std::vector<long double> xl(x.begin(), x.end());
    const long double exact = f(xl);
    CHECK(exact > 0);  // teacher != student
    // The terms P_v |log P_v - log Q_v| sum to a few tens at most here; the reference rounds each in double
    // (~1e-16) and sums them compensated, so 1e-13 T^s leaves a wide margin.
    const double loss_scale = std::pow(kd_options(c.loss).temperature, static_cast<double>(s));
    CHECK(std::fabs(r.loss - static_cast<double>(exact)) <=
          1e-13 * loss_scale + 1e-13 * std::fabs(static_cast<double>(exact)));
    // Central differences: truncation h^2/6 |k'''| ~ 1e-11 T^(s-3), rounding ~1e-19 |k| / h ~ 1e-14.
    for (std::int64_t v = 0; v < vocab; v += std::max<std::int64_t>(1, vocab / 17)) {
      const long double h = 1e-5L;
      auto plus = xl;
      auto minus = xl;
      plus[static_cast<std::size_t>(v)] += h;
      minus[static_cast<std::size_t>(v)] -= h;
      const long double derivative = (f(plus) - f(minus)) / (2 * h);
      const double expected = r.weight * static_cast<double>(derivative);
      CAPTURE(v);
      CHECK(std::fabs(grad[static_cast<std::size_t>(v)] - expected) <=
            1e-9 * std::fabs(r.weight) * grad_scale + 1e-9 * std::fabs(expected));
    }
  }
  return compared;
}

}  // namespace

TEST_CASE("kd_reference_matches_long_double_at_temperature_1") {
  CHECK(compare_with_long_double(kd_json(16, 97, 1, 1.0, true)) == 16);
  CHECK(compare_with_long_double(kd_json(16, 97, 1, 1.0, false)) == 16);
}

TEST_CASE("kd_reference_matches_long_double_at_temperature_2_with_and_without_t2_scaling") {
  CHECK(compare_with_long_double(kd_json(16, 97, 1, 2.0, true)) == 16);
  CHECK(compare_with_long_double(kd_json(16, 97, 1, 2.0, false)) == 16);
}

TEST_CASE("kd_reference_matches_long_double_at_temperature_0_7_with_and_without_t2_scaling") {
  CHECK(compare_with_long_double(kd_json(16, 97, 1, 0.7, true)) == 16);
  CHECK(compare_with_long_double(kd_json(16, 97, 1, 0.7, false)) == 16);
}

TEST_CASE("kd_reference_matches_long_double_with_masked_tokens_and_sum_reduction") {
  auto j = kd_json(40, 64, 1, 2.0, true);
  j["inputs"]["ignore_fraction"] = 0.3;
  j["loss"]["reduction"] = "sum";
  const std::int64_t valid = compare_with_long_double(j);
  // About 30% of 40 tokens masked: some of each kind, so both branches were exercised.
  CHECK(valid > 0);
  CHECK(valid < 40);
  j["loss"]["reduction"] = "mean";
  CHECK(compare_with_long_double(j) == valid);
}

TEST_CASE("kd_reference_matches_long_double_for_reduction_none_with_upstream_weights") {
  auto j = kd_json(12, 64, 1, 0.7, true);
  j["loss"]["reduction"] = "none";
  j["loss"]["upstream_weights"] = {{"distribution", "uniform"}, {"low", -2.0}, {"high", 3.0}};
  CHECK(compare_with_long_double(j) == 12);
}

TEST_CASE("kd_reference_is_exactly_zero_when_the_teacher_is_the_student") {
  for (double temperature : {1.0, 2.0, 0.7}) {
    for (bool t2 : {true, false}) {
      CAPTURE(temperature);
      CAPTURE(t2);
      auto j = kd_json(20, 97, 1, temperature, t2);
      j["inputs"]["teacher"] = {{"same_as_student", true}};
      j["inputs"]["ignore_fraction"] = 0.2;
      const Case c = testing::make_case(j);
      const InputSource inputs(c);
      const LossReference reference(c, inputs);
      std::vector<double> x(97), y(97), grad(97), losses;
      for (std::int64_t t = 0; t < 20; ++t) {
        inputs.logits(t, 0, 97, x.data());
        inputs.teacher_logits(t, 0, 97, y.data());
        CHECK(x == y);
        const ReferenceToken r = reference.evaluate(t, x, y, grad);
        CHECK(r.valid == !inputs.masked(t));
        // log P_v - log Q_v is the same double expression on both sides: every term is exactly 0.
        CHECK(r.loss == 0.0);
        for (double g : grad) CHECK(g == 0.0);
        losses.push_back(r.loss);
      }
      CHECK(reference.reduced_loss(losses) == 0.0);
    }
  }
}

TEST_CASE("kd_reference_of_an_all_masked_batch_is_zero_never_nan") {
  auto j = kd_json(6, 16, 1, 2.0, true);
  j["inputs"]["ignore_fraction"] = 1.0;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  CHECK(reference.valid_tokens() == 0);
  std::vector<double> x(16), y(16), grad(16), losses;
  for (std::int64_t t = 0; t < 6; ++t) {
    inputs.logits(t, 0, 16, x.data());
    inputs.teacher_logits(t, 0, 16, y.data());
    losses.push_back(reference.evaluate(t, x, y, grad).loss);
    for (double g : grad) CHECK(g == 0.0);
  }
  CHECK(reference.reduced_loss(losses) == 0.0);
}

TEST_CASE("kd_sharded_correct_implementation_matches_reference_for_every_tp_and_dtype") {
  struct Variant {
    double temperature;
    bool t2;
    const char* reduction;
  };
  for (int tp : {1, 2, 3, 4}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      for (const Variant variant : {Variant{2.0, true, "mean"}, Variant{0.7, true, "sum"}, Variant{1.0, false, "mean"},
                                    Variant{2.0, false, "sum"}}) {
        CAPTURE(tp);
        CAPTURE(dtype);
        CAPTURE(variant.temperature);
        CAPTURE(variant.t2);
        CAPTURE(variant.reduction);
        auto j = kd_json(48, 257, tp, variant.temperature, variant.t2, dtype);
        j["loss"]["reduction"] = variant.reduction;
        j["inputs"]["ignore_fraction"] = 0.15;
        RunOptions options;
        options.threads = 2;
        const RunResult r = run_case(testing::make_case(j), options);
        CHECK(r.verdict == Verdict::pass);
        for (const auto& check : r.checks) {
          CAPTURE(check.name);
          CHECK(check.verdict != Verdict::fail);
        }
      }
    }
  }
}
