#pragma once
// The inputs a policy loss reads beside the logits (docs/spec.md §3.3): each token's old (rollout) and
// reference log-probabilities and its sequence's advantage, float32, from their own Philox streams. They
// are a pure function of the case and the token, so every rank and the reference read the same values.
//
// Placement: a token's ratio rho = exp(lambda - old) is drawn inside one of the intervals that the clip
// edges 1 - eps_low, 1 + eps_high (and the dual clip c) cut out, a clear margin from every edge (under the
// sequence-level ratio, the sequence's rho_s is placed so, and each token's own ratio spread around it), and its
// reference log-probability a gap of 0.05 to 0.5 from lambda; both need lambda, the token's log-probability
// at the case's temperature, so a token's inputs cost one float64 pass over its whole row (behind an LM head, the
// head's float64 logits h W^T (+ b) of that row: PolicyRowLogits).
#include <cstdint>
#include <memory>
#include <span>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify {

struct PolicyTokenInputs {
  float old_logprob = 0.0f;
  float ref_logprob = 0.0f;
  float advantage = 0.0f;  // before whitening
};

// Their names in exports and dumps (the kind's token_inputs()), in the order of explicit inputs.
inline constexpr const char* kPolicyTokenInputNames[] = {"old_logprob", "ref_logprob", "advantages"};

// A token's whole row of logits in float64, as the kind places its inputs against them and bounds its quantities:
// the case's generated logits, or, behind a stage that makes the logits (an LM head), the stage's own float64 logits
// from its inputs (Stage::float64_logits) with each column's error bound. Still a pure function of the case and the
// token, so every rank, every backend and the reference place alike. Build one per pass over many tokens: behind a
// head it holds W, and each row costs V x H.
class PolicyRowLogits {
 public:
  PolicyRowLogits(const Case& c, const InputSource& inputs);
  ~PolicyRowLogits();
  PolicyRowLogits(const PolicyRowLogits&) = delete;
  PolicyRowLogits& operator=(const PolicyRowLogits&) = delete;
  // Columns [0, V); `error` (empty, or V wide) receives each column's bound, 0 where the logits are the inputs.
  void row(std::int64_t token, std::span<double> out, std::span<double> error = {}) const;
  bool from_stage() const { return stage_ != nullptr; }

 private:
  const Case& case_;
  const InputSource& inputs_;
  std::unique_ptr<StageLogits> stage_;
};

// The token's log-probability lambda = x_y / T - lse at the case's temperature, in float64 over its whole row.
double policy_placement_logprob(const Case& c, std::span<const double> row, std::int64_t label);

// The token's inputs (a masked token keeps only its sequence's advantage). Explicit inputs (a dump's) are
// read as they are; generated ones are placed as above, against `logits` (the second form builds its own).
PolicyTokenInputs policy_token_inputs(const Case& c, const InputSource& inputs, const PolicyRowLogits& logits,
                                      std::int64_t token);
PolicyTokenInputs policy_token_inputs(const Case& c, const InputSource& inputs, std::int64_t token);
// The same, placed against the token's whole row of logits as the caller has it (`row`: PolicyRowLogits::row).
PolicyTokenInputs policy_token_inputs_from_row(const Case& c, const InputSource& inputs, std::int64_t token,
                                               std::span<const double> row);

// The token's advantage alone, without the placement pass (whitening statistics read every token's).
float policy_token_advantage(const Case& c, const InputSource& inputs, std::int64_t token);

// The sign of a sequence's generated advantage: within each window of eight consecutive sequences, the half of
// those holding a valid token with the larger Philox draws are positive (as a GRPO group's are).
bool generated_advantage_positive(const Case& c, const InputSource& inputs, std::int64_t sequence);

}  // namespace lossverify
