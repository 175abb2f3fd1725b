#pragma once
// The router losses' definitions in float64 (../shared/MOE.md §1; docs/spec.md when the kind lands): the scores
// the load-balancing loss reads, the top-k routing map, a scope's counts and score sums, the Switch-form aux loss
// and the router z-loss with their gradients with respect to the router logits z_t (the counts are constants).
// The router kind's reference is written on these; tests/unit/test_router_definitions.cpp holds each closed form to
// long-double finite differences of its loss.
#include <cstdint>
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
  double margin = 0.0;  // +inf when k equals the number of experts
  int next = -1;        // the (k+1)-th expert; -1 when k equals the number of experts
};
TopK top_k(std::span<const double> scores, int k);
// A float32 router may route either way a token whose k-th and (k+1)-th scores lie within this much of the k-th
// (MOE.md section 3; about 8 float32 units: exp, sigmoid and the normaliser are monotone when rounded).
inline constexpr double kTieWithin = 1e-6;
inline bool ties(const TopK& routed, std::span<const double> scores) {
  return routed.margin <= kTieWithin * scores[static_cast<std::size_t>(routed.experts.back())];
}

// One scope's sums over its valid tokens: c_e (counts of the routing map), T and S_e = sum_t p_te.
struct ScopeSums {
  std::vector<double> counts, score_sums;
  // |delta c|: per expert, the counts that tie tokens may move (MOE.md section 3: each between its k-th and (k+1)-th
  // experts).
  std::vector<double> ties;
  double tokens = 0.0;
  explicit ScopeSums(std::size_t experts) : counts(experts, 0.0), score_sums(experts, 0.0), ties(experts, 0.0) {}
  void add(std::span<const double> token_scores, const TopK& routed);
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
