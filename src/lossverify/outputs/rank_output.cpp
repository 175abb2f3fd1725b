#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

double RankOutput::grad_at(std::int64_t row, std::int64_t column) const {
  const auto index = static_cast<std::size_t>(row * columns() + (column - assignment.vocab.begin));
  switch (dtype) {
    case DType::bf16:
      return static_cast<double>(static_cast<float>(reinterpret_cast<const Eigen::bfloat16*>(grad.data())[index]));
    case DType::fp16:
      return static_cast<double>(static_cast<float>(reinterpret_cast<const Eigen::half*>(grad.data())[index]));
    case DType::fp32:
    default:
      return static_cast<double>(reinterpret_cast<const float*>(grad.data())[index]);
  }
}

void RankOutput::grad_row(std::int64_t row, double* out) const {
  const std::int64_t n = columns();
  dispatch_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    const T* g = reinterpret_cast<const T*>(grad.data()) + row * n;
    for (std::int64_t v = 0; v < n; ++v) out[v] = static_cast<double>(static_cast<float>(g[v]));
  });
}

}  // namespace lossverify
