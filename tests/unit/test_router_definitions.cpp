// The router losses' definitions (kinds/router/router_definitions.hpp) against independent long-double
// evaluations: each closed-form gradient is the central difference of its loss, the counts held constant.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "lossverify/kinds/router/router_definitions.hpp"

namespace lossverify {

namespace {

using LD = long double;

std::vector<LD> scores_ld(router::Score score, const std::vector<LD>& z) {
  std::vector<LD> s(z.size());
  LD total = 0.0L;
  for (std::size_t e = 0; e < z.size(); ++e) {
    s[e] = score == router::Score::softmax ? std::exp(z[e]) : 1.0L / (1.0L + std::exp(-z[e]));
    total += s[e];
  }
  for (LD& v : s) v /= total;
  return s;
}

// L_aux of a scope from the definition, in long double: coef E / (k T^2) sum_e c_e sum_t s_te.
LD aux_ld(router::Score score, const std::vector<std::vector<LD>>& z, const std::vector<LD>& counts, LD coef, int k) {
  const std::size_t experts = counts.size();
  std::vector<LD> sums(experts, 0.0L);
  for (const auto& row : z) {
    const std::vector<LD> s = scores_ld(score, row);
    for (std::size_t e = 0; e < experts; ++e) sums[e] += s[e];
  }
  LD dot = 0.0L;
  for (std::size_t e = 0; e < experts; ++e) dot += counts[e] * sums[e];
  const LD t = static_cast<LD>(z.size());
  return coef * static_cast<LD>(experts) / (static_cast<LD>(k) * t * t) * dot;
}

struct Scope {
  std::vector<std::vector<double>> z;
  router::ScopeSums sums;
  Scope(router::Score score, int tokens, int experts, int k, unsigned seed) : sums(static_cast<std::size_t>(experts)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 2.0);
    for (int t = 0; t < tokens; ++t) {
      std::vector<double> row(static_cast<std::size_t>(experts));
      for (double& v : row) v = normal(rng);
      std::vector<double> s(row.size());
      router::scores(score, row, s);
      sums.add(s, router::top_k(s, k));
      z.push_back(row);
    }
  }
  std::vector<std::vector<LD>> wide() const {
    std::vector<std::vector<LD>> out;
    for (const auto& row : z) out.emplace_back(row.begin(), row.end());
    return out;
  }
};

}  // namespace

