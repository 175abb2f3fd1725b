#pragma once
// The float64 reference's row primitives, vectorized: exp over a block (a branch-free polynomial the compiler
// vectorizes, std::exp outside its interval), and compensated sums kept in kLanes independent lanes.
//
// Each lane accumulates with TwoSum (Knuth), which captures every addition's rounding error exactly, in
// any instruction set; the lanes are combined in lane order at the end. The result is a value + error
// pair, as CompensatedSum gives, and depends only on the terms and their order, never on threads.
#include <array>
#include <cstddef>
#include <span>
#include <utility>

namespace lossverify::row_sums {

inline constexpr std::size_t kLanes = 8;
inline constexpr std::size_t kBlock = 512;  // doubles per block: one block of exp results lives on the stack

class LaneSum {
 public:
  // Adds terms[0..n) in lane order: term i goes to lane i % kLanes (n a multiple of kLanes but the last).
  void add(const double* terms, std::size_t n);
  // (sum, error): the lanes added up with their rounding errors, sum + error the compensated value.
  std::pair<double, double> result() const;

 private:
  std::array<double, kLanes> sum_{};
  std::array<double, kLanes> error_{};
  std::size_t next_lane_ = 0;  // a tail shorter than kLanes continues in this lane
};

// out[i] = exp(in[i]) for i < n <= kBlock.
void exp_block(const double* in, double* out, std::size_t n);

// max over the values of z * scale (-inf for an empty z; NaNs are skipped as std::max skips them).
double scaled_max(std::span<const double> z, double scale);

// sum_v exp(z_v * scale - shift), compensated.
std::pair<double, double> sum_exp(std::span<const double> z, double scale, double shift);

// sum_v w_v z_v with w_v = off for every v but `special` (an index into z, or -1 for none), where it is
// `on`: the target-weighted sum of cross-entropy, compensated.
std::pair<double, double> weighted_sum(std::span<const double> z, double off, double on, std::ptrdiff_t special);

}  // namespace lossverify::row_sums
