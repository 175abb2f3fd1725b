#include "lossverify/kinds/kd/kd_protocol.hpp"

#include <cmath>
#include <limits>

#include "lossverify/core/dtype.hpp"

namespace lossverify {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

void kd_protocol(const Case& c, const BugSwitches& bugs, const RankPlan& plan, RankGroups& groups, std::int64_t begin,
                 std::int64_t n, KdShard& shard, std::vector<float>& token_loss) {
  const auto rows = static_cast<std::size_t>(n);
  auto active = [&](std::size_t i) { return plan.row(begin + static_cast<std::int64_t>(i)).active; };
  const KdScales scales = kd_scales(c.loss, bugs, c.layout.tp);
  // 1. Student and teacher maxima in one all-reduce: [M_a | M_b].
  std::vector<float> maxima(2 * rows, kNegInf);
  shard.local_maxima(maxima);
  if (!bugs.kd_local_softmax) groups.tp.allreduce_max(maxima);
  // 2. One packed all-reduce: [S_a | S_b | W (| U)]; under kd-local-softmax each shard's own KL instead.
  const bool cross_entropy_value = bugs.kd_cross_entropy_value;
  std::vector<float> packed((cross_entropy_value ? 4 : 3) * rows, 0.0f);
  shard.shifted_sums(maxima, packed);
  std::vector<float> divergence(rows, 0.0f);
  if (bugs.kd_local_softmax) {
    for (std::size_t i = 0; i < rows; ++i) {
      if (!active(i)) continue;
      divergence[i] = kl_from_sums(packed[i], packed[rows + i], packed[2 * rows + i], maxima[i], maxima[rows + i]);
    }
    groups.tp.allreduce_sum(divergence);
  } else {
    groups.tp.allreduce_sum(packed);
  }
  // 3. Per-token loss, and the two lse and the weight the gradient needs.
  const bool in_dtype = bugs.compute_in_input_dtype && c.inputs.dtype != DType::fp32;
  std::vector<float> lse_a(rows, 0.0f);
  std::vector<float> lse_b(rows, 0.0f);
  std::vector<float> weight(rows, 0.0f);
  for (std::size_t i = 0; i < rows; ++i) {
    const RowPlan& p = plan.row(begin + static_cast<std::int64_t>(i));
    if (!p.active) continue;
    lse_a[i] = maxima[i] + std::log(packed[i]);
    lse_b[i] = maxima[rows + i] + std::log(packed[rows + i]);
    const float value = kd_row_value(packed[i], packed[rows + i], packed[2 * rows + i],
                                     cross_entropy_value ? packed[3 * rows + i] : 0.0f, maxima[i], maxima[rows + i],
                                     divergence[i], bugs);
    token_loss[static_cast<std::size_t>(begin) + i] = scales.loss * value;
    if (in_dtype) {  // the 16-bit control: the per-token KL and its product with T^s, each rounded
      const float kl = static_cast<float>(round_to_dtype(value, c.inputs.dtype));
      token_loss[static_cast<std::size_t>(begin) + i] =
          static_cast<float>(round_to_dtype(scales.loss * kl, c.inputs.dtype));
    }
    weight[i] = p.backward_weight * scales.grad;
  }
  // 4. Gradient T^(s-1) (Q - P) of the shard's columns.
  shard.gradient(lse_a, lse_b, weight);
}

}  // namespace lossverify
