#include "lossverify/reference/cross_entropy_reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify {

CrossEntropyReference::CrossEntropyReference(const Case& c, const InputSource& inputs)
    : case_(c), inputs_(inputs), valid_(static_cast<std::size_t>(c.shape.tokens)) {
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    const bool v = inputs.label(t) != c.loss.ignore_index;
    valid_[static_cast<std::size_t>(t)] = v;
    valid_tokens_ += v;
  }
}

double CrossEntropyReference::token_weight(std::int64_t token) const {
  if (!valid_[static_cast<std::size_t>(token)]) return 0.0;
  switch (case_.loss.reduction) {
    case Reduction::mean:
      return 1.0 / static_cast<double>(valid_tokens_);
    case Reduction::sum:
      return 1.0;
    case Reduction::none:
      return inputs_.upstream_weight(token);
  }
  return 0.0;
}

ReferenceToken CrossEntropyReference::evaluate(std::int64_t token, std::span<const double> x,
                                               std::span<double> grad) const {
  ReferenceToken r;
  r.valid = valid_[static_cast<std::size_t>(token)] != 0;
  if (!r.valid) {
    std::fill(grad.begin(), grad.end(), 0.0);
    return r;
  }
  const LossSpec& loss = case_.loss;
  const auto vocab = static_cast<std::int64_t>(x.size());
  const double n = static_cast<double>(vocab);
  const std::int64_t label = inputs_.label(token);
  const double alpha = loss.label_smoothing;

  // Target distribution q_v, straight from SPEC 3.
  auto q = [&](std::int64_t v) {
    const double hit = (v == label) ? 1.0 : 0.0;
    if (loss.convention == SmoothingConvention::pytorch) return (1.0 - alpha) * hit + alpha / n;
    return (1.0 - alpha) * hit + alpha / (n - 1.0) * (1.0 - hit);
  };

  // lse with the row maximum factored out; compensated sums throughout.
  const double m = *std::max_element(x.begin(), x.end());
  CompensatedSum sum_exp;
  CompensatedSum sum_qx;
  for (std::int64_t v = 0; v < vocab; ++v) {
    sum_exp.add(std::exp(x[static_cast<std::size_t>(v)] - m));
    sum_qx.add(q(v) * x[static_cast<std::size_t>(v)]);
  }
  r.lse = m + std::log(sum_exp.value());
  r.loss = r.lse - sum_qx.value() + loss.z_loss_weight * r.lse * r.lse;
  r.weight = token_weight(token);

  const double z_factor = 1.0 + 2.0 * loss.z_loss_weight * r.lse;
  for (std::int64_t v = 0; v < vocab; ++v) {
    const double p = std::exp(x[static_cast<std::size_t>(v)] - r.lse);
    grad[static_cast<std::size_t>(v)] = r.weight * (p * z_factor - q(v));
  }
  return r;
}

double CrossEntropyReference::reduced_loss(std::span<const double> token_losses) const {
  CompensatedSum total;
  for (std::size_t t = 0; t < token_losses.size(); ++t) {
    total.add(token_weight(static_cast<std::int64_t>(t)) * token_losses[t]);
  }
  return total.value();
}

}  // namespace lossverify
