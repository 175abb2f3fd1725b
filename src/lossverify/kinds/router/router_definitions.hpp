#pragma once
// The router losses' definitions in float64 (../shared/MOE.md §1; docs/spec.md when the kind lands): the scores
// the load-balancing loss reads, the top-k routing map, a scope's counts and score sums, the Switch-form aux loss
// and the router z-loss with their gradients with respect to the router logits z_t (the counts are constants).
// The router kind's reference is written on these; tests/unit/test_router_definitions.cpp holds each closed form to
// long-double finite differences of its loss.
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace lossverify::router {

// softmax: p_t = softmax(z_t); sigmoid: q_t = sigma(z_t) / sum_e sigma(z_te) (Megatron's scores for the aux loss).
enum class Score { softmax, sigmoid };

void scores(Score score, std::span<const double> z, std::span<double> out);

// The k experts with the largest scores (ties to the lower index, in that order of preference), and the gap
// between the k-th and the (k+1)-th score: a token whose gap lies within rounding may route either way (MOE.md §3).
struct TopK {
  std::vector<int> experts;
  double margin = 0.0;  // +inf when k equals the number of experts (or of the selected groups' experts)
  int next = -1;        // the (k+1)-th expert; -1 when there is none
  double scale = 0.0;   // the magnitude the margin is rounded at: the k-th score (with a bias, |r| + |b| of the two)
  // The routed map's group selection: the gap between the last selected group's score and the next group's, and its
  // magnitude (+inf and 0 without groups).
  double group_margin = std::numeric_limits<double>::infinity();
  double group_scale = 0.0;
};
TopK top_k(std::span<const double> scores, int k);

// The routed map (MOE.md §1; the map a router dispatches by, Megatron's topk_routing_with_score_function): each
// expert's key kappa_e = r_e + b_e, with r the routing scores (softmax p, or sigmoid sigma(z) not normalised) and b
// the expert bias; the experts form `groups` contiguous groups of E / groups, each group scored by the sum of its
// top k / top_groups keys; the `top_groups` best groups are selected (ties to the lower index) and the token's
// experts are the top-k keys among theirs. The first `take` of them (k, or 1 where a case counts first choices) are
// returned, with the margin to the next one among the selected groups' experts. `magnitude` is |r_e| + |b_e|, the
// size the keys are rounded at.
struct Grouping {
  int top_k = 2, groups = 1, top_groups = 1;
};
TopK routed_top_k(std::span<const double> keys, std::span<const double> magnitude, const Grouping& grouping, int take);
// The routing scores r of the routed map: softmax p_t, or sigma(z_t) (not normalised; the loss's q_t is).
void routing_scores(Score score, std::span<const double> z, std::span<double> out);
// The expert bias of layer `layer`'s expert `expert` of E, for a case's expert_bias beta: a fixed sequence in
// [-beta, beta] that every implementation computes alike (docs/spec.md §10), rounded to float32 as a router holds it:
//   b_{l,e} = fl32(beta (2 frac(j phi) - 1)),  j = l E + e + 1,  phi = (sqrt 5 - 1) / 2.
float expert_bias(double beta, std::int64_t layer, std::int64_t expert, std::int64_t experts);

// A float32 router may route either way a token whose k-th and (k+1)-th keys lie within this much of their
// magnitude (MOE.md section 3; about 8 float32 units: exp, sigmoid and the normaliser are monotone when rounded).
inline constexpr double kTieWithin = 1e-6;
inline bool ties(const TopK& routed) { return routed.margin <= kTieWithin * routed.scale; }
// A group selection within rounding moves every count of the token: no bound covers it, so such inputs are refused.
inline bool groups_tie(const TopK& routed) { return routed.group_margin <= kTieWithin * routed.group_scale; }

// One scope's sums over its valid tokens: c_e (counts of the routing map), T and S_e = sum_t p_te.
struct ScopeSums {
  std::vector<double> counts, score_sums;
  // |delta c|: per expert, the counts that tie tokens may move (MOE.md section 3: each between its k-th and (k+1)-th
  // experts).
  std::vector<double> ties;
  double tokens = 0.0;
  explicit ScopeSums(std::size_t experts) : counts(experts, 0.0), score_sums(experts, 0.0), ties(experts, 0.0) {}
  void add(std::span<const double> token_scores, const TopK& routed);
  void count(const TopK& routed);  // counts and tokens only (the score sums stay)
  void add_tie(const TopK& routed);
  void merge(const ScopeSums& other);  // counts, ties and tokens (not the score sums)
};

// L_aux = coef E / (k T^2) sum_e c_e S_e (the Switch form, = coef E sum_e f_e P_e with f_e = c_e / (k T),
// P_e = S_e / T); 0 for a scope without tokens.
// `k` is the divisor of f_e: the routed experts per token, or 1 where a convention counts first choices or does
// not divide by k.
double aux_loss(const ScopeSums& scope, double coef, double k);
// Its factor coef E / (k T^2), the scale of every token's gradient in the scope.
double aux_scale(const ScopeSums& scope, double coef, double k);

// d L_aux / d z_t of one token for a scope's counts c and scale a = coef E / (k T^2):
//   softmax  a p_t (c - <p_t, c>);   sigmoid  a q_t (1 - sigma(z_t)) (c - <q_t, c>).
void aux_gradient(Score score, std::span<const double> z, std::span<const double> counts, double scale,
                  std::span<double> grad);

// logsumexp of the raw router logits, compensated.
double logsumexp(std::span<const double> z);
// The router z-loss of one token with weight w = coef / T: w lse(z)^2, and its gradient 2 w lse(z) softmax(z).
double z_loss(std::span<const double> z, double weight);
void z_loss_gradient(std::span<const double> z, double weight, std::span<double> grad);

}  // namespace lossverify::router
