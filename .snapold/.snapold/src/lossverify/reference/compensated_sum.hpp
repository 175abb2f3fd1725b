#pragma once
#include <cmath>

namespace lossverify {

// Neumaier's compensated summation: error independent of the number of terms to first order.
class CompensatedSum {
 public:
  void add(double x) {
    const double t = sum_ + x;
    if (std::fabs(sum_) >= std::fabs(x)) {
      compensation_ += (sum_ - t) + x;
    } else {
      compensation_ += (x - t) + sum_;
    }
    sum_ = t;
  }
  double value() const { return sum_ + compensation_; }
  // The running sum and its accumulated error term, for combining partial sums elsewhere.
  double sum() const { return sum_; }
  double error() const { return compensation_; }

 private:
  double sum_ = 0.0;
  double compensation_ = 0.0;
};

}  // namespace lossverify
