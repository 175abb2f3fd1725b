#pragma once
// What one slice of a row's columns contributes to the row's float64 reference statistics, and the
// statistics once every slice is in. The layout is the same for every loss kind: two softmax channels,
// each a maximum and a compensated sum of exp(z - max) that is rescaled to the row's maximum of that
// channel, and one plain compensated sum that is added as it is. A kind fills what it needs (cross-
// entropy: channel 0 over x and the plain sum_v q_v x_v; KD: channel 0 over x / T, channel 1 over y / T).
// Slices are added up in a fixed order, so every backend and oracle gets the same numbers.
#include <cmath>
#include <limits>

namespace lossverify {

struct RowPartial {
  double max = -std::numeric_limits<double>::infinity();          // channel 0
  double sum_exp = 0.0, sum_exp_error = 0.0;                      // channel 0: sum exp(z - max)
  double sum_qx = 0.0, sum_qx_error = 0.0;                        // the plain sum
  double teacher_max = -std::numeric_limits<double>::infinity();  // channel 1
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
  // The slice's sums taken relative to the row's maxima (an empty slice contributes nothing; exp(0) = 1
  // exactly, so the slice holding the max needs no exp).
  static RowPartial rescaled(const RowPartial& slice, double row_max, double row_teacher_max) {
    auto factor = [](double slice_max, double max) {
      if (slice_max == -std::numeric_limits<double>::infinity()) return 0.0;
      return slice_max == max ? 1.0 : std::exp(slice_max - max);
    };
    const double f = factor(slice.max, row_max);
    const double g = factor(slice.teacher_max, row_teacher_max);
    RowPartial r = slice;
    r.max = row_max;
    r.teacher_max = row_teacher_max;
    r.sum_exp = slice.sum_exp * f;
    r.sum_exp_error = slice.sum_exp_error * f;
    r.teacher_sum_exp = slice.teacher_sum_exp * g;
    r.teacher_sum_exp_error = slice.teacher_sum_exp_error * g;
    return r;
  }
};

// A row's reference statistics once every slice is in: channel 0's log-sum-exp, channel 1's, and the
// plain sum (each kind gives them their meaning).
struct RowStats {
  double lse = 0.0;
  double teacher_lse = 0.0;
  double sum_qx = 0.0;
  double value = 0.0;  // the second pass summed over the slices (KindReference::needs_value_pass), else 0
  int branch = 0;      // which admissible reading of the token to evaluate (KindReference::branches); 0: the own
};

}  // namespace lossverify
