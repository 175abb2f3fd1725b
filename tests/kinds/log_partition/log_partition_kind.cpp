// The log-partition kind: case section (no settings of its own), inputs (logits only), the CPU sharded
// implementation with its collective protocol, one catalogued bug, and the float64 reference.
#include "log_partition_kind.hpp"

#include <cmath>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

namespace lossverify::testing {

namespace {

constexpr std::uint64_t kLocalSumBit = 1;

// The reference, from the definition: l = lse(x), d l / d x_v = p_v, sum_v p_v = 1.
class LogPartitionReference final : public KindReference {
 public:
  RowPartial partial(std::int64_t, std::int64_t, std::span<const double> logits,
                     std::span<const double>) const override {
    RowPartial p;
    p.max = row_sums::scaled_max(logits, 1.0);
    std::tie(p.sum_exp, p.sum_exp_error) = row_sums::sum_exp(logits, 1.0, p.max);
    return p;
  }
  RowStats stats(const RowPartial& total) const override {
    CompensatedSum s;
    s.add(total.sum_exp);
    s.add(total.sum_exp_error);
    return RowStats{total.max + std::log(s.value()), 0.0, 0.0};
  }
  double token_loss(std::int64_t, const RowStats& s) const override { return s.lse; }
  void gradient(std::int64_t, const RowStats& s, double weight, std::int64_t, std::span<const double> logits,
                std::span<const double>, std::span<double> grad) const override {
    for (std::size_t v = 0; v < logits.size(); ++v) grad[v] = weight * std::exp(logits[v] - s.lse);
  }
  std::optional<double> gradient_row_sum(const RowStats&, double weight) const override { return weight; }
};

// One micro-batch on the CPU: M = allreduce_max(local max), S = allreduce_sum(local sum exp(x - M)),
// l = M + log S, gradient w exp(x - M - log S). The bug leaves S (and M) the shard's own.
template <class T>
void run_micro_batch(const CpuMicroBatch& mb) {
  const bool local = (mb.bugs.kind_switches & kLocalSumBit) != 0;
  const std::int64_t cols = mb.work.size();
  const T* x = reinterpret_cast<const T*>(mb.logits) + mb.begin * cols;
  T* g = reinterpret_cast<T*>(mb.grad) + mb.begin * cols;
  const auto n = static_cast<std::size_t>(mb.n);
  auto active = [&](std::size_t i) { return mb.plan.row(mb.begin + static_cast<std::int64_t>(i)).active; };
  std::vector<float> max(n, -std::numeric_limits<float>::infinity());
  for (std::size_t i = 0; i < n; ++i) {
    beat_row(mb.beacon, static_cast<std::int64_t>(i));
    if (!active(i)) continue;
    for (std::int64_t v = 0; v < cols; ++v) max[i] = std::fmax(max[i], static_cast<float>(x[i * cols + v]));
  }
  if (!local) mb.groups.tp.allreduce_max(max);
  std::vector<float> sum(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    if (!active(i)) continue;
    for (std::int64_t v = 0; v < cols; ++v) sum[i] += std::exp(static_cast<float>(x[i * cols + v]) - max[i]);
  }
  if (!local) mb.groups.tp.allreduce_sum(sum);
  for (std::size_t i = 0; i < n; ++i) {
    const RowPlan& p = mb.plan.row(mb.begin + static_cast<std::int64_t>(i));
    if (!p.active) continue;
    const float log_sum = std::log(sum[i]);
    mb.token_loss[static_cast<std::size_t>(mb.begin) + i] = max[i] + log_sum;
    for (std::int64_t v = 0; v < cols; ++v) {
      const float probability = std::exp((static_cast<float>(x[i * cols + v]) - max[i]) - log_sum);
      g[i * cols + v] = T(p.backward_weight * probability);
    }
  }
}

class LogPartitionKind final : public LossKind {
 public:
  std::string_view name() const override { return kLogPartition; }
  std::string_view summary() const override { return "log sum_v exp(x_v) (a test kind): reduction, upstream_weights"; }
  KindInputs inputs() const override { return {false, false}; }
  std::string row_sum_rule() const override { return "sum_v grad = w_t for every token"; }
  std::vector<Implementation> catalogue() const override {
    return {catalogued_bug(kLogPartitionLocalSum, "the shard's own log-sum-exp: no TP all-reduce", "tests/kinds",
                           "loss and gradient wrong for TP > 1 only", {"loss", "grad"}, Applies::kind(kLogPartition),
                           switches_with([](BugSwitches& b) { b.kind_switches = kLocalSumBit; }))};
  }
  std::unique_ptr<KindReference> reference(const Case&, const InputSource&) const override {
    return std::make_unique<LogPartitionReference>();
  }
  void cpu_micro_batch(const CpuMicroBatch& batch) const override {
    dispatch_dtype(batch.dtype, [&](auto type) { run_micro_batch<typename decltype(type)::type>(batch); });
  }
};

}  // namespace

void register_log_partition() {
  static std::once_flag once;
  std::call_once(once, [] { register_loss_kind(std::make_unique<LogPartitionKind>()); });
}

}  // namespace lossverify::testing
