#pragma once
// The factors a trainer applies to the router's aux terms and to its whole gradient, as the catalogued bugs move
// them (MOE.md section 4): one place for the CPU and CUDA implementations. Every factor is a constant of the
// micro-batch: it reads the plan's counts for its rows (kRouterRowInputs) and the micro-batch's sequence count.
#include <algorithm>
#include <cstdint>
#include <span>

#include "lossverify/case/case.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"

namespace lossverify {

struct RouterFactors {
  float aux = 1.0f;           // every aux term's gradient
  float sequence_aux = 1.0f;  // the sequence aux term's, beside `aux`
  float all = 1.0f;           // the whole router gradient (aux and z)
};

// `row_inputs`: one row of the micro-batch's plan (T_S, the rank's own valid tokens, N); `sequences`: the
// micro-batch's sequences.
inline RouterFactors router_factors(std::uint64_t bugs, const LayoutSpec& layout, const RouterOptions& o,
                                    std::span<const float> row_inputs, std::size_t sequences) {
  const bool per_token = o.scaling == RouterOptions::Scaling::per_token;
  const float scope_tokens = row_inputs[0], own_tokens = row_inputs[1], step_tokens = row_inputs[2];
  RouterFactors f;
  if ((bugs & router_bug::tp_sum) != 0 && layout.sp) f.aux = static_cast<float>(layout.tp);
  if ((bugs & router_bug::cp_missing) != 0) f.all = 1.0f / static_cast<float>(layout.cp);
  if ((bugs & router_bug::no_grad) != 0) f.aux = 0.0f;  // the scaler's return discarded
  if ((bugs & router_bug::ga_overweight) != 0) f.aux *= static_cast<float>(layout.ga);
  if (!per_token) return f;
  if ((bugs & router_bug::per_token_divided) != 0) f.aux /= step_tokens;
  if ((bugs & router_bug::per_token_tp_cp) != 0) f.all /= static_cast<float>(layout.tp * layout.cp);
  if ((bugs & router_bug::seq_aux_mbs) != 0) {
    f.sequence_aux = 1.0f / static_cast<float>(std::max<std::size_t>(sequences, 1));
  }
  if ((bugs & router_bug::count_not_returned) != 0 && layout.cp > 1) f.all *= step_tokens;
  if ((bugs & router_bug::per_token_rank_count) != 0) {
    const int sharing = layout.cp * (layout.sp ? layout.tp : 1);
    f.all *= own_tokens * static_cast<float>(sharing) / scope_tokens;
  }
  return f;
}

// The router's settings as an implementation reads them: moe-aux-global-topk reads a global top_k.
inline RouterOptions router_options_read(const LossSpec& loss, std::uint64_t bugs) {
  RouterOptions o = router_options(loss);
  if ((bugs & router_bug::global_topk) != 0) o.top_k = router_bug::global_top_k;
  return o;
}

}  // namespace lossverify
