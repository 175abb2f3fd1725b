#pragma once
// The judgement of one compared value (docs/spec.md §6), shared by the checks and the host oracle.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lossverify/checks/oracle.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/core/element_rule.hpp"

namespace lossverify {

// error / tolerance: 0 for an exact value (equal infinities included: two TP ranks that agree), +inf for NaN, for a
// zero tolerance that is exceeded, and for any other error against a tolerance that is not finite (an infinite or
// NaN reference: nothing to judge against, so never a pass). Never NaN.
inline double margin_of(double error, double tolerance) { return element_rule::margin(error, tolerance); }

// The margin against a reference that is not finite: nothing to judge against, so 0 for an exact value (equal
// infinities) and +inf for anything else.
inline double exact_or_infinite(double error) { return error == 0.0 ? 0.0 : std::numeric_limits<double>::infinity(); }

// Whether an element with this error fails against this tolerance, as margin_of() > 1 (a comparison with NaN is
// false, so `!(error <= tolerance)` alone would pass inf <= inf).
inline bool mismatch_of(double error, double tolerance) { return !(margin_of(error, tolerance) <= 1.0); }

// Smallest positive value of the output dtype: no output can be closer to the exact value than this.
inline double output_quantum(DType dtype) {
  switch (dtype) {
    case DType::fp16:
      return 0x1p-24;
    case DType::bf16:
      return 0x1p-133;
    case DType::fp32:
    default:
      return 0x1p-149;
  }
}

// Element check of one gradient value against the reference, in effective units.
// ULP mode (16-bit outputs): the distance to the exact value in units of the dtype's spacing there,
// measured on the rank's own (local) value against reference / framework scale, or within the floor.
struct GradJudge {
  const GradJudgement& j;

  // The margin of `got_local` against `expected`; sets `mismatch` and, in ULP mode, `ulp`.
  // `slack`: an absolute widening of this element's tolerance (KindReference::gradient_slack).
  double judge(double got_local, double expected, double token_scale, bool& mismatch, std::int64_t& ulp,
               double slack = 0.0) const {
    const double got = got_local * j.framework_scale;
    const double error = got == expected ? 0.0 : std::fabs(got - expected);
    const double floor = j.tolerance.atol * token_scale + j.quantum * j.framework_scale + slack;
    if (j.tolerance.max_ulp > 0) {
      const double local_expected = expected / j.framework_scale;
      const double local_error = got_local == local_expected ? 0.0 : std::fabs(got_local - local_expected);
      const double spacing = ulp_size(local_expected, j.dtype);
      // A stored value closer than half a spacing is round(expected): distance 0, no need to count.
      ulp = local_error < 0.5 * spacing ? 0 : ulp_distance(got_local, local_expected, j.dtype);
      const double m = element_rule::ulp_margin(element_rule::by_ulp(local_error, spacing, j.tolerance.max_ulp),
                                                element_rule::margin(error, floor), error, expected);
      mismatch = !(m <= 1.0);
      return m;
    }
    const double m = element_rule::tolerance_margin(error, floor, j.tolerance.rtol, expected);
    mismatch = !(m <= 1.0);
    return m;
  }
  double tolerance_at(double expected, double token_scale, double slack = 0.0) const {
    return j.tolerance.atol * token_scale + j.quantum * j.framework_scale + slack +
           j.tolerance.rtol * std::fabs(expected);
  }
};

}  // namespace lossverify
