#pragma once
// Plain-data interface between the router's CUDA rank (router_cuda.cpp) and its kernels (router_kernels.cu,
// compiled by nvcc). Nothing here includes CUDA headers. Router logits are float32 (the kind refuses 16-bit ones).
#include <cstdint>

namespace lossverify::cuda {

// Pass 1, one warp per (row, layer): the row's top-k experts by logit (softmax and sigmoid scores are monotone in
// it; ties to the lower index), counted into the scope's [layer][c_e..., T] and, where `sequences` is given, into
// its sequence's [slot][layer][c_e..., T] (atomic float adds: exact below 2^24).
struct RouterRouteArgs {
  const float* logits;  // rows x layers x experts
  std::int64_t rows;
  int layers, experts, top_k;
  const int* counted;  // per row: whether it counts
  const int* slot;     // per row: its sequence among the micro-batch's (-1: none); null with `sequences`
  float* scope;        // layers x (experts + 1)
  float* sequences;    // slots x layers x (experts + 1), or null
  // The routed map (the case's map: routed), one thread per (row, layer): null for the plain top-k above. Keys are
  // the routing score (softmax p, or sigmoid sigma(z)) plus bias[layer][expert]; with groups > 1 each group scores the
  // sum of its top router_k / top_groups keys and the top_groups best groups hold the token's experts; top_k of them
  // count (the first choice only where the case counts first choices).
  const float* bias = nullptr;  // layers x experts
  int sigmoid = 0, router_k = 0, groups = 1, top_groups = 1;
};
void router_route(const RouterRouteArgs& args, void* stream);

// Pass 2, one warp per (row, layer): with w = weights[slot][layer] (every aux term's per-expert weight) and
// ws = sequence_weights[slot][layer] (the sequence aux term's part of it),
//   l = <w, s> + z_weight lse^2,
//   g_e = weight * all * (aux * (s_e slope_e ((w_e - ws_e) - (<w,s> - <ws,s>)) + sequence_aux * s_e slope_e
//         (ws_e - <ws,s>)) + 2 z_weight lse p_e),
// slope 1 (softmax) or 1 - sigma(z_e) (normalised sigmoid). Writes the row's gradient and, per layer,
// terms[row][layer] = [<w, s>, z_weight lse^2].
struct RouterGradArgs {
  const float* logits;
  float* grad;
  std::int64_t rows;
  int layers, experts;
  int sigmoid;
  const int* active;
  const float* weight;  // backward weight per row
  const int* slot;
  const float* weights;           // slots x layers x experts
  const float* sequence_weights;  // slots x layers x experts
  float z_weight, all, aux, sequence_aux;
  float* terms;  // rows x layers x 2
};
void router_grad(const RouterGradArgs& args, void* stream);

}  // namespace lossverify::cuda
