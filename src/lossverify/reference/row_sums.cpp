#include "lossverify/reference/row_sums.hpp"

// GCC 12 warns falsely inside its own AVX-512 intrinsics (the undefined vectors they start from) when Eigen's
// packets are built for AVX-512.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify::row_sums {

namespace {

using Lanes = Eigen::Array<double, kLanes, 1>;

// exp(x) for x in [kPolyLow, kPolyHigh], branch-free so that the compiler vectorizes it for the target's
// instruction set: x = k ln 2 + r with |r| <= ln(2)/2 (Cody and Waite's two-part ln 2, k * kLn2Hi exact),
// exp(r) by its Taylor polynomial to degree 13 (truncation below 1e-17 relative), the low terms by Horner
// and the high ones in pairs, then the exponent k added to the bits. Within 1.2 ulp of exp (tested against
// MPFR in tests/unit/test_reference_accuracy.cpp). Outside the interval (subnormal or zero results,
// overflow, NaN) std::exp answers instead.
constexpr double kPolyLow = -708.0;
constexpr double kPolyHigh = 709.0;

inline double polynomial_exp(double x) {
  constexpr double kInvLn2 = 1.4426950408889634074;
  constexpr double kShifter = 0x1.8p52;  // x / ln 2 + kShifter rounds to an integer k in the low bits
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double c[14] = {
      1.0,        1.0,         1.0 / 2,      1.0 / 6,       1.0 / 24,       1.0 / 120,       1.0 / 720,
      1.0 / 5040, 1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800};
  const double shifted = x * kInvLn2 + kShifter;
  const double k = shifted - kShifter;
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  const double r2 = r * r;
  const double r4 = r2 * r2;
  const double high = (c[4] + r * c[5]) + r2 * (c[6] + r * c[7]) +
                      r4 * ((c[8] + r * c[9]) + r2 * (c[10] + r * c[11]) + r4 * (c[12] + r * c[13]));
  const double exp_r = c[0] + r * (c[1] + r * (c[2] + r * (c[3] + r * high)));
  const auto k_bits = std::bit_cast<std::uint64_t>(shifted) - std::bit_cast<std::uint64_t>(kShifter);  // k
  return exp_r * std::bit_cast<double>((k_bits + 1023) << 52);                                         // * 2^k
}

}  // namespace

void LaneSum::add(const double* terms, std::size_t n) {
  std::size_t i = 0;
  // Scalar until the lanes line up again after a short tail.
  auto add_one = [&](double x) {
    double& s = sum_[next_lane_];
    const double t = s + x;
    const double back = t - s;
    error_[next_lane_] += (s - (t - back)) + (x - back);
    s = t;
    next_lane_ = (next_lane_ + 1) % kLanes;
  };
  for (; i < n && next_lane_ != 0; ++i) add_one(terms[i]);
  Lanes s = Eigen::Map<const Lanes>(sum_.data());
  Lanes e = Eigen::Map<const Lanes>(error_.data());
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes x = Eigen::Map<const Lanes>(terms + i);
    const Lanes t = s + x;
    const Lanes back = t - s;
    e += (s - (t - back)) + (x - back);
    s = t;
  }
  Eigen::Map<Lanes>(sum_.data()) = s;
  Eigen::Map<Lanes>(error_.data()) = e;
  for (; i < n; ++i) add_one(terms[i]);
}

std::pair<double, double> LaneSum::result() const {
  CompensatedSum total;
  double lane_errors = 0.0;
  for (std::size_t l = 0; l < kLanes; ++l) {
    total.add(sum_[l]);
    lane_errors += error_[l];
  }
  return {total.sum(), total.error() + lane_errors};
}

void exp_block(const double* in, double* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = polynomial_exp(in[i]);
  int outside = 0;
  for (std::size_t i = 0; i < n; ++i) outside |= !(in[i] >= kPolyLow) | (in[i] > kPolyHigh);
  if (outside == 0) return;
  for (std::size_t i = 0; i < n; ++i) {
    if (!(in[i] >= kPolyLow) || in[i] > kPolyHigh) out[i] = std::exp(in[i]);
  }
}

double scaled_max(std::span<const double> z, double scale) {
  constexpr double kNone = -std::numeric_limits<double>::infinity();
  std::array<double, kLanes> lane{};
  lane.fill(kNone);
  std::size_t i = 0;
  for (; i + kLanes <= z.size(); i += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], z[i + l] * scale);
  }
  double max = kNone;
  for (; i < z.size(); ++i) max = std::max(max, z[i] * scale);
  for (double m : lane) max = std::max(max, m);
  return max;
}

std::pair<double, double> sum_exp(std::span<const double> z, double scale, double shift) {
  LaneSum sum;
  double shifted[kBlock];
  double terms[kBlock];
  for (std::size_t b = 0; b < z.size(); b += kBlock) {
    const std::size_t n = std::min(kBlock, z.size() - b);
    for (std::size_t i = 0; i < n; ++i) shifted[i] = z[b + i] * scale - shift;
    exp_block(shifted, terms, n);
    sum.add(terms, n);
  }
  return sum.result();
}

std::pair<double, double> weighted_sum(std::span<const double> z, double off, double on, std::ptrdiff_t special) {
  LaneSum sum;
  double terms[kBlock];
  for (std::size_t b = 0; b < z.size(); b += kBlock) {
    const std::size_t n = std::min(kBlock, z.size() - b);
    for (std::size_t i = 0; i < n; ++i) terms[i] = off * z[b + i];
    if (special >= 0 && static_cast<std::size_t>(special) >= b && static_cast<std::size_t>(special) < b + n) {
      terms[static_cast<std::size_t>(special) - b] = on * z[static_cast<std::size_t>(special)];
    }
    sum.add(terms, n);
  }
  return sum.result();
}

}  // namespace lossverify::row_sums
