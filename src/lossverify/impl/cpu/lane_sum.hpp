#pragma once
// The CPU kernels' float32 row sums.
#include <cstdint>

namespace lossverify {

// Sum of f(v) for v in [0, n) with 8 independent float32 lanes (vectorizable, shallow error growth).
template <class F>
inline float lane_sum(std::int64_t n, F f) {
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) lanes[k] += f(i + k);
  }
  for (int k = 0; i < n; ++i, ++k) lanes[k] += f(i);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

}  // namespace lossverify
