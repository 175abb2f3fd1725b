#include "lossverify/kinds/cross_entropy/cross_entropy_protocol.hpp"

#include <cmath>
#include <limits>

#include "lossverify/core/dtype.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"

namespace lossverify {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The smoothing sum of the forward: global, shard-local, or rebuilt from sum log(exp(x - M) / S).
std::vector<float> forward_smoothing_sums(const Case& c, const BugSwitches& bugs, RankGroups& groups,
                                          std::int64_t shard_width, CrossEntropyShard& shard,
                                          std::span<const float> row_max, std::span<const float> sum_exp,
                                          std::span<const float> log_sum, std::span<const float> sum_shifted,
                                          std::span<const float> local_sum_shifted) {
  const auto n = row_max.size();
  std::vector<float> smoothing_sum(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    smoothing_sum[i] = bugs.smoothing_sum_local_forward ? local_sum_shifted[i] : sum_shifted[i];
  }
  if (!bugs.smoothing_log_after_exp) return smoothing_sum;
  std::vector<float> sum_log_p(n, 0.0f);
  shard.sum_log_p(row_max, sum_exp, sum_log_p);
  if (!bugs.smoothing_sum_local_forward) groups.tp.allreduce_sum(sum_log_p);
  const auto terms = static_cast<float>(bugs.smoothing_sum_local_forward ? shard_width : c.shape.vocab);
  for (std::size_t i = 0; i < n; ++i) smoothing_sum[i] = sum_log_p[i] + terms * log_sum[i];
  return smoothing_sum;
}

// The 16-bit control's token loss (docs/checks.md, "The control band"): -lp_y = r(lse - x_y), the smoothing
// term -sum_v lp_v rounded, each product with its weight and their sum rounded, plus r(w_z r(lse)^2).
float row_loss_in_dtype(DType dtype, float log_sum, float target_shifted, float smoothing_sum, float vocab,
                        SmoothingWeights<float> q, float z_weight, float lse) {
  const auto r = [dtype](float v) { return static_cast<float>(round_to_dtype(v, dtype)); };
  const float nll = r(log_sum - target_shifted);
  float loss = nll;
  if (q.off_target != 0.0f) {
    const float smooth = r(vocab * log_sum - smoothing_sum);
    loss = r(r((q.on_target - q.off_target) * nll) + r(q.off_target * smooth));
  }
  if (z_weight != 0.0f) loss = r(loss + r(z_weight * r(lse) * r(lse)));
  return loss;
}

}  // namespace

void cross_entropy_protocol(const Case& c, const BugSwitches& bugs, const RankPlan& plan, RankGroups& groups,
                            std::int64_t begin, std::int64_t n, std::int64_t shard_width, CrossEntropyShard& shard,
                            std::vector<float>& token_loss) {
  const auto rows = static_cast<std::size_t>(n);
  const bool smoothing = cross_entropy_options(c.loss).label_smoothing > 0.0;
  std::vector<float> row_max(rows, bugs.no_max_shift ? 0.0f : kNegInf);
  std::vector<float> log_sum(rows, 0.0f);
  // [S | x_l - M | sum(x - M)]: the last part travels only with label smoothing.
  std::vector<float> packed(3 * rows, 0.0f);
  const std::span<float> sum_exp(packed.data(), rows);
  const std::span<float> target_shifted(packed.data() + rows, rows);
  const std::span<float> sum_shifted(packed.data() + 2 * rows, rows);
  std::vector<float> local_sum_shifted;
  if (shard.fused_pass(row_max, log_sum, target_shifted, sum_shifted)) {
    // One rank holds the whole rows: the sums are already global.
    local_sum_shifted.assign(sum_shifted.begin(), sum_shifted.end());
    for (std::size_t i = 0; i < rows; ++i) sum_exp[i] = std::exp(log_sum[i]);
  } else {
    if (!bugs.no_max_shift) {
      shard.local_max(row_max);
      groups.tp.allreduce_max(row_max);
    }
    shard.shifted_sums(row_max, sum_exp, target_shifted, sum_shifted);
    if (smoothing) local_sum_shifted.assign(sum_shifted.begin(), sum_shifted.end());
    groups.tp.allreduce_sum(std::span<float>(packed.data(), (smoothing ? 3 : 2) * rows));
    for (std::size_t i = 0; i < rows; ++i) {
      if (plan.row(begin + static_cast<std::int64_t>(i)).active) log_sum[i] = std::log(sum_exp[i]);
    }
  }
  std::vector<float> smoothing_sum;
  if (smoothing) {
    smoothing_sum = forward_smoothing_sums(c, bugs, groups, shard_width, shard, row_max, sum_exp, log_sum, sum_shifted,
                                           local_sum_shifted);
  }
  const auto width = static_cast<float>(shard_width);
  const SmoothingPair q = smoothing_for(c, bugs, width);
  const auto z_weight = static_cast<float>(cross_entropy_options(c.loss).z_loss_weight);
  const bool in_dtype = bugs.compute_in_input_dtype && c.inputs.dtype != DType::fp32;
  for (std::size_t i = 0; i < rows; ++i) {
    const RowPlan& p = plan.row(begin + static_cast<std::int64_t>(i));
    if (!p.active) continue;
    if (in_dtype && p.valid) {
      token_loss[static_cast<std::size_t>(begin) + i] =
          row_loss_in_dtype(c.inputs.dtype, log_sum[i], target_shifted[i], smoothing ? smoothing_sum[i] : 0.0f,
                            static_cast<float>(c.shape.vocab), q.forward, z_weight, row_max[i] + log_sum[i]);
      continue;
    }
    token_loss[static_cast<std::size_t>(begin) + i] = cross_entropy_row_loss(
        p, row_max[i], log_sum[i], target_shifted[i], smoothing ? smoothing_sum[i] : 0.0f,
        local_sum_shifted.empty() ? 0.0f : local_sum_shifted[i], width, q.forward, z_weight, bugs);
  }
  shard.gradient(row_max, log_sum);
}

}  // namespace lossverify
