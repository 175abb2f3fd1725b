#pragma once
// The arithmetic of one element's judgement (docs/spec.md §6), written once for the host (checks/element_judge.hpp,
// core/dtype.cpp) and the GPU oracle's compare kernel (oracle/cuda/reference_kernels.cu): an error's margin against
// a tolerance, the spacing of a stored format at a value, and the two rules that combine them. The GPU kernel adds
// only when to evaluate them (it skips a branch whose result cannot change the row's worst element or a mismatch).
#include <cstdint>
#include <cstring>

#include "lossverify/core/host_device.hpp"

namespace lossverify::element_rule {

// Functions rather than constants: device code reads no host variable.
LV_HOST_DEVICE double infinity() { return __builtin_huge_val(); }
LV_HOST_DEVICE bool finite(double value) {
  return value == value && value <= 1.7976931348623157e308 && value >= -1.7976931348623157e308;
}

// A stored format by its mantissa bits and its smallest normal binary exponent.
struct Format {
  int mantissa_bits;
  int min_exponent;
};
LV_HOST_DEVICE Format fp32_format() { return {23, -126}; }
LV_HOST_DEVICE Format bf16_format() { return {7, -126}; }
LV_HOST_DEVICE Format fp16_format() { return {10, -14}; }

LV_HOST_DEVICE std::uint64_t bits_of(double value) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(value));
#else
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

LV_HOST_DEVICE double power_of_two(int exponent) {  // 2^exponent, for exponents of normal doubles
  const std::uint64_t bits = static_cast<std::uint64_t>(exponent + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double value = 0.0;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// error / tolerance: 0 for an exact value (equal infinities included), +inf for a NaN error, for a zero tolerance
// that is exceeded, and for any error against a tolerance that is not finite (nothing to judge against). Never NaN.
LV_HOST_DEVICE double margin(double error, double tolerance) {
  if (!(error == error)) return infinity();
  if (error == 0.0) return 0.0;
  if (!(tolerance > 0.0) || !finite(tolerance)) return infinity();
  return error / tolerance;
}

// The binary exponent of the format's spacing at `value` (its binade's, or the subnormal spacing below the normal
// range; subnormal doubles fall below every format's normal range anyway).
LV_HOST_DEVICE int spacing_exponent(double value, Format format) {
  const int exponent = static_cast<int>((bits_of(value) >> 52) & 0x7ff) - 1023;
  return (exponent > format.min_exponent ? exponent : format.min_exponent) - format.mantissa_bits;
}
LV_HOST_DEVICE double spacing(double value, Format format) { return power_of_two(spacing_exponent(value, format)); }
// 1 / spacing: a power of two, so multiplying by it is the exact division.
LV_HOST_DEVICE double inverse_spacing(double value, Format format) {
  return power_of_two(-spacing_exponent(value, format));
}

// The tolerance rule (float32 outputs): |got - expected| against floor + rtol |expected|.
LV_HOST_DEVICE double tolerance_margin(double error, double floor, double rtol, double expected) {
  return margin(error, floor + rtol * (expected < 0.0 ? -expected : expected));
}

// The ULP rule (16-bit outputs): the smaller of the local error in units of max_ulp spacings of the format at the
// local expected value, and the effective error against the absolute floor; only an exact value passes where the
// reference is not finite or either reading is NaN.
LV_HOST_DEVICE double by_ulp(double local_error, double local_spacing, int max_ulp) {
  return local_error / (max_ulp * local_spacing);
}
LV_HOST_DEVICE double ulp_margin(double in_ulps, double by_floor, double error, double expected) {
  const double m = by_floor < in_ulps ? by_floor : in_ulps;
  if (finite(expected) && m == m) return m;
  return error == 0.0 ? 0.0 : infinity();
}

}  // namespace lossverify::element_rule
