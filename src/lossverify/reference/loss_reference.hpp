#pragma once
// Dense float64 reference of the global problem, written from the definitions of docs/spec.md §3 and nothing
// else: no shards, no packed sums, no shared math header. It is evaluated one token at a time from a
// whole row of logits, so no N x V float64 array ever exists. It knows nothing of rank layouts: token
// weights come from the global valid count, labels from the global sequences.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify {

struct ReferenceToken {
  bool valid = false;
  double lse = 0.0;     // log sum_v exp(x_v) (student logits / T for KD)
  double loss = 0.0;    // l_t (0 on masked tokens)
  double weight = 0.0;  // d L / d l_t: 1/N_v (mean), 1 (sum), g_t (none); 0 on masked tokens
};

// What one slice of a row's columns contributes to its reference statistics (float64, compensated sums
// as value + error pairs). Slices are added up in a fixed order, so every backend gets the same numbers.
struct RowPartial {
  double max = -std::numeric_limits<double>::infinity();  // student (x, or x/T for KD)
  double sum_exp = 0.0, sum_exp_error = 0.0;              // sum exp(z - max)
  double sum_qx = 0.0, sum_qx_error = 0.0;                // cross-entropy: sum q_v x_v
  double teacher_max = -std::numeric_limits<double>::infinity();
  double teacher_sum_exp = 0.0, teacher_sum_exp_error = 0.0;
  static constexpr int kDoubles = 8;
  void store(double* out) const {
    const double values[kDoubles] = {max,          sum_exp,     sum_exp_error,   sum_qx,
                                     sum_qx_error, teacher_max, teacher_sum_exp, teacher_sum_exp_error};
    for (int k = 0; k < kDoubles; ++k) out[k] = values[k];
  }
  static RowPartial load(const double* in) {
    return RowPartial{in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7]};
  }
};

// A row's reference statistics once every slice is in.
struct RowStats {
  double lse = 0.0;          // student log-sum-exp
  double teacher_lse = 0.0;  // KD
  double sum_qx = 0.0;       // cross-entropy
};

class LossReference {
 public:
  LossReference(const Case& c, const InputSource& inputs);

  bool needs_teacher() const { return case_.loss.kind == LossKind::kd; }
  std::int64_t valid_tokens() const { return valid_tokens_; }
  double token_weight(std::int64_t token) const;

  // Loss of token t and, into grad (V entries), d L / d x[t, :] of the global objective.
  // `teacher` is read for KD only.
  ReferenceToken evaluate(std::int64_t token, std::span<const double> student, std::span<const double> teacher,
                          std::span<double> grad) const;

  // L of reduction mean or sum from the per-token losses (compensated, in token order).
  double reduced_loss(std::span<const double> token_losses) const;

  // The same reference split over column slices [begin, begin + size) of a row, for verification that
  // runs where the columns live (each TP rank its own slice), with per-rank memory independent of the
  // number of slices:
  //   partial(slice) for every slice -> the row's maxima (the max over slices, exact) -> rescaled(partial,
  //   maxima) summed over the slices in slice order -> stats_from_sums(...) -> loss(...) and gradient(slice)
  // KD needs one more pass: kl_partial(slice) summed over slices, then kd_loss.
  RowPartial partial(std::int64_t token, std::int64_t begin, std::span<const double> student,
                     std::span<const double> teacher) const;
  // A slice's sums taken relative to the row's maxima (an empty slice contributes nothing).
  static RowPartial rescaled(const RowPartial& slice, double max, double teacher_max);
  // The row's statistics from the slices' rescaled sums, added up; `total.max` and `total.teacher_max` are
  // the row's maxima.
  RowStats stats_from_sums(const RowPartial& total) const;
  double cross_entropy_loss(const RowStats& stats) const;
  // sum over the slice of P_v (log P_v - log Q_v), compensated, as a value + error pair
  std::pair<double, double> kl_partial(const RowStats& stats, std::span<const double> student,
                                       std::span<const double> teacher) const;
  double kd_loss(double kl) const;
  // d L / d x of the slice's columns.
  void gradient(std::int64_t token, const RowStats& stats, std::int64_t begin, std::span<const double> student,
                std::span<const double> teacher, std::span<double> grad) const;

 private:
  double target_weight(bool on_label) const;  // q_v at the label's column or at any other
  // The label's index in the slice [begin, begin + size), or -1 when the slice does not hold it.
  std::ptrdiff_t label_in_slice(std::int64_t token, std::int64_t begin, std::size_t size) const;
  double capped(double x) const;
  void kd_gradient(const RowStats& stats, double weight, std::span<const double> student,
                   std::span<const double> teacher, std::span<double> grad) const;
  void cross_entropy_gradient(std::int64_t token, const RowStats& stats, double weight, std::int64_t begin,
                              std::span<const double> student, std::span<double> grad) const;
  void capped_gradient(std::int64_t token, const RowStats& stats, double weight, std::int64_t begin,
                       std::span<const double> student, std::span<double> grad) const;

  const Case& case_;
  const InputSource& inputs_;
  std::int64_t valid_tokens_ = 0;
  std::vector<char> valid_;
};

}  // namespace lossverify
