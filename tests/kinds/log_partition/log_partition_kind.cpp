// The log-partition kind: case section (its one setting, the sharpness beta), inputs (logits only), the CPU sharded
// implementation with its collective protocol, two catalogued bugs, and the float64 reference.
#include "log_partition_kind.hpp"

#include <cmath>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
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
constexpr std::uint64_t kNoInverseSharpnessBit = 2;

struct LogPartitionOptions final : KindOptions {
  double sharpness = 1.0;  // beta: l = (1 / beta) log sum_v exp(beta x_v)
};
double sharpness(const LossSpec& loss) { return options_of<LogPartitionOptions>(loss).sharpness; }

// The reference, from the definition: l = lse(beta x) / beta, d l / d x_v = p_v = softmax(beta x)_v, sum_v p_v = 1.
class LogPartitionReference final : public KindReference {
 public:
  explicit LogPartitionReference(double beta) : beta_(beta) {}
  RowPartial partial(std::int64_t, std::int64_t, std::span<const double> logits,
                     std::span<const double>) const override {
    RowPartial p;
    p.max = row_sums::scaled_max(logits, beta_);
    std::tie(p.sum_exp, p.sum_exp_error) = row_sums::sum_exp(logits, beta_, p.max);
    return p;
  }
  RowStats stats(const RowPartial& total) const override {
    CompensatedSum s;
    s.add(total.sum_exp);
    s.add(total.sum_exp_error);
    return RowStats{total.max + std::log(s.value()), 0.0, 0.0};
  }
  double token_loss(std::int64_t, const RowStats& s) const override { return s.lse / beta_; }
  void gradient(std::int64_t, const RowStats& s, double weight, std::int64_t, std::span<const double> logits,
                std::span<const double>, std::span<double> grad) const override {
    for (std::size_t v = 0; v < logits.size(); ++v) grad[v] = weight * std::exp(beta_ * logits[v] - s.lse);
  }
  std::optional<double> gradient_row_sum(const RowStats&, double weight) const override { return weight; }

 private:
  double beta_;
};

// One micro-batch on the CPU, over z = beta x: M = allreduce_max(local max z), S = allreduce_sum(local sum exp(z - M)),
// l = (M + log S) / beta, gradient w exp(z - M - log S). The bugs leave S (and M) the shard's own, or l unscaled.
template <class T>
void run_micro_batch(const CpuMicroBatch& mb) {
  const bool local = (mb.bugs.kind_switches & kLocalSumBit) != 0;
  const bool unscaled = (mb.bugs.kind_switches & kNoInverseSharpnessBit) != 0;
  const auto beta = static_cast<float>(sharpness(mb.c.loss));
  const std::int64_t cols = mb.work.size();
  const T* x = reinterpret_cast<const T*>(mb.logits) + mb.begin * cols;
  T* g = reinterpret_cast<T*>(mb.grad) + mb.begin * cols;
  const auto n = static_cast<std::size_t>(mb.n);
  auto active = [&](std::size_t i) { return mb.plan.row(mb.begin + static_cast<std::int64_t>(i)).active; };
  std::vector<float> max(n, -std::numeric_limits<float>::infinity());
  for (std::size_t i = 0; i < n; ++i) {
    beat_row(mb.beacon, static_cast<std::int64_t>(i));
    if (!active(i)) continue;
    for (std::int64_t v = 0; v < cols; ++v) max[i] = std::fmax(max[i], beta * static_cast<float>(x[i * cols + v]));
  }
  if (!local) mb.groups.tp.allreduce_max(max);
  std::vector<float> sum(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    if (!active(i)) continue;
    for (std::int64_t v = 0; v < cols; ++v) sum[i] += std::exp(beta * static_cast<float>(x[i * cols + v]) - max[i]);
  }
  if (!local) mb.groups.tp.allreduce_sum(sum);
  for (std::size_t i = 0; i < n; ++i) {
    const RowPlan& p = mb.plan.row(mb.begin + static_cast<std::int64_t>(i));
    if (!p.active) continue;
    const float log_sum = std::log(sum[i]);
    mb.token_loss[static_cast<std::size_t>(mb.begin) + i] = unscaled ? max[i] + log_sum : (max[i] + log_sum) / beta;
    for (std::int64_t v = 0; v < cols; ++v) {
      const float probability = std::exp((beta * static_cast<float>(x[i * cols + v]) - max[i]) - log_sum);
      g[i * cols + v] = T(p.backward_weight * probability);
    }
  }
}

class LogPartitionKind final : public LossKind {
 public:
  std::string_view name() const override { return kLogPartition; }
  std::string_view summary() const override {
    return "(1 / beta) log sum_v exp(beta x_v) (a test kind): reduction, upstream_weights";
  }
  const SettingTable& settings() const override {
    static const SettingTable table = {number_setting("sharpness", &LogPartitionOptions::sharpness, 1.0)
                                           .range(0.0, 100.0, true, false)
                                           .described("beta: l = (1 / beta) log sum_v exp(beta x_v)")
                                           .shrinks_as("sharpness 1")};
    return table;
  }
  KindInputs inputs() const override { return {false, false}; }
  std::string row_sum_rule() const override { return "sum_v grad = w_t for every token"; }
  std::vector<Implementation> catalogue() const override {
    return {catalogued_bug(kLogPartitionLocalSum, "the shard's own log-sum-exp: no TP all-reduce", "tests/kinds",
                           "loss and gradient wrong for TP > 1 only", {"loss", "grad"}, Applies::kind(kLogPartition),
                           switches_with([](BugSwitches& b) { b.kind_switches = kLocalSumBit; })),
            catalogued_bug(kLogPartitionNoInverseSharpness, "the loss's 1 / beta left out: lse(beta x)", "tests/kinds",
                           "loss x beta where beta != 1; the gradient is right", {"loss"}, Applies::kind(kLogPartition),
                           switches_with([](BugSwitches& b) { b.kind_switches = kNoInverseSharpnessBit; }))};
  }
  std::unique_ptr<KindReference> reference(const Case& c, const InputSource&) const override {
    return std::make_unique<LogPartitionReference>(sharpness(c.loss));
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
