// What the example CPU plugin's losses share (cpu_cross_entropy.cpp, cpu_policy.cpp): the element types, read
// as float32 and written back rounded to nearest even, a compensated sum, and the shapes of a rank's rows.
#pragma once

#include <lossverify/plugin.h>

#include "plugin_common.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace lossverify_example::cpu {

// ---- Element types ------------------------------------------------------------------------------
// Computation is float32 whatever the input dtype; gradients are written back in it, rounded to nearest even.

struct Bf16 {
  std::uint16_t bits;
};
struct Fp16 {
  std::uint16_t bits;
};

inline float widen(float x) { return x; }
// bf16 is the upper half of a float32.
inline float widen(Bf16 x) { return std::bit_cast<float>(static_cast<std::uint32_t>(x.bits) << 16); }
// fp16 by hand (not every compiler has _Float16): sign, 5 exponent bits biased by 15, 10 mantissa bits.
// Both directions go through an exact integer multiple of the format's quantum, 2^(max(E,1) - 25).
inline float widen(Fp16 x) {
  const int exponent = (x.bits >> 10) & 0x1F;
  const int mantissa = x.bits & 0x3FF;
  float magnitude = std::numeric_limits<float>::infinity();
  if (exponent == 0x1F && mantissa != 0) magnitude = std::numeric_limits<float>::quiet_NaN();
  if (exponent < 0x1F) {
    const int significand = exponent == 0 ? mantissa : mantissa | 0x400;  // subnormals lack the implicit 1
    magnitude = std::ldexp(static_cast<float>(significand), std::max(exponent, 1) - 25);
  }
  return (x.bits & 0x8000) != 0 ? -magnitude : magnitude;
}

template <class T>
T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline Bf16 narrow<Bf16>(float x) {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  // Truncating a NaN could leave an infinity: keep it a (quiet) NaN.
  if (std::isnan(x)) return Bf16{static_cast<std::uint16_t>((bits >> 16) | 0x0040u)};
  // Round to nearest, ties to the even upper half; a carry into the exponent is right (to inf too).
  const std::uint32_t bias = 0x7FFFu + ((bits >> 16) & 1u);
  return Bf16{static_cast<std::uint16_t>((bits + bias) >> 16)};
}
template <>
inline Fp16 narrow<Fp16>(float x) {
  const auto sign = static_cast<std::uint16_t>((std::bit_cast<std::uint32_t>(x) >> 16) & 0x8000u);
  const float magnitude = std::fabs(x);
  if (std::isnan(x)) return Fp16{static_cast<std::uint16_t>(sign | 0x7E00u)};
  // 65520 lies halfway between the largest half, 65504, and 2^16: ties to even round it up to infinity.
  if (!(magnitude < 65520.0f)) return Fp16{static_cast<std::uint16_t>(sign | 0x7C00u)};
  if (magnitude == 0.0f) return Fp16{sign};
  int binary_exponent = 0;  // magnitude = f 2^binary_exponent, f in [0.5, 1)
  std::frexp(magnitude, &binary_exponent);
  const int biased = std::max(binary_exponent + 14, 1);  // subnormals share exponent 1's quantum
  // nearbyint rounds to nearest even (the default mode); a carry to 2048 lands on the next exponent.
  const auto units = static_cast<int>(std::nearbyint(std::ldexp(magnitude, 25 - biased)));
  return Fp16{static_cast<std::uint16_t>(sign | ((biased - 1) * 1024 + units))};
}

// In host memory, the all-reduces work on vectors.
template <class T>
void allreduce(const Collectives& comm, lv_group group, std::vector<T>& data, lv_reduce_op op) {
  comm.allreduce(group, data.data(), static_cast<std::int64_t>(data.size()), op);
}

// Kahan-compensated float32 sum: rows of tens of thousands of columns stay within a few roundings.
class CompensatedSum {
 public:
  void add(float x) {
    const float y = x - carry_;
    const float t = sum_ + y;
    carry_ = (t - sum_) - y;
    sum_ = t;
  }
  float value() const { return sum_; }

 private:
  float sum_ = 0.0f;
  float carry_ = 0.0f;
};

// A micro-batch: rows [begin, end) of the rank.
struct RowRange {
  std::int64_t begin, end;
  std::int64_t size() const { return end - begin; }
};

// A row-major rows x width matrix in the input dtype.
template <class T>
struct Matrix {
  const T* data;
  std::int64_t width;
  const T* row(std::int64_t i) const { return data + i * width; }
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Masked, ignored and CP padding rows: loss 0 and an exactly zero gradient, written rather than assumed.
template <class T>
void zero_rows_that_do_not_count(const BatchPlan& plan, lv_rank_outputs& out, std::int64_t width) {
  T* grad = static_cast<T*>(out.grad);
  for (std::size_t row = 0; row < plan.rows.size(); ++row) {
    if (plan.rows[row].valid) continue;
    out.token_loss[row] = 0.0f;
    std::fill(grad + static_cast<std::int64_t>(row) * width, grad + static_cast<std::int64_t>(row + 1) * width,
              narrow<T>(0.0f));
  }
}

}  // namespace lossverify_example::cpu
