#pragma once
// The policy kind's collective protocol (docs/spec.md §5), written once for every backend. A backend
// supplies what only it can compute over its own columns of one micro-batch (each row's local statistics,
// then the gradient from per-row coefficients); the protocol rescales the statistics to the TP group's
// maximum, all-reduces them, evaluates each token's objective (policy_math.hpp), applies the catalogued
// switches and writes each row's loss, log-probability, entropy and logged statistics.
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

// One row's statistics over a shard's columns, relative to the shard's own maximum m of x / T:
// S = sum e^u, E = sum e^u u with u = x / T - m, the target's u where the shard holds it, and the column of m.
struct PolicyLocalStats {
  float max = 0.0f;
  float sum_exp = 0.0f;
  float sum_exp_u = 0.0f;
  float target = 0.0f;
  float argmax = 0.0f;  // a column index (exact below 2^24)
  static constexpr int kFloats = 5;
};

// What the gradient of one row's local columns needs: with log p_v = (x_v / T - max) - log_sum and
// p_v = e^(log p_v),
//   g_v = scale [a ([v = target] - p_v) + [v = argmax] bonus + c p_v (log p_v + shift)]
// (shift = H; the catalogued backward mistakes change a, bonus and shift).
struct PolicyGradRow {
  float max = 0.0f, log_sum = 0.0f;
  float a = 0.0f, bonus = 0.0f, c = 0.0f, shift = 0.0f, scale = 0.0f;
  float target = -1.0f, argmax = -1.0f;  // local columns, -1 where the shard holds none
  static constexpr int kFloats = 9;
};

// How the gradient kernel rounds to the logits' 16-bit storage dtype (a no-op on float32 logits):
// tempered16: p_v of x / T rounded (rl-temperature-16bit), each element scale * value rounded, then times 1 / T
// and rounded again (the float32 pass's gradient cast back, then logits.div_(T)'s backward in the logits' dtype);
// logsoftmax16 (rl-logprob-16bit): as tempered16, and the log-prob's part is a 16-bit log_softmax's backward,
// round16(round16(scale a) (delta - e^(round16(log p_v)))), from its 16-bit output and upstream gradient.
enum class PolicyGradRounding { none = 0, tempered16 = 1, logsoftmax16 = 2 };

class PolicyShard {
 public:
  virtual ~PolicyShard() = default;
  // Each active row's local statistics (PolicyLocalStats::kFloats floats per row of the micro-batch). The
  // shard reads x / T with inverse_temperature, which the protocol decides; with round_scaled each x / T is
  // rounded to the logits' storage dtype first (rl-logprob-16bit: logits.div_(T) on 16-bit logits).
  virtual void local_stats(float inverse_temperature, bool round_scaled, std::span<float> stats) = 0;
  // The gradient of every active row's local columns (PolicyGradRow::kFloats floats per row), rounded as
  // `rounding` says (where it is not none, scale leaves 1 / T out).
  virtual void gradient(float inverse_temperature, PolicyGradRounding rounding, std::span<const float> rows) = 0;
};

// What the protocol reads and writes of one micro-batch, rows [begin, begin + n) of the rank, on any backend.
struct PolicyBatch {
  const Case& c;
  const BugSwitches& bugs;
  const RankPlan& plan;
  RankGroups& groups;
  std::int64_t begin = 0, n = 0;
  VocabRange work;  // the kernel's columns
  std::vector<float>& token_loss;
  std::vector<float>& logged_token_loss;  // sized where the plan separates it (the aux-term bugs)
  std::vector<float>& token_values;
  std::vector<double>& logged_stats;
};

// Collective over batch.groups.tp.
void policy_protocol(const PolicyBatch& batch, PolicyShard& shard);

}  // namespace lossverify
