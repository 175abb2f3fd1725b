#include "lossverify/reference/loss_reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

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

double LossReference::target_weight(bool on_label) const {
  // Target distribution q_v, straight from docs/spec.md §3.
  const double n = static_cast<double>(case_.shape.vocab);
  const double alpha = case_.loss.label_smoothing;
  const double hit = on_label ? 1.0 : 0.0;
  if (case_.loss.convention == SmoothingConvention::pytorch) return (1.0 - alpha) * hit + alpha / n;
  return (1.0 - alpha) * hit + alpha / (n - 1.0) * (1.0 - hit);
}

std::ptrdiff_t LossReference::label_in_slice(std::int64_t token, std::int64_t begin, std::size_t size) const {
  const std::int64_t label = inputs_.label(token);
  const bool inside = label >= begin && label - begin < static_cast<std::int64_t>(size);
  return inside ? static_cast<std::ptrdiff_t>(label - begin) : -1;
}

double LossReference::capped(double x) const {
  const double cap = case_.loss.softcap;
  return cap > 0.0 ? cap * std::tanh(x / cap) : x;
}

namespace {

// max and compensated sum exp(z * scale - max) of a slice
void log_sum_exp_partial(std::span<const double> z, double scale, double& max, double& sum, double& error) {
  max = row_sums::scaled_max(z, scale);
  std::tie(sum, error) = row_sums::sum_exp(z, scale, max);
}

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
  std::vector<double> capped_logits;
  std::span<const double> x = student;
  if (case_.loss.softcap > 0.0) {
    capped_logits.resize(student.size());
    for (std::size_t v = 0; v < x.size(); ++v) capped_logits[v] = capped(student[v]);
    x = capped_logits;
  }
  log_sum_exp_partial(x, 1.0, p.max, p.sum_exp, p.sum_exp_error);
  std::tie(p.sum_qx, p.sum_qx_error) =
      row_sums::weighted_sum(x, target_weight(false), target_weight(true), label_in_slice(token, begin, x.size()));
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
  row_sums::LaneSum kl;
  double log_p[row_sums::kBlock];
  double p[row_sums::kBlock];
  for (std::size_t b = 0; b < student.size(); b += row_sums::kBlock) {
    const std::size_t n = std::min(row_sums::kBlock, student.size() - b);
    for (std::size_t i = 0; i < n; ++i) log_p[i] = teacher[b + i] * inverse_t - s.teacher_lse;
    row_sums::exp_block(log_p, p, n);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = p[i] > 0.0 ? p[i] * (log_p[i] - (student[b + i] * inverse_t - s.lse)) : 0.0;
    }
    kl.add(p, n);
  }
  return kl.result();
}

double LossReference::kd_loss(double kl) const {
  return std::pow(case_.loss.temperature, case_.loss.t2_scaling ? 2.0 : 0.0) * kl;
}

void LossReference::gradient(std::int64_t token, const RowStats& s, std::int64_t begin, std::span<const double> student,
                             std::span<const double> teacher, std::span<double> grad) const {
  const double weight = token_weight(token);
  if (case_.loss.kind == LossKind::kd) {
    kd_gradient(s, weight, student, teacher, grad);
  } else if (case_.loss.softcap > 0.0) {
    capped_gradient(token, s, weight, begin, student, grad);
  } else {
    cross_entropy_gradient(token, s, weight, begin, student, grad);
  }
}

void LossReference::kd_gradient(const RowStats& s, double weight, std::span<const double> student,
                                std::span<const double> teacher, std::span<double> grad) const {
  // d L / d x_v = w T^(s-1) (Q_v - P_v)
  const double t = case_.loss.temperature;
  const double scale = weight * std::pow(t, (case_.loss.t2_scaling ? 2.0 : 0.0) - 1.0);
  double shifted[row_sums::kBlock];
  double q[row_sums::kBlock];
  double p[row_sums::kBlock];
  for (std::size_t b = 0; b < student.size(); b += row_sums::kBlock) {
    const std::size_t n = std::min(row_sums::kBlock, student.size() - b);
    for (std::size_t i = 0; i < n; ++i) shifted[i] = student[b + i] / t - s.lse;
    row_sums::exp_block(shifted, q, n);
    for (std::size_t i = 0; i < n; ++i) shifted[i] = teacher[b + i] / t - s.teacher_lse;
    row_sums::exp_block(shifted, p, n);
    for (std::size_t i = 0; i < n; ++i) grad[b + i] = scale * (q[i] - p[i]);
  }
}

void LossReference::cross_entropy_gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                                           std::span<const double> student, std::span<double> grad) const {
  // d L / d x_v = w (p_v (1 + 2 w_z lse) - q_v)
  const double z_factor = 1.0 + 2.0 * case_.loss.z_loss_weight * s.lse;
  const double off = target_weight(false);
  const std::ptrdiff_t label = label_in_slice(token, begin, student.size());
  double shifted[row_sums::kBlock];
  double p[row_sums::kBlock];
  for (std::size_t b = 0; b < student.size(); b += row_sums::kBlock) {
    const std::size_t n = std::min(row_sums::kBlock, student.size() - b);
    for (std::size_t i = 0; i < n; ++i) shifted[i] = student[b + i] - s.lse;
    row_sums::exp_block(shifted, p, n);
    for (std::size_t i = 0; i < n; ++i) grad[b + i] = weight * (p[i] * z_factor - off);
    if (label >= 0 && static_cast<std::size_t>(label) >= b && static_cast<std::size_t>(label) < b + n) {
      grad[static_cast<std::size_t>(label)] =
          weight * (p[static_cast<std::size_t>(label) - b] * z_factor - target_weight(true));
    }
  }
}

void LossReference::capped_gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                                    std::span<const double> student, std::span<double> grad) const {
  // Softcap c tanh(x / c): the chain rule's factor d/dx = sech^2(x / c) = 1 / cosh^2(x / c) on every column,
  // in that form because 1 - tanh^2 cancels to 0 once tanh rounds to 1 (|x / c| > 19). Scalar: rare.
  const double cap = case_.loss.softcap;
  const double z_factor = 1.0 + 2.0 * case_.loss.z_loss_weight * s.lse;
  const std::ptrdiff_t label = label_in_slice(token, begin, student.size());
  for (std::size_t v = 0; v < student.size(); ++v) {
    const double p = std::exp(capped(student[v]) - s.lse);
    const double ch = std::cosh(student[v] / cap);
    const double d = p * z_factor - target_weight(static_cast<std::ptrdiff_t>(v) == label);
    grad[v] = weight * (d / (ch * ch));
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
