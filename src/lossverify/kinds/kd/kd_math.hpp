#pragma once
// Per-row KD math of docs/spec.md §3, written once for the CPU and CUDA kernels. With a = x/T (student) and
// b = y/T (teacher), P = softmax(b), Q = softmax(a):
//   KL(P || Q) = sum_v P_v (b_v - a_v) - lse_b + lse_a
//              = W / S_b + (M_a - M_b) + log(S_a / S_b),   W = sum_v exp(b_v - M_b)(b_v - a_v)
// so no log(P) or log(Q) is ever taken, the large lse values never meet in a subtraction, and
// student = teacher gives W = 0 and KL = 0 exactly.
#include <cmath>

#include "lossverify/core/host_device.hpp"

namespace lossverify {

template <class Real>
LV_HOST_DEVICE Real kl_from_sums(Real sum_exp_student, Real sum_exp_teacher, Real weighted_gap, Real max_student,
                                 Real max_teacher) {
  using std::log;
  return weighted_gap / sum_exp_teacher + ((max_student - max_teacher) + log(sum_exp_student / sum_exp_teacher));
}

}  // namespace lossverify
