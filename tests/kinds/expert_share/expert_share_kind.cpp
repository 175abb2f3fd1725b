// The expert-share sketch: its case section (no settings), its rows' plan (each scope's count, all-reduced over
// the scope before any gradient), the CPU micro-batch with the scope's collective, one catalogued bug and the
// float64 reference, which finds every scope from the layout itself.
#include "expert_share_kind.hpp"

#include <cmath>
#include <map>
#include <mutex>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

namespace lossverify::testing {

namespace {

constexpr std::uint64_t kLocalScopeBit = 1;

// The sum over a scope's ranks: CP always, TP where it splits the tokens.
template <class T>
void sum_over_scope(RankGroups& groups, const Case& c, std::span<T> values) {
  groups.cp.allreduce_sum(values);
  if (c.layout.sp) groups.tp.allreduce_sum(values);
}

// The reference, from the definition and the layout alone (it reads neither ranks nor plans): every scope's tokens,
// their mean softmax P_s in double, n_s and S.
class ExpertShareReference final : public KindReference {
 public:
  ExpertShareReference(const Case& c, const InputSource& inputs) : experts_(c.shape.vocab) {
    std::vector<double> row(static_cast<std::size_t>(experts_));
    std::vector<float> raw(row.size());
    for (int dp = 0; dp < c.layout.dp; ++dp) {
      for (int k = 0; k < c.layout.ga; ++k) {
        Scope scope;
        scope.mean.assign(row.size(), 0.0);
        for (const std::int64_t s : sequences_of_slot(inputs.batch(), c.batch, c.layout, dp, k)) {
          const Sequence& q = inputs.batch().sequences()[static_cast<std::size_t>(s)];
          for (std::int64_t t = q.begin; t < q.begin + q.length; ++t) {
            if (!inputs.is_valid(t)) continue;
            inputs.logits(t, 0, experts_, raw.data());
            for (std::size_t e = 0; e < row.size(); ++e) row[e] = raw[e];
            const double max = row_sums::scaled_max(row, 1.0);
            const auto [sum, error] = row_sums::sum_exp(row, 1.0, max);
            for (std::size_t e = 0; e < row.size(); ++e) scope.mean[e] += std::exp(row[e] - max) / (sum + error);
            scope_of_[t] = scopes_.size();
            ++scope.tokens;
          }
        }
        if (scope.tokens == 0) continue;
        for (double& m : scope.mean) m /= static_cast<double>(scope.tokens);
        scopes_.push_back(std::move(scope));
      }
    }
  }

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
  // <p_t, P_s> over the whole row (rows are whole: one slice).
  bool needs_value_pass() const override { return true; }
  std::pair<double, double> value_partial(std::int64_t token, const RowStats& s, std::span<const double> logits,
                                          std::span<const double>) const override {
    const std::vector<double>& mean = scope(token).mean;
    CompensatedSum dot;
    for (std::size_t e = 0; e < logits.size(); ++e) dot.add(std::exp(logits[e] - s.lse) * mean[e]);
    return {dot.value(), 0.0};
  }
  double token_loss(std::int64_t, const RowStats& s) const override { return static_cast<double>(experts_) * s.value; }
  std::optional<double> token_weight(std::int64_t token) const override {
    return 1.0 / (static_cast<double>(scopes_.size()) * static_cast<double>(scope(token).tokens));
  }
  // dL/dp_t = 2 w_t E P_s (P_s depends on p_t as much as the other factor does), through the softmax.
  void gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t, std::span<const double> logits,
                std::span<const double>, std::span<double> grad) const override {
    const std::vector<double>& mean = scope(token).mean;
    const double factor = 2.0 * weight * static_cast<double>(experts_);
    CompensatedSum inner;
    for (std::size_t e = 0; e < logits.size(); ++e) inner.add(std::exp(logits[e] - s.lse) * factor * mean[e]);
    for (std::size_t e = 0; e < logits.size(); ++e) {
      grad[e] = std::exp(logits[e] - s.lse) * (factor * mean[e] - inner.value());
    }
  }
  std::optional<double> gradient_row_sum(const RowStats&, double) const override { return 0.0; }

 private:
  struct Scope {
    std::vector<double> mean;
    std::int64_t tokens = 0;
  };
  const Scope& scope(std::int64_t token) const { return scopes_[scope_of_.at(token)]; }

