#include "lossverify/reference/loss_reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify {

LossReference::LossReference(const Case& c, const InputSource& inputs)
    : case_(c), inputs_(inputs), valid_(static_cast<std::size_t>(c.shape.tokens)) {
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    const bool v = inputs.is_valid(t);
    valid_[static_cast<std::size_t>(t)] = v;
    valid_tokens_ += v;
  }
}

double LossReference::token_weight(std::int64_t token) const {
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

ReferenceToken LossReference::evaluate(std::int64_t token, std::span<const double> student,
                                       std::span<const double> teacher, std::span<double> grad) const {
  if (!valid_[static_cast<std::size_t>(token)]) {
    std::fill(grad.begin(), grad.end(), 0.0);
    return ReferenceToken{};
  }
  return case_.loss.kind == LossKind::kd ? kd(token, student, teacher, grad) : cross_entropy(token, student, grad);
}

namespace {

// log sum_v exp(z_v), the maximum factored out, compensated.
double log_sum_exp(std::span<const double> z) {
  const double m = *std::max_element(z.begin(), z.end());
  CompensatedSum s;
  for (double v : z) s.add(std::exp(v - m));
  return m + std::log(s.value());
}

}  // namespace

ReferenceToken LossReference::cross_entropy(std::int64_t token, std::span<const double> raw,
                                            std::span<double> grad) const {
  const LossSpec& loss = case_.loss;
  const auto vocab = static_cast<std::int64_t>(raw.size());
  const double n = static_cast<double>(vocab);
  const std::int64_t label = inputs_.label(token);
  const double alpha = loss.label_smoothing;
  const double cap = loss.softcap;

  // Softcapped logits c tanh(x / c) replace x when the case asks for them.
  std::vector<double> capped;
  std::span<const double> x = raw;
  if (cap > 0.0) {
    capped.resize(raw.size());
    for (std::size_t v = 0; v < raw.size(); ++v) capped[v] = cap * std::tanh(raw[v] / cap);
    x = capped;
  }

  // Target distribution q_v, straight from SPEC 3.
  auto q = [&](std::int64_t v) {
    const double hit = (v == label) ? 1.0 : 0.0;
    if (loss.convention == SmoothingConvention::pytorch) return (1.0 - alpha) * hit + alpha / n;
    return (1.0 - alpha) * hit + alpha / (n - 1.0) * (1.0 - hit);
  };

  ReferenceToken r;
  r.valid = true;
  r.lse = log_sum_exp(x);
  CompensatedSum sum_qx;
  for (std::int64_t v = 0; v < vocab; ++v) sum_qx.add(q(v) * x[static_cast<std::size_t>(v)]);
  r.loss = r.lse - sum_qx.value() + loss.z_loss_weight * r.lse * r.lse;
  r.weight = token_weight(token);

  const double z_factor = 1.0 + 2.0 * loss.z_loss_weight * r.lse;
  for (std::int64_t v = 0; v < vocab; ++v) {
    const auto k = static_cast<std::size_t>(v);
    const double p = std::exp(x[k] - r.lse);
    double d = p * z_factor - q(v);
    if (cap > 0.0) {
      const double t = std::tanh(raw[k] / cap);
      d *= 1.0 - t * t;
    }
    grad[k] = r.weight * d;
  }
  return r;
}

ReferenceToken LossReference::kd(std::int64_t token, std::span<const double> x, std::span<const double> y,
                                 std::span<double> grad) const {
  const LossSpec& loss = case_.loss;
  const double t = loss.temperature;
  const double s = loss.t2_scaling ? 2.0 : 0.0;
  std::vector<double> a(x.size());
  std::vector<double> b(y.size());
  for (std::size_t v = 0; v < x.size(); ++v) {
    a[v] = x[v] / t;
    b[v] = y[v] / t;
  }
  ReferenceToken r;
  r.valid = true;
  r.lse = log_sum_exp(a);
  const double lse_teacher = log_sum_exp(b);
  // k = T^s sum_v P_v (log P_v - log Q_v); terms with P_v = 0 contribute 0.
  CompensatedSum kl;
  for (std::size_t v = 0; v < a.size(); ++v) {
    const double log_p = b[v] - lse_teacher;
    const double p = std::exp(log_p);
    if (p > 0.0) kl.add(p * (log_p - (a[v] - r.lse)));
  }
  r.loss = std::pow(t, s) * kl.value();
  r.weight = token_weight(token);
  const double scale = r.weight * std::pow(t, s - 1.0);
  for (std::size_t v = 0; v < a.size(); ++v) {
    grad[v] = scale * (std::exp(a[v] - r.lse) - std::exp(b[v] - lse_teacher));
  }
  return r;
}

double LossReference::reduced_loss(std::span<const double> token_losses) const {
  CompensatedSum total;
  for (std::size_t t = 0; t < token_losses.size(); ++t) {
    total.add(token_weight(static_cast<std::int64_t>(t)) * token_losses[t]);
  }
  return total.value();
}

}  // namespace lossverify
