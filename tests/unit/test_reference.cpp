// The float64 reference against an independent long-double computation written without the max shift
// (exp(240) is fine in long double), and its gradient against central finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

struct LongDoubleLoss {
  long double alpha;
  bool megatron;
  long double z_weight;
  std::int64_t label;

  long double operator()(const std::vector<long double>& x) const {
    const auto n = static_cast<long double>(x.size());
    long double sum_exp = 0;
    long double sum_qx = 0;
    for (std::size_t v = 0; v < x.size(); ++v) {
      sum_exp += expl(x[v]);
      const long double hit = static_cast<std::int64_t>(v) == label ? 1.0L : 0.0L;
      const long double q = megatron ? (1 - alpha) * hit + alpha / (n - 1) * (1 - hit) : (1 - alpha) * hit + alpha / n;
      sum_qx += q * x[v];
    }
    const long double lse = logl(sum_exp);
    return lse - sum_qx + z_weight * lse * lse;
  }
};

void compare_with_long_double(const nlohmann::json& j) {
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const auto vocab = c.shape.vocab;
  std::vector<double> x(static_cast<std::size_t>(vocab));
  std::vector<double> grad(static_cast<std::size_t>(vocab));
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    inputs.logits(t, 0, vocab, x.data());
    const ReferenceToken r = reference.evaluate(t, x, {}, grad);
    if (!r.valid) {
      CHECK(r.loss == 0.0);
      for (double g : grad) CHECK(g == 0.0);
      continue;
    }
    const LongDoubleLoss f{static_cast<long double>(cross_entropy_options(c.loss).label_smoothing),
                           cross_entropy_options(c.loss).convention == SmoothingConvention::megatron,
                           static_cast<long double>(cross_entropy_options(c.loss).z_loss_weight), inputs.label(t)};
    std::vector<long double> xl(x.begin(), x.end());
    const long double exact = f(xl);
    CHECK(std::fabs(r.loss - static_cast<double>(exact)) <= 1e-13 * std::fabs(static_cast<double>(exact)) + 1e-13);
    // Central differences of the long-double loss: truncation ~h^2, rounding ~1e-19 / h.
    for (std::int64_t v = 0; v < vocab; v += std::max<std::int64_t>(1, vocab / 17)) {
      const long double h = 1e-5L;
      auto plus = xl;
      auto minus = xl;
      plus[static_cast<std::size_t>(v)] += h;
      minus[static_cast<std::size_t>(v)] -= h;
      const long double derivative = (f(plus) - f(minus)) / (2 * h);
      const double expected = r.weight * static_cast<double>(derivative);
      CHECK(std::fabs(grad[static_cast<std::size_t>(v)] - expected) <=
            1e-9 * std::fabs(r.weight) + 1e-9 * std::fabs(expected));
    }
  }
}

}  // namespace

TEST_CASE("reference_matches_long_double_for_plain_cross_entropy") {
  compare_with_long_double(testing::case_json(16, 97, 1));
}

TEST_CASE("reference_matches_long_double_with_pytorch_smoothing_z_loss_and_ignored_tokens") {
  auto j = testing::case_json(24, 101, 1);
  j["loss"] = {{"label_smoothing", 0.2}, {"smoothing_convention", "pytorch"}, {"z_loss_weight", 0.01}};
  j["inputs"]["ignore_fraction"] = 0.3;
  compare_with_long_double(j);
}

TEST_CASE("reference_matches_long_double_with_megatron_smoothing_sum_reduction_and_a_240_logit_gap") {
  auto j = testing::case_json(8, 32, 1);
  j["loss"] = {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}, {"reduction", "sum"}};
  std::vector<double> gap(32, 0.0);
  gap[3] = 240.0;
  std::vector<double> negative_gap(32, 120.0);
  negative_gap[9] = -120.0;
  j["inputs"]["overrides"] = {{{"token", 0}, {"logits", gap}, {"label", 4}},
                              {{"token", 1}, {"logits", negative_gap}, {"label", 9}}};
  compare_with_long_double(j);
}

TEST_CASE("reference_matches_long_double_for_reduction_none_with_upstream_weights") {
  auto j = testing::case_json(12, 64, 1);
  j["loss"] = {{"reduction", "none"},
               {"label_smoothing", 0.05},
               {"upstream_weights", {{"distribution", "uniform"}, {"low", -2.0}, {"high", 3.0}}}};
  compare_with_long_double(j);
}

TEST_CASE("reference_token_weights_follow_the_reduction") {
  auto j = testing::case_json(100, 16, 1);
  j["inputs"]["ignore_fraction"] = 0.5;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  std::int64_t valid = 0;
  for (std::int64_t t = 0; t < 100; ++t) valid += inputs.is_valid(t);
  CHECK(reference.valid_tokens() == valid);
  for (std::int64_t t = 0; t < 100; ++t) {
    CHECK(reference.token_weight(t) == (inputs.is_valid(t) ? 1.0 / static_cast<double>(valid) : 0.0));
  }
}

TEST_CASE("an_all_masked_batch_gives_zero_loss_and_zero_gradient_never_nan") {
  auto j = testing::case_json(6, 16, 1);
  j["inputs"]["ignore_fraction"] = 1.0;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  std::vector<double> x(16), grad(16), losses;
  for (std::int64_t t = 0; t < 6; ++t) {
    inputs.logits(t, 0, 16, x.data());
    losses.push_back(reference.evaluate(t, x, {}, grad).loss);
    for (double g : grad) CHECK(g == 0.0);
  }
  CHECK(reference.reduced_loss(losses) == 0.0);
}

TEST_CASE("compensated_summation_recovers_what_naive_summation_loses") {
  CompensatedSum s;
  s.add(1.0);
  for (int i = 0; i < 1000; ++i) s.add(1e-16);
  s.add(-1.0);
  CHECK(s.value() == doctest::Approx(1e-13).epsilon(1e-12));
}
