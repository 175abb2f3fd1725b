#pragma once
// The router's float64 reference on the GPU (router_oracle.cpp, its GPU oracle), plain-data interface: the same
// definitions as router_definitions.cpp, evaluated from the oracle's own copy of the logits. Nothing here includes
// CUDA headers.
#include <cstdint>

namespace lossverify::cuda {

// Pass 1, one thread per (token, layer) of the step: the scores in float64 and the token's map, the plain top-k of
// the scores or the routed map (router::routed_top_k: keys r + b, groups by the sum of their top router_k / top_groups
// keys), as router::top_k / routed_top_k write it: the `take` experts, the next one (-1: none), the margin and its
// scale, and the group selection's margin and scale (+inf and 0 without groups).
struct RouterReferenceRouteArgs {
  const float* logits;  // rows x layers x experts
  std::int64_t rows;
  int layers, experts;
  const int* valid;  // per row: whether the token is routed
  int sigmoid;       // scores: softmax, or sigmoid normalised over the experts
  int take;          // experts counted per token: k, or 1 for first choices
  int routed_map, router_k, groups, top_groups;
  const double* bias;  // layers x experts (the routed map), the float32 values the router holds
  int* experts_out;    // rows x layers x take
  int* next_out;       // rows x layers
  double* margins;     // rows x layers x 4: margin, scale, group margin, group scale
};
void router_reference_route(const RouterReferenceRouteArgs& args, void* stream);

// Pass 2, one thread per (row, layer) of the rank: with w and tw the row's aux weights and tie weights
// (weights[slot][layer], tie_weights[slot][layer]),
//   expected_e = weight (s_e slope_e (w_e - <w, s>) + 2 z_weight lse p_e),
//   slack_e    = |weight| s_e slope_e (tw_e + <tw, s>),
//   terms      = [<w, s>, z_weight lse^2, <tw, s>],
// with s the scores, p the softmax and slope 1 (softmax) or 1 - sigma(z_e) (sigmoid); rows whose slot is -1 are left.
struct RouterReferenceRowArgs {
  const float* logits;  // rows x layers x experts
  std::int64_t rows;
  int layers, experts;
  int sigmoid;
  const int* slot;            // per row: its weight tables' slot, -1 where it is no valid token
  const double* weight;       // per row: d L / d l_t
  const double* z_weight;     // per row: alpha_z / T
  const double* weights;      // slots x layers x experts
  const double* tie_weights;  // slots x layers x experts, or null (no tie tokens)
  double* expected;           // rows x layers x experts
  double* slack;              // rows x layers x experts, or null
  double* terms;              // rows x layers x 3
};
void router_reference_rows(const RouterReferenceRowArgs& args, void* stream);

}  // namespace lossverify::cuda
