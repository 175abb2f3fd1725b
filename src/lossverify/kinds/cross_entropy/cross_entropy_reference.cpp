// Cross-entropy's float64 reference of one row, from the definitions of docs/spec.md §3: the target
// distribution q (label smoothing, either convention), the z-loss, the softcap c tanh(x / c). It shares
// nothing with the sharded kernels' math header.
#include "lossverify/kinds/cross_entropy/cross_entropy_parts.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

namespace lossverify {

// Target distribution q_v, straight from docs/spec.md §3.
TargetWeights cross_entropy_target_weights(const Case& c) {
  const double n = static_cast<double>(c.shape.vocab);
  const double alpha = cross_entropy_options(c.loss).label_smoothing;
  auto q = [&](double hit) {
    if (cross_entropy_options(c.loss).convention == SmoothingConvention::pytorch)
      return (1.0 - alpha) * hit + alpha / n;
    return (1.0 - alpha) * hit + alpha / (n - 1.0) * (1.0 - hit);
  };
  return {q(1.0), q(0.0)};
}

namespace {

class CrossEntropyReference final : public KindReference {
 public:
  CrossEntropyReference(const Case& c, const InputSource& inputs)
      : case_(c), inputs_(inputs), q_(cross_entropy_target_weights(c)) {}

  RowPartial partial(std::int64_t token, std::int64_t begin, std::span<const double> logits,
                     std::span<const double> teacher) const override {
    (void)teacher;
    RowPartial p;
    std::vector<double> capped_logits;
    std::span<const double> x = logits;
    if (cross_entropy_options(case_.loss).softcap > 0.0) {
      capped_logits.resize(logits.size());
      for (std::size_t v = 0; v < x.size(); ++v) capped_logits[v] = capped(logits[v]);
      x = capped_logits;
    }
    p.max = row_sums::scaled_max(x, 1.0);
    std::tie(p.sum_exp, p.sum_exp_error) = row_sums::sum_exp(x, 1.0, p.max);
    std::tie(p.sum_qx, p.sum_qx_error) =
        row_sums::weighted_sum(x, target_weight(false), target_weight(true), label_in_slice(token, begin, x.size()));
    return p;
  }

  RowStats stats(const RowPartial& total) const override {
    RowStats r;
    CompensatedSum s;
    s.add(total.sum_exp);
    s.add(total.sum_exp_error);
    r.lse = total.max + std::log(s.value());
    CompensatedSum qx;
    qx.add(total.sum_qx);
    qx.add(total.sum_qx_error);
    r.sum_qx = qx.value();
    return r;
  }

  // l = lse - sum_v q_v x_v + w_z lse^2
  double token_loss(std::int64_t token, const RowStats& s) const override {
    (void)token;
    return s.lse - s.sum_qx + cross_entropy_options(case_.loss).z_loss_weight * s.lse * s.lse;
  }

  void gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                std::span<const double> logits, std::span<const double> teacher,
                std::span<double> grad) const override {
    (void)teacher;
    if (cross_entropy_options(case_.loss).softcap > 0.0) {
      capped_gradient(token, s, weight, begin, logits, grad);
    } else {
      plain_gradient(token, s, weight, begin, logits, grad);
    }
  }

  // sum_v d l / d x_v = sum_v p_v (1 + 2 w_z lse) - sum_v q_v = 2 w_z lse; the softcap's factor breaks it.
  std::optional<double> gradient_row_sum(const RowStats& s, double weight) const override {
    if (cross_entropy_options(case_.loss).softcap != 0.0) return std::nullopt;
    return weight * 2.0 * cross_entropy_options(case_.loss).z_loss_weight * s.lse;
  }

 private:
  double target_weight(bool on_label) const { return on_label ? q_.on : q_.off; }

  // Logits within `error` of these (an LM head in front): lse and the target term each move by at most error (both
  // 1-Lipschitz in the max norm, q summing to 1), the z-loss's lse^2 by 2 |lse| error + error^2.
  std::optional<double> loss_under_logit_error(std::int64_t, const RowStats& s, double error) const override {
    const double zw = cross_entropy_options(case_.loss).z_loss_weight;
    return 2.0 * error + zw * (2.0 * std::fabs(s.lse) * error + error * error);
  }

