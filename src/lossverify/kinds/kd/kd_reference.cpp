// KD's float64 reference of one row, from the definitions of docs/spec.md §3: with a = x / T and b = y / T,
// P = softmax(b), Q = softmax(a), the loss T^s sum_v P_v (log P_v - log Q_v) and the gradient
// T^(s-1) (Q - P). It shares nothing with the sharded kernels' math header.
#include "lossverify/kinds/kd/kd_parts.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "lossverify/case/case.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

namespace lossverify {

namespace {

double log_sum_exp(double max, double sum, double error) {
  CompensatedSum s;
  s.add(sum);
  s.add(error);
  return max + std::log(s.value());
}

class KdReference final : public KindReference {
 public:
  explicit KdReference(const Case& c) : case_(c) {}

  RowPartial partial(std::int64_t token, std::int64_t begin, std::span<const double> student,
                     std::span<const double> teacher) const override {
    (void)token, (void)begin;
    RowPartial p;
    const double inverse_t = 1.0 / kd_options(case_.loss).temperature;
    p.max = row_sums::scaled_max(student, inverse_t);
    std::tie(p.sum_exp, p.sum_exp_error) = row_sums::sum_exp(student, inverse_t, p.max);
    p.teacher_max = row_sums::scaled_max(teacher, inverse_t);
    std::tie(p.teacher_sum_exp, p.teacher_sum_exp_error) = row_sums::sum_exp(teacher, inverse_t, p.teacher_max);
    return p;
  }

  RowStats stats(const RowPartial& total) const override {
    RowStats r;
    r.lse = log_sum_exp(total.max, total.sum_exp, total.sum_exp_error);
    r.teacher_lse = log_sum_exp(total.teacher_max, total.teacher_sum_exp, total.teacher_sum_exp_error);
    return r;
  }

  bool needs_value_pass() const override { return true; }

  // sum over the slice of P_v (log P_v - log Q_v), compensated; terms with P_v = 0 contribute 0.
  std::pair<double, double> value_partial(std::int64_t, const RowStats& s, std::span<const double> student,
                                          std::span<const double> teacher) const override {
    const double inverse_t = 1.0 / kd_options(case_.loss).temperature;
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

  double token_loss(std::int64_t token, const RowStats& s) const override {
    (void)token;
    return std::pow(kd_options(case_.loss).temperature, kd_options(case_.loss).t2_scaling ? 2.0 : 0.0) *
           s.value;  // s.value: the KL
  }

  // d L / d x_v = w T^(s-1) (Q_v - P_v)
  void gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                std::span<const double> student, std::span<const double> teacher,
                std::span<double> grad) const override {
    (void)token, (void)begin;
    const double t = kd_options(case_.loss).temperature;
    const double scale = weight * std::pow(t, (kd_options(case_.loss).t2_scaling ? 2.0 : 0.0) - 1.0);
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

  // Student logits within `error` of these (an LM head in front; the teacher's are the case's own): x / T moves by at
  // most e / T, so each log Q_v by 2 e / T and the loss T^s sum P (log P - log Q) by T^s 2 e / T (P sums to 1);
  // Q_v by at most Q_v (exp(2 e / T) - 1), and so the gradient w T^(s-1) (Q_v - P_v).
  std::optional<double> loss_under_logit_error(std::int64_t, const RowStats&, double error) const override {
    const double t = kd_options(case_.loss).temperature;
    return std::pow(t, kd_options(case_.loss).t2_scaling ? 2.0 : 0.0) * 2.0 * error / t;
  }
  bool gradient_under_logit_error(std::int64_t, const RowStats& s, double weight, double error, std::int64_t,
                                  std::span<const double> student, std::span<double> out) const override {
    const double t = kd_options(case_.loss).temperature;
    const double scale = std::fabs(weight) * std::pow(t, (kd_options(case_.loss).t2_scaling ? 2.0 : 0.0) - 1.0);
    const double grow = std::expm1(2.0 * error / t);
    for (std::size_t v = 0; v < student.size(); ++v) out[v] = scale * std::exp(student[v] / t - s.lse) * grow;
    return true;
  }

  // sum_v (Q_v - P_v) = 0.
  std::optional<double> gradient_row_sum(const RowStats& s, double weight) const override {
    (void)s, (void)weight;
    return 0.0;
  }

 private:
  const Case& case_;
};

}  // namespace

std::unique_ptr<KindReference> make_kd_reference(const Case& c) { return std::make_unique<KdReference>(c); }

}  // namespace lossverify
