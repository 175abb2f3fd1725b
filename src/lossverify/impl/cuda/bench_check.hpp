#pragma once
// The benchmarks' correctness check: sampled rows of the timed kernel's gradient (rows x cols on the device)
// against the float64 reference of the same inputs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify::cuda::bench_check {

inline constexpr int kSampledRows = 32;

// The worst error beyond each row's absolute floor, in units of the dtype's spacing at the exact value, over
// kSampledRows rows spread over the batch. floor_of(row, token) is the row's floor (the grad atol in the
// units of the row's token scale).
template <class Floor>
double worst_ulp_beyond_floor(const void* grad, std::int64_t rows, std::int64_t cols, DType dtype,
                              const InputSource& inputs, const LossReference& reference, Floor floor_of) {
  const std::size_t element = dtype_size(dtype);
  std::vector<std::byte> host_grad(static_cast<std::size_t>(cols) * element);
  std::vector<double> x(static_cast<std::size_t>(cols)), expected(static_cast<std::size_t>(cols));
  double worst_ulp = 0.0;
  for (int s = 0; s < kSampledRows; ++s) {
    const std::int64_t row = (static_cast<std::int64_t>(s) * 7919) % rows;
    LV_CUDA(cudaMemcpy(host_grad.data(),
                       static_cast<const std::byte*>(grad) + static_cast<std::size_t>(row * cols) * element,
                       host_grad.size(), cudaMemcpyDeviceToHost));
    inputs.logits(row, 0, cols, x.data());
    const ReferenceToken token = reference.evaluate(row, x, {}, expected);
    const double floor = floor_of(row, token);
    dispatch_dtype(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* g = reinterpret_cast<const T*>(host_grad.data());
      for (std::int64_t col = 0; col < cols; ++col) {
        const double got = static_cast<double>(static_cast<float>(g[col]));
        const double e = expected[static_cast<std::size_t>(col)];
        const double err = std::fabs(got - e);
        if (err > floor) worst_ulp = std::max(worst_ulp, err / ulp_size(e, dtype));
      }
    });
  }
  return worst_ulp;
}

}  // namespace lossverify::cuda::bench_check
