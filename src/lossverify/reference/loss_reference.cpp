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

double LossReference::target_weight(std::int64_t label, std::int64_t column) const {
  // Target distribution q_v, straight from docs/spec.md §3.
  const double n = static_cast<double>(case_.shape.vocab);
  const double alpha = case_.loss.label_smoothing;
  const double hit = (column == label) ? 1.0 : 0.0;
  if (case_.loss.convention == SmoothingConvention::pytorch) return (1.0 - alpha) * hit + alpha / n;
  return (1.0 - alpha) * hit + alpha / (n - 1.0) * (1.0 - hit);
}

double LossReference::capped(double x) const {
  const double cap = case_.loss.softcap;
  return cap > 0.0 ? cap * std::tanh(x / cap) : x;
}

namespace {

// max and compensated sum exp(z - max) of a slice
void log_sum_exp_partial(std::span<const double> z, double scale, double& max, double& sum, double& error) {
  max = -std::numeric_limits<double>::infinity();
  for (double v : z) max = std::max(max, v * scale);
  CompensatedSum s;
  for (double v : z) s.add(std::exp(v * scale - max));
  sum = s.sum();
  error = s.error();
}

// Combines (max_r, sum_r) slices in order: log sum_r sum_r exp(max_r - M) + M.
}  // namespace

RowPartial LossReference::partial(std::int64_t token, std::int64_t begin, std::span<const double> student,
                                  std::span<const double> teacher) const {
  RowPartial p;
  if (case_.loss.kind == LossKind::kd) {
    const double inverse_t = 1.0 / case_.loss.temperature;
    log_sum_exp_partial(student, inverse_t, p.max, p.sum_exp, p.sum_exp_error);
    log_sum_exp_partial(teacher, inverse_t, p.teacher_max, p.teacher_sum_exp, p.teacher_sum_exp_error);
    return p;
  }
  std::vector<double> x(student.size());
  for (std::size_t v = 0; v < x.size(); ++v) x[v] = capped(student[v]);
  log_sum_exp_partial(x, 1.0, p.max, p.sum_exp, p.sum_exp_error);
  const std::int64_t label = inputs_.label(token);
  CompensatedSum qx;
  for (std::size_t v = 0; v < x.size(); ++v) qx.add(target_weight(label, begin + static_cast<std::int64_t>(v)) * x[v]);
  p.sum_qx = qx.sum();
  p.sum_qx_error = qx.error();
  return p;
}

RowPartial LossReference::rescaled(const RowPartial& slice, double max, double teacher_max) {
  // exp(0) = 1 exactly: the common case (the slice holds the max) needs no exp.
  auto factor = [](double slice_max, double row_max) {
    if (slice_max == -std::numeric_limits<double>::infinity()) return 0.0;  // an empty slice
    return slice_max == row_max ? 1.0 : std::exp(slice_max - row_max);
  };
  const double f = factor(slice.max, max);
  const double g = factor(slice.teacher_max, teacher_max);
  RowPartial r = slice;
  r.max = max;
  r.teacher_max = teacher_max;
  r.sum_exp = slice.sum_exp * f;
  r.sum_exp_error = slice.sum_exp_error * f;
  r.teacher_sum_exp = slice.teacher_sum_exp * g;
  r.teacher_sum_exp_error = slice.teacher_sum_exp_error * g;
  return r;
}

RowStats LossReference::stats_from_sums(const RowPartial& total) const {
  auto log_sum_exp = [](double max, double sum, double error) {
    CompensatedSum s;
    s.add(sum);
    s.add(error);
    return max + std::log(s.value());
  };
  RowStats r;
  r.lse = log_sum_exp(total.max, total.sum_exp, total.sum_exp_error);
  if (case_.loss.kind == LossKind::kd) {
    r.teacher_lse = log_sum_exp(total.teacher_max, total.teacher_sum_exp, total.teacher_sum_exp_error);
    return r;
  }
  CompensatedSum qx;
  qx.add(total.sum_qx);
  qx.add(total.sum_qx_error);
  r.sum_qx = qx.value();
  return r;
}

double LossReference::cross_entropy_loss(const RowStats& s) const {
  return s.lse - s.sum_qx + case_.loss.z_loss_weight * s.lse * s.lse;
}

std::pair<double, double> LossReference::kl_partial(const RowStats& s, std::span<const double> student,
                                                    std::span<const double> teacher) const {
  // k = T^s sum_v P_v (log P_v - log Q_v); terms with P_v = 0 contribute 0.
  const double inverse_t = 1.0 / case_.loss.temperature;
  CompensatedSum kl;
  for (std::size_t v = 0; v < student.size(); ++v) {
    const double log_p = teacher[v] * inverse_t - s.teacher_lse;
    const double p = std::exp(log_p);
    if (p > 0.0) kl.add(p * (log_p - (student[v] * inverse_t - s.lse)));
  }
  return {kl.sum(), kl.error()};
}

double LossReference::kd_loss(double kl) const {
  return std::pow(case_.loss.temperature, case_.loss.t2_scaling ? 2.0 : 0.0) * kl;
}

void LossReference::gradient(std::int64_t token, const RowStats& s, std::int64_t begin, std::span<const double> student,
                             std::span<const double> teacher, std::span<double> grad) const {
  const double weight = token_weight(token);
  if (case_.loss.kind == LossKind::kd) {
    const double t = case_.loss.temperature;
    const double scale = weight * std::pow(t, (case_.loss.t2_scaling ? 2.0 : 0.0) - 1.0);
    for (std::size_t v = 0; v < student.size(); ++v) {
      grad[v] = scale * (std::exp(student[v] / t - s.lse) - std::exp(teacher[v] / t - s.teacher_lse));
    }
    return;
  }
  const std::int64_t label = inputs_.label(token);
  const double cap = case_.loss.softcap;
  const double z_factor = 1.0 + 2.0 * case_.loss.z_loss_weight * s.lse;
  for (std::size_t v = 0; v < student.size(); ++v) {
    const double p = std::exp(capped(student[v]) - s.lse);
    double d = p * z_factor - target_weight(label, begin + static_cast<std::int64_t>(v));
    if (cap > 0.0) {
      const double th = std::tanh(student[v] / cap);
      d *= 1.0 - th * th;
    }
    grad[v] = weight * d;
  }
}

ReferenceToken LossReference::evaluate(std::int64_t token, std::span<const double> student,
                                       std::span<const double> teacher, std::span<double> grad) const {
  if (!valid_[static_cast<std::size_t>(token)]) {
    std::fill(grad.begin(), grad.end(), 0.0);
    return ReferenceToken{};
  }
  // The whole row as one slice.
  const RowPartial p = partial(token, 0, student, teacher);
  const RowStats s = stats_from_sums(rescaled(p, p.max, p.teacher_max));
  ReferenceToken r;
  r.valid = true;
  r.lse = s.lse;
  r.weight = token_weight(token);
  if (case_.loss.kind == LossKind::kd) {
    const auto [kl, error] = kl_partial(s, student, teacher);
    r.loss = kd_loss(kl + error);
  } else {
    r.loss = cross_entropy_loss(s);
  }
  gradient(token, s, 0, student, teacher, grad);
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
