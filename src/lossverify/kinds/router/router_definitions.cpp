#include "lossverify/kinds/router/router_definitions.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify::router {

namespace {

double max_of(std::span<const double> z) { return *std::max_element(z.begin(), z.end()); }

double sigmoid(double x) { return x >= 0.0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x)); }

}  // namespace

double logsumexp(std::span<const double> z) {
  const double m = max_of(z);
  CompensatedSum sum;
  for (double v : z) sum.add(std::exp(v - m));
  return m + std::log(sum.value());
}

void scores(Score score, std::span<const double> z, std::span<double> out) {
  if (score == Score::softmax) {
    const double lse = logsumexp(z);
    for (std::size_t e = 0; e < z.size(); ++e) out[e] = std::exp(z[e] - lse);
    return;
  }
  CompensatedSum total;
  for (std::size_t e = 0; e < z.size(); ++e) total.add(out[e] = sigmoid(z[e]));
  for (std::size_t e = 0; e < z.size(); ++e) out[e] /= total.value();
}

TopK top_k(std::span<const double> s, int k) {
  std::vector<int> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return s[static_cast<std::size_t>(a)] > s[static_cast<std::size_t>(b)]; });
  TopK t;
  t.experts.assign(order.begin(), order.begin() + k);
  if (static_cast<std::size_t>(k) < s.size()) t.next = order[static_cast<std::size_t>(k)];
  t.margin = static_cast<std::size_t>(k) < s.size()
                 ? s[static_cast<std::size_t>(order[static_cast<std::size_t>(k - 1)])] -
                       s[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])]
                 : std::numeric_limits<double>::infinity();
  return t;
}

void ScopeSums::add(std::span<const double> token_scores, const TopK& routed) {
  for (std::size_t e = 0; e < token_scores.size(); ++e) score_sums[e] += token_scores[e];
  for (int e : routed.experts) counts[static_cast<std::size_t>(e)] += 1.0;
  tokens += 1.0;
}

void ScopeSums::add_tie(const TopK& routed) {
  ties[static_cast<std::size_t>(routed.experts.back())] += 1.0;
  ties[static_cast<std::size_t>(routed.next)] += 1.0;
}

void ScopeSums::merge(const ScopeSums& other) {
  for (std::size_t e = 0; e < counts.size(); ++e) {
    counts[e] += other.counts[e];
    ties[e] += other.ties[e];
  }
  tokens += other.tokens;
}

double aux_scale(const ScopeSums& scope, double coef, double k) {
  if (scope.tokens == 0.0) return 0.0;
  return coef * static_cast<double>(scope.counts.size()) / (k * scope.tokens * scope.tokens);
}

double aux_loss(const ScopeSums& scope, double coef, double k) {
  CompensatedSum sum;
  for (std::size_t e = 0; e < scope.counts.size(); ++e) sum.add(scope.counts[e] * scope.score_sums[e]);
  return aux_scale(scope, coef, k) * sum.value();
}

void aux_gradient(Score score, std::span<const double> z, std::span<const double> counts, double scale,
                  std::span<double> grad) {
  std::vector<double> s(z.size());
  scores(score, z, s);
  CompensatedSum inner;
  for (std::size_t e = 0; e < z.size(); ++e) inner.add(s[e] * counts[e]);
  for (std::size_t e = 0; e < z.size(); ++e) {
    const double slope = score == Score::softmax ? 1.0 : 1.0 - sigmoid(z[e]);
    grad[e] = scale * s[e] * slope * (counts[e] - inner.value());
  }
}

double z_loss(std::span<const double> z, double weight) {
  const double lse = logsumexp(z);
  return weight * lse * lse;
}

void z_loss_gradient(std::span<const double> z, double weight, std::span<double> grad) {
  const double lse = logsumexp(z);
  for (std::size_t e = 0; e < z.size(); ++e) grad[e] = 2.0 * weight * lse * std::exp(z[e] - lse);
}

}  // namespace lossverify::router
