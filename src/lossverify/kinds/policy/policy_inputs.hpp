#pragma once
// The inputs a policy loss reads beside the logits (docs/spec.md §3.3): each token's old (rollout) and
// reference log-probabilities and its sequence's advantage, float32, from their own Philox streams. They
// are a pure function of the case and the token, so every rank and the reference read the same values.
//
// Placement: a token's ratio rho = exp(lambda - old) is drawn inside one of the intervals that the clip
// edges 1 - eps_low, 1 + eps_high (and the dual clip c) cut out, a clear margin from every edge (under the
// sequence-level ratio, the sequence's rho_s is placed so, and each token's own ratio spread around it), and its
// reference log-probability a gap of 0.05 to 0.5 from lambda; both need lambda, the token's log-probability
// at the case's temperature, so a token's inputs cost one float64 pass over its whole row.
#include <cstdint>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify {

struct PolicyTokenInputs {
  float old_logprob = 0.0f;
  float ref_logprob = 0.0f;
  float advantage = 0.0f;  // before whitening
};

// Their names in exports and dumps (the kind's token_inputs()), in the order of explicit inputs.
inline constexpr const char* kPolicyTokenInputNames[] = {"old_logprob", "ref_logprob", "advantages"};

// The token's inputs (a masked token keeps only its sequence's advantage). Explicit inputs (a dump's) are
// read as they are; generated ones are placed as above.
PolicyTokenInputs policy_token_inputs(const Case& c, const InputSource& inputs, std::int64_t token);

// The token's advantage alone, without the placement pass (whitening statistics read every token's).
float policy_token_advantage(const Case& c, const InputSource& inputs, std::int64_t token);

// The sign of a sequence's generated advantage: within each window of eight consecutive sequences, the half of
// those holding a valid token with the larger Philox draws are positive (as a GRPO group's are).
bool generated_advantage_positive(const Case& c, const InputSource& inputs, std::int64_t sequence);

}  // namespace lossverify
