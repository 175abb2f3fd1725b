#pragma once
// The router kind's settings (../shared/MOE.md §1, docs/spec.md §10): E experts (the case's shape.experts) in each of
// `layers` MoE layers, top-k routing on softmax or normalised-sigmoid scores, the Switch-form load-balancing loss
// over a micro-batch's scope, the sequence and global-batch aux losses, the router z-loss, and the trainer's scaling
// contract. Declared once, in the kind's table (router_kind.cpp).
#include <string_view>

#include "lossverify/case/case.hpp"

namespace lossverify {

struct RouterOptions final : KindOptions {
  enum class Score { softmax, sigmoid };
  int top_k = 2;
  int layers = 1;  // MoE layers: a token's row holds each layer's E router logits side by side
  Score score = Score::softmax;
  double aux_coef = 0.01;        // alpha of the aux loss over a micro-batch's scope
  double seq_aux_coef = 0.0;     // alpha of the sequence aux loss: one scope per sequence, averaged over the
                                 // micro-batch's sequences that hold a valid token (DeepSeek-V2/V3)
  double global_aux_coef = 0.0;  // alpha of the global aux loss (arXiv 2501.11873): f_e from the step's counts
  enum class GlobalCounts { step, running };
  GlobalCounts global_counts = GlobalCounts::step;  // running: the counts of micro-batches 0..m over every rank
  double z_loss_coef = 0.0;                         // alpha_z
  // Conventions (MOE.md §1; none is a bug by itself): counts over the top-k or over first choices only (DeepSpeed's
  // top-2 gating: f_e = c1_e / T, so no division by k), and the aux terms divided by k or not (transformers'
  // load_balancing_loss_func is k times the Switch form).
  enum class Counts { top_k, first };
  Counts counts = Counts::top_k;
  bool divide_by_k = true;
  // One aux loss per layer (the layers' losses add), or one over every layer's counts and scores pooled (transformers'
  // load_balancing_loss_func concatenates the layers' router logits): c_e summed over layers and T = layers x tokens.
  bool pool_layers = false;
  // The aux terms' routing map (MOE.md §1): the plain top-k of the scores (Megatron's
  // compute_routing_scores_for_aux_loss before #5195), or the routed map the router dispatches by: group-limited top-k
  // of the routing scores plus the expert bias (router::routed_top_k). `groups`, `top_groups` and `expert_bias`
  // describe the router either way.
  enum class Map { top_k, routed };
  Map map = Map::top_k;
  int groups = 1;            // the experts' contiguous groups (DeepSeek-V3's node-limited routing)
  int top_groups = 1;        // the groups a token may route to; each group scored by its top k / top_groups keys
  double expert_bias = 0.0;  // beta of the expert bias b_{l,e} in [-beta, beta] (router::expert_bias)
  // default: the step averages its DP x GA micro-batches' losses, the framework's grad_reduce / ga_reduce apply;
  // per_token: each micro-batch's loss weighs its share T_S / N of the step's valid tokens, and the framework divides
  // every gradient by N after its reduction (Megatron's calculate_per_token_loss).
  enum class Scaling { standard, per_token };
  Scaling scaling = Scaling::standard;
};

const RouterOptions& router_options(const LossSpec& loss);
std::string_view to_string(RouterOptions::Score);
std::string_view to_string(RouterOptions::GlobalCounts);
std::string_view to_string(RouterOptions::Scaling);
std::string_view to_string(RouterOptions::Counts);
std::string_view to_string(RouterOptions::Map);
// The divisor of the aux terms' f_e = c_e / (divisor T): k, or 1 where the case counts first choices or does not
// divide by k.
double aux_k_divisor(const RouterOptions& o);
// The layers whose counts one aux loss reads: 1, or every layer when they are pooled.
inline int aux_pooled_layers(const RouterOptions& o) { return o.pool_layers ? o.layers : 1; }
// What the logged aux loss divides the layers' terms by: their mean over layers, or (pooled) the one loss itself.
inline double logged_aux_divisor(const RouterOptions& o) { return o.pool_layers ? 1.0 : o.layers; }

}  // namespace lossverify
