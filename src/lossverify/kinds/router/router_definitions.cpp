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
  const auto kth = static_cast<std::size_t>(k);
  t.experts.assign(order.begin(), order.begin() + k);
  t.scale = s[static_cast<std::size_t>(order[kth - 1])];
  if (kth < s.size()) {
    t.next = order[kth];
    t.margin = t.scale - s[static_cast<std::size_t>(t.next)];
  } else {
    t.margin = std::numeric_limits<double>::infinity();
  }
  return t;
}

namespace {

// `members` in decreasing key order, ties to the lower index.
void sort_by_key(std::vector<int>& members, std::span<const double> keys) {
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return keys[static_cast<std::size_t>(a)] > keys[static_cast<std::size_t>(b)]; });
}

}  // namespace

TopK routed_top_k(std::span<const double> keys, std::span<const double> magnitude, const Grouping& g, int take) {
  const std::size_t experts = keys.size();
  const auto groups = static_cast<std::size_t>(g.groups);
  const std::size_t size = experts / groups;
  std::vector<int> candidates;
  TopK t;
  if (groups > 1) {
    const auto best = static_cast<std::size_t>(g.top_k / g.top_groups);  // the keys a group is scored by
    std::vector<double> score(groups, 0.0), scale(groups, 0.0);
    for (std::size_t q = 0; q < groups; ++q) {
      std::vector<int> members(size);
      std::iota(members.begin(), members.end(), static_cast<int>(q * size));
      sort_by_key(members, keys);
      for (std::size_t i = 0; i < best; ++i) {
        score[q] += keys[static_cast<std::size_t>(members[i])];
        scale[q] += magnitude[static_cast<std::size_t>(members[i])];
      }
    }
    std::vector<int> order(groups);
    std::iota(order.begin(), order.end(), 0);
    sort_by_key(order, score);
    const auto chosen = static_cast<std::size_t>(g.top_groups);
    if (chosen < groups) {
      const auto last = static_cast<std::size_t>(order[chosen - 1]), next = static_cast<std::size_t>(order[chosen]);
      t.group_margin = score[last] - score[next];
      t.group_scale = std::max(scale[last], scale[next]);
    }
    order.resize(chosen);
    std::sort(order.begin(), order.end());
    for (const int q : order) {
      for (std::size_t i = 0; i < size; ++i)
        candidates.push_back(static_cast<int>(static_cast<std::size_t>(q) * size + i));
    }
  } else {
    candidates.resize(experts);
    std::iota(candidates.begin(), candidates.end(), 0);
  }
  sort_by_key(candidates, keys);
  const auto kth = static_cast<std::size_t>(take);
  t.experts.assign(candidates.begin(), candidates.begin() + take);
  const auto last = static_cast<std::size_t>(t.experts.back());
  t.scale = magnitude[last];
  if (kth < candidates.size()) {
    t.next = candidates[kth];
    t.margin = keys[last] - keys[static_cast<std::size_t>(t.next)];
    t.scale = std::max(t.scale, magnitude[static_cast<std::size_t>(t.next)]);
  } else {
    t.margin = std::numeric_limits<double>::infinity();
  }
  return t;
}

void routing_scores(Score score, std::span<const double> z, std::span<double> out) {
  if (score == Score::softmax) {
    scores(score, z, out);
    return;
  }
  for (std::size_t e = 0; e < z.size(); ++e) out[e] = sigmoid(z[e]);
}

float expert_bias(double beta, std::int64_t layer, std::int64_t expert, std::int64_t experts) {
  constexpr double kPhi = 0.6180339887498949;  // (sqrt 5 - 1) / 2
  const double j = static_cast<double>(layer * experts + expert + 1);
  const double u = j * kPhi - std::floor(j * kPhi);
  return static_cast<float>(beta * (2.0 * u - 1.0));
}

void ScopeSums::add(std::span<const double> token_scores, const TopK& routed) {
  for (std::size_t e = 0; e < token_scores.size(); ++e) score_sums[e] += token_scores[e];
  for (int e : routed.experts) counts[static_cast<std::size_t>(e)] += 1.0;
  tokens += 1.0;
}

void ScopeSums::count(const TopK& routed) {
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
