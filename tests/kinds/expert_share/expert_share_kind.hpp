#pragma once
// A sketch of a kind whose rows are whole on every rank and whose loss needs a collective over a scope before any
// gradient, as a router's load-balancing loss does (../shared/MOE.md), kept to the least that exercises the seam:
// rows of E columns (the case's shape.experts), p_t = softmax(x_t), and per scope s (one DP rank's
// micro-batch: its tokens over CP, and over TP under layout.sp) the mean P_s = (1 / n_s) sum_t p_t; the loss
// L = (1 / S) sum_s E sum_e P_s,e^2 over the S scopes holding a valid token, each token's l_t = E <p_t, P_s> with
// weight 1 / (S n_s). TP splits no columns here: it replicates tokens, or splits them under layout.sp. Everything it
// is lives in this folder and reaches lossverify through register_loss_kind.
namespace lossverify::testing {

inline constexpr const char* kExpertShare = "expert_share";
// Its catalogued bug: the scope's mean over the rank's own rows, with no all-reduce over CP (or TP under sp).
inline constexpr const char* kExpertShareLocalScope = "expert-share-local-scope";

void register_expert_share();

}  // namespace lossverify::testing
