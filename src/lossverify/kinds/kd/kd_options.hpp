#pragma once
// The KD kind's settings (docs/spec.md §3): forward KL of the teacher P = softmax(y / T) to the student
// Q = softmax(x / T), scaled by T^2 unless t2_scaling is off. Declared once, in the kind's table (kd_kind.cpp).
#include "lossverify/case/case.hpp"

namespace lossverify {

struct KdOptions final : KindOptions {
  double temperature = 1.0;
  bool t2_scaling = true;
};

// The case's KD settings (defaults for a case of another kind).
const KdOptions& kd_options(const LossSpec& loss);
KdOptions& edit_kd_options(LossSpec& loss);

}  // namespace lossverify
