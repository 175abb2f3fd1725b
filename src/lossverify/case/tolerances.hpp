#pragma once
// Default tolerances per (input dtype, compute dtype, quantity). The sharded CPU implementations
// compute in float32 from the exact input values, so the loss tolerances depend only on the compute
// dtype; gradients are written in the input dtype, so their tolerances follow its precision.
//
// An element passes when |got - expected| <= atol * |w_t| + rtol * |expected|, where w_t is the
// reference weight of the token in the reduced objective (1/N_v for mean, 1 for sum, g_t for none).
// Scaling atol by w_t keeps the absolute floor meaningful at every batch size: without it, a mean over
// N_v = 2048 tokens makes every gradient smaller than a fixed atol and every bug invisible.
#include <array>
#include <map>
#include <string>
#include <string_view>

#include "lossverify/case/case.hpp"
#include "lossverify/core/dtype.hpp"

namespace lossverify {

// Quantities that carry a tolerance; the keys of a case file's "tolerances" object.
inline constexpr std::array<std::string_view, 8> kToleranceQuantities = {
    "loss",            // per-token loss
    "reduced_loss",    // the logged (mean or sum) loss
    "grad",            // every effective gradient element
    "row_sum",         // sum over the vocabulary of one token's gradient (the docs/spec.md §3 invariant)
    "rank_agreement",  // per-token loss of one TP rank against the others
    "invariance",      // the same global answer at another rank layout
    "token_value",     // a kind's per-token quantity (a policy loss's log-probability, entropy)
    "statistic",       // a kind's logged statistic (a token-mean over the step)
};
// Whether a case's resolved tolerances name the quantity (a kind's quantities only where the kind has them).
bool tolerance_applies(const Case& c, std::string_view quantity);

struct ToleranceEntry {
  Tolerance tolerance;
  std::string why;  // one line: where the figure comes from
};

// Default for a quantity at an input dtype (compute dtype is float32 for the CPU kernels).
ToleranceEntry default_tolerance(std::string_view quantity, DType input_dtype);

// The default, replaced by the case's override when it names the quantity.
Tolerance effective_tolerance(const Case& c, std::string_view quantity);

}  // namespace lossverify
