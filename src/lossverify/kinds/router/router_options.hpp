#pragma once
// The router kind's settings (../shared/MOE.md §1): E experts (the case's shape.experts), top-k routing on softmax or
// normalised-sigmoid scores, the Switch-form load-balancing loss over a micro-batch's scope, and the router z-loss.
// Declared once, in the kind's table (router_kind.cpp).
#include <string_view>

#include "lossverify/case/case.hpp"

namespace lossverify {

struct RouterOptions final : KindOptions {
  enum class Score { softmax, sigmoid };
  int top_k = 2;
  Score score = Score::softmax;
  double aux_coef = 0.01;        // alpha of the aux loss over a micro-batch's scope
  double seq_aux_coef = 0.0;     // alpha of the sequence aux loss: one scope per sequence, averaged over the
                                 // micro-batch's sequences that hold a valid token (DeepSeek-V2/V3)
  double global_aux_coef = 0.0;  // alpha of the global aux loss (arXiv 2501.11873): f_e from the step's counts
  enum class GlobalCounts { step, running };
  GlobalCounts global_counts = GlobalCounts::step;  // running: the counts of micro-batches 0..m over every rank
  double z_loss_coef = 0.0;                         // alpha_z
};

const RouterOptions& router_options(const LossSpec& loss);
std::string_view to_string(RouterOptions::Score);
std::string_view to_string(RouterOptions::GlobalCounts);

}  // namespace lossverify