TEST_CASE("router: scores, the routing map and its margin follow the definitions") {
  const std::vector<double> z = {0.5, 2.0, -1.0, 2.0, 0.0};
  std::vector<double> p(z.size()), q(z.size());
  router::scores(router::Score::softmax, z, p);
  router::scores(router::Score::sigmoid, z, q);
  double sp = 0.0, sq = 0.0;
  for (std::size_t e = 0; e < z.size(); ++e) sp += p[e], sq += q[e];
  CHECK(sp == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(sq == doctest::Approx(1.0).epsilon(1e-15));
  const router::TopK top = router::top_k(p, 2);
  CHECK(top.experts == std::vector<int>{1, 3});  // a tie goes to the lower index first
  CHECK(top.margin == doctest::Approx(p[3] - p[0]));
  CHECK(router::top_k(p, 1).margin == 0.0);  // experts 1 and 3 tie: either may be first
  CHECK(std::isinf(router::top_k(p, 5).margin));
}

TEST_CASE("router: the routed map keeps the best groups by their top keys, then the top-k keys among them") {
  // 8 experts in 4 groups of 2, top-2 over 2 groups: each group is scored by its best key.
  // keys:      g0 (0.9, 0.1)  g1 (0.5, 0.45)  g2 (0.8, 0.7)  g3 (0.2, 0.85)
  const std::vector<double> keys = {0.9, 0.1, 0.5, 0.45, 0.8, 0.7, 0.2, 0.85};
  const std::vector<double> magnitude(keys.size(), 1.0);
  router::TopK t = router::routed_top_k(keys, magnitude, {2, 4, 2}, 2);
  // group scores 0.9, 0.5, 0.8, 0.85: groups 0 and 3; their top-2 keys 0.9 (expert 0) and 0.85 (expert 7)
  CHECK(t.experts == std::vector<int>{0, 7});
  CHECK(t.next == 6);  // 0.2, the best key left in the selected groups; expert 4's 0.8 is outside them
  CHECK(t.margin == doctest::Approx(0.85 - 0.2));
  CHECK(t.group_margin == doctest::Approx(0.85 - 0.8));
  // With k = 4 over 2 groups each group is scored by the sum of its top 2 keys: 1.0, 0.95, 1.5, 1.05 -> groups 2 and
  // 3, so expert 0, the best key, is not routed (the plain top-4 is 0, 7, 4, 5).
  t = router::routed_top_k(keys, magnitude, {4, 4, 2}, 4);
  CHECK(t.experts == std::vector<int>{7, 4, 5, 6});
  CHECK(std::isinf(t.margin));  // the two groups hold exactly k experts
  CHECK(t.group_margin == doctest::Approx(1.05 - 1.0));
  CHECK(router::routed_top_k(keys, magnitude, {4, 4, 2}, 1).experts == std::vector<int>{7});  // first choice
  // One group: the plain top-k of the keys.
  t = router::routed_top_k(keys, magnitude, {3, 1, 1}, 3);
  CHECK(t.experts == std::vector<int>{0, 7, 4});
  CHECK(std::isinf(t.group_margin));
  // The bias: a fixed sequence in [-beta, beta], float32, zero for beta 0, first value beta (2 frac(phi) - 1).
  CHECK(router::expert_bias(0.5, 0, 0, 8) == static_cast<float>(0.5 * (2.0 * 0.6180339887498949 - 1.0)));
  CHECK(router::expert_bias(0.0, 3, 5, 8) == 0.0f);
  double lowest = 1.0, highest = -1.0;
  for (int j = 0; j < 4 * 64; ++j) {
    const double b = router::expert_bias(1.0, j / 64, j % 64, 64);
    lowest = std::min(lowest, b);
    highest = std::max(highest, b);
  }
  CHECK(lowest >= -1.0);
  CHECK(highest <= 1.0);
  CHECK(highest - lowest > 1.9);  // low-discrepancy: the range is covered
}

TEST_CASE("router: the aux loss is coef E sum_e f_e P_e, and each gradient is its loss's finite difference") {
  for (const router::Score score : {router::Score::softmax, router::Score::sigmoid}) {
    CAPTURE(static_cast<int>(score));
    const int experts = 8, k = 2;
    const double coef = 0.01;
    const Scope scope(score, 13, experts, k, 7);
    const double loss = router::aux_loss(scope.sums, coef, k);
    // f_e = c_e / (k T), P_e = S_e / T: the same number another way
    double fp = 0.0;
    for (int e = 0; e < experts; ++e) {
      fp += scope.sums.counts[static_cast<std::size_t>(e)] / (k * 13.0) *
            scope.sums.score_sums[static_cast<std::size_t>(e)] / 13.0;
    }
    CHECK(loss == doctest::Approx(coef * experts * fp).epsilon(1e-14));
    const std::vector<LD> counts(scope.sums.counts.begin(), scope.sums.counts.end());
    CHECK(static_cast<LD>(loss) ==
          doctest::Approx(static_cast<double>(aux_ld(score, scope.wide(), counts, coef, k))).epsilon(1e-14));
    const double scale = router::aux_scale(scope.sums, coef, k);
    for (std::size_t t : {std::size_t{0}, std::size_t{5}, std::size_t{12}}) {
      std::vector<double> grad(static_cast<std::size_t>(experts));
      router::aux_gradient(score, scope.z[t], scope.sums.counts, scale, grad);
      double row_sum = 0.0;
      for (std::size_t e = 0; e < grad.size(); ++e) {
        auto z = scope.wide();
        const LD h = 1e-6L;
        z[t][e] += h;
        const LD up = aux_ld(score, z, counts, coef, k);
        z[t][e] -= 2 * h;
        const LD down = aux_ld(score, z, counts, coef, k);
        CHECK(grad[e] == doctest::Approx(static_cast<double>((up - down) / (2 * h))).epsilon(1e-7));
        row_sum += grad[e];
      }
      if (score == router::Score::softmax) CHECK(std::fabs(row_sum) < 1e-15);  // softmax: sum_e dL/dz_e = 0
    }
  }
}

TEST_CASE("router: the z-loss and its gradient 2 w lse softmax") {
  const std::vector<double> z = {3.0, -2.0, 0.25, 7.5, 1.0, -0.5};
  const double w = 0.001 / 17.0;
  std::vector<double> grad(z.size());
  router::z_loss_gradient(z, w, grad);
  auto loss_ld = [&](const std::vector<LD>& x) {
    LD s = 0.0L;
    for (LD v : x) s += std::exp(v);
    const LD lse = std::log(s);
    return static_cast<LD>(w) * lse * lse;
  };
  const std::vector<LD> wide(z.begin(), z.end());
  CHECK(router::z_loss(z, w) == doctest::Approx(static_cast<double>(loss_ld(wide))).epsilon(1e-15));
  for (std::size_t e = 0; e < z.size(); ++e) {
    auto up = wide, down = wide;
    up[e] += 1e-6L;
    down[e] -= 1e-6L;
    CHECK(grad[e] == doctest::Approx(static_cast<double>((loss_ld(up) - loss_ld(down)) / 2e-6L)).epsilon(1e-7));
  }
}

}  // namespace lossverify
