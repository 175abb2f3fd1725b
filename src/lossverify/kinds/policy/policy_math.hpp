#pragma once
// The policy objective of one token in the sharded kernels' precision (docs/spec.md §3.3), written once for
// the CPU and CUDA kernels. The float64 reference does not use this file (kinds/policy/policy_reference.cpp
// is written from the definitions on its own).
#include <cmath>

#include "lossverify/core/host_device.hpp"

namespace lossverify {

// What the kernels need of PolicyOptions, in their precision.
template <class Real>
struct PolicyCoefficients {
  bool logprob_only = false;  // objective logprob: l = -lambda - c_H H
  Real clip_low = 0, clip_high = 0;
  Real dual_clip = 0;  // 0: off
  int kl = 0;          // 0 none, 1 k1, 2 k2, 3 k3
  Real kl_coef = 0;
  Real entropy_coef = 0;
};

// The terms of one token: the surrogate (or -lambda) and its slope in lambda, the KL value and its slope,
// and which clip was active.
template <class Real>
struct PolicyTerms {
  Real surrogate = 0;
  Real surrogate_slope = 0;  // d surrogate / d lambda
  Real kl = 0;
  Real kl_slope = 0;  // d KL / d lambda
  bool clipped = false;
  bool dual_clipped = false;
};

// rho = exp(log_ratio) (lambda - old for a token-level ratio, the sequence's mean of it for GSPO's);
// surrogate = max(-rho A, -clip(rho) A), capped at -c A for A < 0 (dual clip). The slope is the token-level
// ratio's (-rho A where the unclipped term is active); the sequence-level ratio's is the protocol's.
template <class Real>
LV_HOST_DEVICE PolicyTerms<Real> policy_terms(Real logprob, Real log_ratio, Real ref_logprob, Real advantage,
                                              const PolicyCoefficients<Real>& k) {
  using std::exp;
  PolicyTerms<Real> t;
  if (k.logprob_only) {
    t.surrogate = -logprob;
    t.surrogate_slope = Real(-1);
    return t;
  }
  const Real ratio = exp(log_ratio);
  const Real low = Real(1) - k.clip_low;
  const Real high = Real(1) + k.clip_high;
  const Real clipped_ratio = ratio < low ? low : (ratio > high ? high : ratio);
  const Real unclipped = -ratio * advantage;
  const Real clipped = -clipped_ratio * advantage;
  t.clipped = clipped > unclipped;
  t.surrogate = t.clipped ? clipped : unclipped;
  t.surrogate_slope = t.clipped ? Real(0) : unclipped;  // d(-rho A)/d lambda = -rho A
  if (k.dual_clip > Real(0) && advantage < Real(0) && t.surrogate > -k.dual_clip * advantage) {
    t.dual_clipped = true;
    t.surrogate = -k.dual_clip * advantage;
    t.surrogate_slope = Real(0);
  }
  const Real d = logprob - ref_logprob;
  switch (k.kl) {
    case 1:
      t.kl = d;
      t.kl_slope = Real(1);
      break;
    case 2:
      t.kl = Real(0.5) * d * d;
      t.kl_slope = d;
      break;
    case 3: {
      const Real e = exp(-d);
      t.kl = e + d - Real(1);
      t.kl_slope = Real(1) - e;
      break;
    }
    default:
      break;
  }
  return t;
}

}  // namespace lossverify