  // g_v = w A_v c'_v with A_v = p_v (1 + 2 w_z lse) - q_v and c'_v the softcap's sech^2(x_v / c) (1 without one).
  // With every logit within e (the softcap is 1-Lipschitz): p_v moves by at most dp = min(p_v, 1 - p_v) (exp(2e) - 1)
  // (p_v = 1 / (1 + S) and 1 - p_v = S / (1 + S) with S = sum_{u != v} exp(x_u - x_v), and S moves by a factor within
  // exp(+-2e): a confident row's 1 - p_y moves in proportion to itself) and lse by e,
  // so A_v by dp |1 + 2 w_z lse| + (p_v + dp) 2 w_z e; c'_v by at most 0.7699 e / c (the largest magnitude of its
  // derivative, 4 / (3 sqrt 3) / c).
  bool gradient_under_logit_error(std::int64_t token, const RowStats& s, double weight, double error,
                                  std::int64_t begin, std::span<const double> logits,
                                  std::span<double> out) const override {
    const double cap = cross_entropy_options(case_.loss).softcap;
    const double zw = cross_entropy_options(case_.loss).z_loss_weight;
    const double z_factor = 1.0 + 2.0 * zw * s.lse;
    const double grow = std::expm1(2.0 * error);
    const double cap_move = cap > 0.0 ? 0.7699 * error / cap : 0.0;
    const std::ptrdiff_t label = label_in_slice(token, begin, logits.size());
    for (std::size_t v = 0; v < logits.size(); ++v) {
      const double p = std::exp(capped(logits[v]) - s.lse);
      const double dp = std::min(p, 1.0 - p + 0x1p-50) * grow;  // 1 - p to within the rounding of p
      const double a = p * z_factor - target_weight(static_cast<std::ptrdiff_t>(v) == label);
      const double da = dp * std::fabs(z_factor) + (p + dp) * 2.0 * zw * error;
      double factor = 1.0;
      if (cap > 0.0) {
        const double ch = std::cosh(logits[v] / cap);
        factor = 1.0 / (ch * ch);
      }
      out[v] = std::fabs(weight) * (da * (factor + cap_move) + std::fabs(a) * cap_move);
    }
    return true;
  }

  // The label's index in the slice [begin, begin + size), or -1 when the slice does not hold it.
  std::ptrdiff_t label_in_slice(std::int64_t token, std::int64_t begin, std::size_t size) const {
    const std::int64_t label = inputs_.label(token);
    const bool inside = label >= begin && label - begin < static_cast<std::int64_t>(size);
    return inside ? static_cast<std::ptrdiff_t>(label - begin) : -1;
  }

  double capped(double x) const {
    const double cap = cross_entropy_options(case_.loss).softcap;
    return cap > 0.0 ? cap * std::tanh(x / cap) : x;
  }

  // d L / d x_v = w (p_v (1 + 2 w_z lse) - q_v)
  void plain_gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                      std::span<const double> logits, std::span<double> grad) const {
    const double z_factor = 1.0 + 2.0 * cross_entropy_options(case_.loss).z_loss_weight * s.lse;
    const double off = target_weight(false);
    const std::ptrdiff_t label = label_in_slice(token, begin, logits.size());
    double shifted[row_sums::kBlock];
    double p[row_sums::kBlock];
    for (std::size_t b = 0; b < logits.size(); b += row_sums::kBlock) {
      const std::size_t n = std::min(row_sums::kBlock, logits.size() - b);
      for (std::size_t i = 0; i < n; ++i) shifted[i] = logits[b + i] - s.lse;
      row_sums::exp_block(shifted, p, n);
      for (std::size_t i = 0; i < n; ++i) grad[b + i] = weight * (p[i] * z_factor - off);
      if (label >= 0 && static_cast<std::size_t>(label) >= b && static_cast<std::size_t>(label) < b + n) {
        grad[static_cast<std::size_t>(label)] =
            weight * (p[static_cast<std::size_t>(label) - b] * z_factor - target_weight(true));
      }
    }
  }

  // Softcap c tanh(x / c): the chain rule's factor d/dx = sech^2(x / c) = 1 / cosh^2(x / c) on every column,
  // in that form because 1 - tanh^2 cancels to 0 once tanh rounds to 1 (|x / c| > 19). Scalar: rare.
  void capped_gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                       std::span<const double> logits, std::span<double> grad) const {
    const double cap = cross_entropy_options(case_.loss).softcap;
    const double z_factor = 1.0 + 2.0 * cross_entropy_options(case_.loss).z_loss_weight * s.lse;
    const std::ptrdiff_t label = label_in_slice(token, begin, logits.size());
    for (std::size_t v = 0; v < logits.size(); ++v) {
      const double p = std::exp(capped(logits[v]) - s.lse);
      const double ch = std::cosh(logits[v] / cap);
      const double d = p * z_factor - target_weight(static_cast<std::ptrdiff_t>(v) == label);
      grad[v] = weight * (d / (ch * ch));
    }
  }

  const Case& case_;
  const InputSource& inputs_;
  const TargetWeights q_;
};

}  // namespace

std::unique_ptr<KindReference> make_cross_entropy_reference(const Case& c, const InputSource& inputs) {
  return std::make_unique<CrossEntropyReference>(c, inputs);
}

}  // namespace lossverify
