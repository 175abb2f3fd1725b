#pragma once
// The factors a trainer applies to the router's aux terms and to its whole gradient, as the catalogued bugs move
// them (MOE.md section 4): one place for the CPU and CUDA implementations. Every factor is a constant of the
// micro-batch: it reads the plan's counts for its rows (kRouterRowInputs) and the micro-batch's sequence count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"

namespace lossverify {

struct RouterFactors {
  float aux = 1.0f;           // every aux term's gradient
  float sequence_aux = 1.0f;  // the sequence aux term's, beside `aux`
  float all = 1.0f;           // the whole router gradient (aux and z)
  float z = 1.0f;             // the z-loss term, its value and gradient
};

// `row_inputs`: one row of the micro-batch's plan (T_S, the rank's own valid tokens, N); `sequences`: the
// micro-batch's sequences.
inline RouterFactors router_factors(std::uint64_t bugs, const LayoutSpec& layout, const RouterOptions& o,
                                    std::span<const float> row_inputs, std::size_t sequences) {
  const bool per_token = o.scaling == RouterOptions::Scaling::per_token;
  const float scope_tokens = row_inputs[0], own_tokens = row_inputs[1], step_tokens = row_inputs[2];
  const int sharing = layout.cp * (layout.sp ? layout.tp : 1);  // the ranks of the sequence partition
  RouterFactors f;
  if ((bugs & router_bug::tp_sum) != 0 && layout.sp) f.aux = static_cast<float>(layout.tp);
  if ((bugs & router_bug::cp_missing) != 0) f.all = 1.0f / static_cast<float>(layout.cp);
  if ((bugs & router_bug::no_grad) != 0) f.aux = 0.0f;  // the scaler's return discarded
  if ((bugs & router_bug::ga_overweight) != 0) f.aux *= static_cast<float>(layout.dp * layout.ga);
  if ((bugs & router_bug::ga_double_divide) != 0) f.aux /= static_cast<float>(layout.ga);
  if (!per_token) {
    // moe-zloss-rank-mean: alpha_z / (ranks of the partition x the rank's own tokens) in place of alpha_z / T_S.
    if ((bugs & router_bug::zloss_rank_mean) != 0 && own_tokens > 0.0f) {
      f.z = scope_tokens / (static_cast<float>(sharing) * own_tokens);
    }
    return f;
  }
  if ((bugs & router_bug::per_token_divided) != 0) f.aux /= step_tokens;
  if ((bugs & router_bug::per_token_tp_cp) != 0) f.all /= static_cast<float>(layout.tp * layout.cp);
  if ((bugs & router_bug::seq_aux_mbs) != 0) {
    f.sequence_aux = 1.0f / static_cast<float>(std::max<std::size_t>(sequences, 1));
  }
  if ((bugs & router_bug::count_not_returned) != 0 && layout.cp > 1) f.all *= step_tokens;
  if ((bugs & router_bug::per_token_rank_count) != 0) {
    f.all *= own_tokens * static_cast<float>(sharing) / scope_tokens;
  }
  // moe-aux-per-token-reduced-count: the count T_S x the partition's ranks where the rank's own count x them was meant.
  if ((bugs & router_bug::per_token_reduced_count) != 0) f.aux *= static_cast<float>(sharing);
  return f;
}

// The scales of one micro-batch's aux terms and z-loss in float32, as a trainer computes them from its scope's counts
// ([c_e..., T] per layer, after their all-reduce), shared by the CPU and CUDA implementations: a token's aux weights in
// layer l are aux c_e (c pooled over layers under pool_layers) + sequence(S, H) c_s,e + global(T^G) c^G_e.
struct AuxScales {
  float tokens = 1.0f;    // T of the scope (at least 1)
  float aux = 0.0f;       // alpha E / (k (L T)^2), L the pooled layers (1 without pool_layers)
  float z_weight = 0.0f;  // alpha_z / T
  float sequence_coef = 0.0f, global_coef = 0.0f, k_div = 1.0f, divisor = 1.0f, experts = 1.0f;
  std::vector<float> pooled;          // every layer's counts summed (pool_layers), else empty
  bool sequence_mean_length = false;  // moe-seq-aux-mean-length
  bool global_mean_counts = false;    // moe-global-aux-mean-counts (running counts only)
  bool global_batch_tokens = false;   // moe-global-aux-batch-tokens
  // The aux term's counts of layer l: its own, or the pooled ones.
  const float* counts(const float* layer) const { return pooled.empty() ? layer : pooled.data(); }
  // The sequence aux term's scale for a sequence of S valid tokens among the micro-batch's H that hold one.
  // moe-seq-aux-mean-length: every sequence takes the mean length T / H.
  float sequence(float sequence_tokens, float held) const {
    const float s = std::fmax(sequence_mean_length ? tokens / std::fmax(held, 1.0f) : sequence_tokens, 1.0f);
    return sequence_coef * experts / (k_div * s * s * std::fmax(held, 1.0f));
  }
  // The global aux term's scale for T^G tokens of the global counts (0: none), at micro-batch m (1-based) whose valid
  // tokens over every rank holding other tokens are `batch_tokens` (read by two catalogued bugs only):
  // moe-global-aux-mean-counts takes f from the mean of the running counts over the micro-batch's tokens
  // (T^G -> m T_batch), moe-global-aux-batch-tokens takes P over them (T -> T_batch).
  float global(float global_tokens, float batch_tokens, int m) const {
    if (global_tokens <= 0.0f) return 0.0f;
    const float f_tokens = global_mean_counts ? static_cast<float>(m) * batch_tokens : global_tokens;
    const float p_tokens = global_batch_tokens ? batch_tokens : tokens;
    return global_coef * experts / (divisor * f_tokens * p_tokens);
  }
};
// Whether AuxScales::global reads the micro-batch's tokens over every rank (they cost a collective).
inline bool global_reads_batch_tokens(const RouterOptions& o, std::uint64_t bugs) {
  return o.global_aux_coef > 0.0 && (bugs & (router_bug::global_mean_counts | router_bug::global_batch_tokens)) != 0;
}
inline AuxScales aux_scales(const RouterOptions& o, std::uint64_t bugs, const LayoutSpec& layout,
                            std::span<const float> scope, std::size_t experts, std::size_t layers) {
  AuxScales a;
  const std::size_t width = experts + 1;
  a.tokens = std::fmax(scope[experts], 1.0f);
  a.divisor = static_cast<float>(aux_k_divisor(o));
  a.k_div = (bugs & router_bug::topk_squared) != 0 ? a.divisor * a.divisor : a.divisor;
  a.experts = static_cast<float>(experts);
  const float aux_tokens = a.tokens * static_cast<float>(aux_pooled_layers(o));
  a.aux = static_cast<float>(o.aux_coef) * a.experts / (a.k_div * aux_tokens * aux_tokens);
  a.z_weight = static_cast<float>(o.z_loss_coef) / a.tokens;
  a.sequence_coef = static_cast<float>(o.seq_aux_coef);
  a.global_coef = static_cast<float>(o.global_aux_coef);
  if ((bugs & router_bug::aux_loss_dp_ga_summed) != 0) {  // every aux term weighs DP GA times, value and gradient
    const auto summed = static_cast<float>(layout.dp * layout.ga);
    a.aux *= summed;
    a.sequence_coef *= summed;
    a.global_coef *= summed;
  }
  a.sequence_mean_length = (bugs & router_bug::seq_aux_mean_length) != 0;
  a.global_mean_counts =
      (bugs & router_bug::global_mean_counts) != 0 && o.global_counts == RouterOptions::GlobalCounts::running;
  a.global_batch_tokens = (bugs & router_bug::global_batch_tokens) != 0;
  if (o.pool_layers) {
    a.pooled.assign(experts, 0.0f);
    for (std::size_t l = 0; l < layers; ++l) {
      for (std::size_t e = 0; e < experts; ++e) a.pooled[e] += scope[l * width + e];
    }
  }
  return a;
}

// The router's settings as an implementation reads them: moe-aux-global-topk reads a global top_k.
inline RouterOptions router_options_read(const LossSpec& loss, std::uint64_t bugs) {
  RouterOptions o = router_options(loss);
  if ((bugs & router_bug::global_topk) != 0) o.top_k = router_bug::global_top_k;
  return o;
}

}  // namespace lossverify