  std::int64_t experts_;
  std::vector<Scope> scopes_;
  std::map<std::int64_t, std::size_t> scope_of_;
};

// Each scope's count over its ranks, and S over DP: the weights 1 / (S n_s), before any kernel runs.
KindRowPlan plan_scopes(const RowPlanRequest& r) {
  const auto& begin = r.assignment.micro_batch_begin;
  const std::size_t ga = begin.size() - 1;
  std::vector<double> counts(ga, 0.0);
  for (std::size_t k = 0; k < ga; ++k) {
    for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i) counts[k] += r.valid[static_cast<std::size_t>(i)];
  }
  sum_over_scope(r.groups, r.c, std::span<double>(counts));
  double scopes[1] = {0.0};
  for (double n : counts) scopes[0] += n > 0.0 ? 1.0 : 0.0;
  r.groups.dp.allreduce_sum(std::span<double>(scopes, 1));
  KindRowPlan plan;
  plan.weights = std::vector<double>(r.valid.size(), 0.0);
  for (std::size_t k = 0; k < ga; ++k) {
    for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i) {
      if (r.valid[static_cast<std::size_t>(i)])
        (*plan.weights)[static_cast<std::size_t>(i)] = 1.0 / (scopes[0] * counts[k]);
    }
  }
  return plan;
}

// One micro-batch (one scope's share): p_t, the scope's sums all-reduced before any gradient, l_t = E <p_t, P>,
// dL/dx_t = p_t (g - <p_t, g>) with g = 2 w E P. Float32.
void run_micro_batch(const CpuMicroBatch& mb) {
  const std::int64_t experts = mb.work.size();
  const auto e_count = static_cast<std::size_t>(experts);
  const float* x = reinterpret_cast<const float*>(mb.logits) + mb.begin * experts;
  float* g = reinterpret_cast<float*>(mb.grad) + mb.begin * experts;
  const auto n = static_cast<std::size_t>(mb.n);
  auto plan = [&](std::size_t i) -> const RowPlan& { return mb.plan.row(mb.begin + static_cast<std::int64_t>(i)); };
  std::vector<float> p(n * e_count, 0.0f);
  std::vector<float> scope(e_count + 1, 0.0f);  // sum of p over the scope's valid rows, and their count
  for (std::size_t i = 0; i < n; ++i) {
    beat_row(mb.beacon, static_cast<std::int64_t>(i));
    if (!plan(i).active) continue;
    float max = x[i * e_count];
    for (std::size_t e = 0; e < e_count; ++e) max = std::fmax(max, x[i * e_count + e]);
    float sum = 0.0f;
    for (std::size_t e = 0; e < e_count; ++e) sum += std::exp(x[i * e_count + e] - max);
    for (std::size_t e = 0; e < e_count; ++e) {
      p[i * e_count + e] = std::exp(x[i * e_count + e] - max) / sum;
      scope[e] += p[i * e_count + e];
    }
    scope[e_count] += 1.0f;
  }
  if ((mb.bugs.kind_switches & kLocalScopeBit) == 0) sum_over_scope(mb.groups, mb.c, std::span<float>(scope));
  const float count = std::fmax(scope[e_count], 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    if (!plan(i).active) continue;
    const float* pi = &p[i * e_count];
    const float factor = 2.0f * plan(i).backward_weight * static_cast<float>(experts);
    float dot = 0.0f, inner = 0.0f;
    for (std::size_t e = 0; e < e_count; ++e) {
      dot += pi[e] * (scope[e] / count);
      inner += pi[e] * factor * (scope[e] / count);
    }
    mb.token_loss[static_cast<std::size_t>(mb.begin) + i] = static_cast<float>(experts) * dot;
    for (std::size_t e = 0; e < e_count; ++e) g[i * e_count + e] = pi[e] * (factor * (scope[e] / count) - inner);
  }
}

class ExpertShareKind final : public LossKind {
 public:
  std::string_view name() const override { return kExpertShare; }
  std::string_view summary() const override {
    return "(1 / S) sum over scopes of E sum_e P_e^2 (a test kind; rows whole on every rank, layout.sp)";
  }
  KindInputs inputs() const override { return {false, false}; }
  bool columns_split_by_tp() const override { return false; }
  std::string_view column_axis() const override { return "experts"; }
  void validate(const Case& c) const override {
    if (c.inputs.dtype != DType::fp32) detail::fail_at(c.source, "$.inputs.dtype", "this sketch reads fp32 only");
  }
  std::string dump_gap() const override { return "a test kind's scopes"; }
  KindRowPlan plan_rows(const RowPlanRequest& request) const override { return plan_scopes(request); }
  std::string row_sum_rule() const override { return "sum_v grad = 0 for every token"; }
  std::vector<Implementation> catalogue() const override {
    return {catalogued_bug(kExpertShareLocalScope, "the scope's mean over the rank's own rows: no all-reduce",
                           "tests/kinds", "loss and gradient wrong where a scope spans ranks (CP > 1, or sp at TP > 1)",
                           {"loss", "grad"}, Applies::kind(kExpertShare),
                           switches_with([](BugSwitches& b) { b.kind_switches = kLocalScopeBit; }))};
  }
  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    return std::make_unique<ExpertShareReference>(c, inputs);
  }
  void cpu_micro_batch(const CpuMicroBatch& batch) const override { run_micro_batch(batch); }
};

}  // namespace

void register_expert_share() {
  static std::once_flag once;
  std::call_once(once, [] { register_loss_kind(std::make_unique<ExpertShareKind>()); });
}

}  // namespace lossverify::testing
