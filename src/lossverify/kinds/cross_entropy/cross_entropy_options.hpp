#pragma once
// The cross-entropy kind's settings (docs/spec.md §3): label smoothing in one of two conventions, the z-loss and
// the logit softcap. Declared once, in the kind's table (cross_entropy_kind.cpp).
#include <string_view>

#include "lossverify/case/case.hpp"
#include "lossverify/kinds/cross_entropy/smoothing_convention.hpp"

namespace lossverify {

std::string_view to_string(SmoothingConvention);

struct CrossEntropyOptions final : KindOptions {
  double label_smoothing = 0.0;
  SmoothingConvention convention = SmoothingConvention::pytorch;
  double z_loss_weight = 0.0;
  double softcap = 0.0;  // 0: off; else logits become c tanh(x / c)
};

// The case's cross-entropy settings (defaults for a case of another kind).
const CrossEntropyOptions& cross_entropy_options(const LossSpec& loss);
CrossEntropyOptions& edit_cross_entropy_options(LossSpec& loss);

}  // namespace lossverify
