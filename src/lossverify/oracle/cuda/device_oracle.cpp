#include "lossverify/oracle/cuda/device_oracle.hpp"

#include <utility>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/oracle/cuda/gpu_reference.hpp"

namespace lossverify::cuda {

namespace {

class DeviceOracle final : public Oracle {
 public:
  DeviceOracle(const Case& c, const InputSource& inputs, std::shared_ptr<OracleShard> shard, const RankOutput& out,
               const GradJudgement& judgement, bool whole_rows)
      : case_(c),
        inputs_(inputs),
        shard_(std::move(shard)),
        out_(out),
        reference_(c, inputs),
        model_(kind_of(c.loss).device_row_model(c).value_or(DeviceRowModel{})),
        compare_early_(whole_rows && !model_.teacher && !model_.row_coefficients) {
    if (!shard_ || !out_.device_shard)
      throw InternalError("the GPU oracle needs its inputs and the rank's gradient on the GPU");
    compare_.atol = judgement.tolerance.atol;
    compare_.rtol = judgement.tolerance.rtol;
    compare_.max_ulp = judgement.tolerance.max_ulp;
    compare_.framework_scale = judgement.framework_scale;
    compare_.quantum = judgement.quantum;
    compare_.grad_scale = judgement.grad_scale;
    compare_.smallest_normal = judgement.smallest_normal;
  }

  const LossReference& reference() const override { return reference_; }

  void row_partials(std::vector<double>& partials, std::vector<char>& valid) override {
    std::vector<std::int64_t> labels;
    reference_rows(case_, inputs_, out_.assignment, labels, valid_);
    gpu_reference_partials_launch(*shard_, case_, labels, valid_);
    // While the GPU computes the partials: the comparison's per-row inputs that do not need them.
    const std::size_t rows = valid_.size();
    compare_.kind.assign(rows, 1);
    compare_.labels = std::move(labels);
    compare_.lse.assign(rows, 0.0);
    compare_.teacher_lse.assign(rows, 0.0);
    compare_.weight.assign(rows, 0.0);
    for (std::size_t k = 0; k < rows; ++k) {
      const std::int64_t t = out_.assignment.rows[k].token;
      if (t < 0) {
        compare_.kind[k] = 2;
      } else if (valid_[k]) {
        compare_.kind[k] = 0;
        compare_.weight[k] = reference_.token_weight(t);
      }
    }
    if (compare_early_) gpu_reference_compare_launch(*shard_, *out_.device_shard, case_, compare_, true);
    valid.assign(valid_.begin(), valid_.end());
    gpu_reference_partials_wait(*shard_, partials);
  }

  std::vector<double> value_partials(std::span<const RowStats> stats) override {
    std::vector<double> lse(stats.size()), teacher_lse(stats.size());
    for (std::size_t k = 0; k < stats.size(); ++k) {
      lse[k] = stats[k].lse;
      teacher_lse[k] = stats[k].teacher_lse;
    }
    return gpu_reference_kl(*shard_, case_, lse, teacher_lse, valid_);
  }

  void start_judging(std::span<const RowStats> stats) override {
    if (compare_early_) return;  // queued behind the partials
    if (model_.row_coefficients) row_coefficients(stats);
    for (std::size_t k = 0; k < stats.size(); ++k) {
      if (compare_.kind[k] != 0) continue;
      compare_.lse[k] = stats[k].lse;
      compare_.teacher_lse[k] = stats[k].teacher_lse;
    }
    gpu_reference_compare_launch(*shard_, *out_.device_shard, case_, compare_, false);
  }

  // A row with two admissible readings (KindReference::branches) is compared a second time with its other
  // reading's coefficients, and judged by the one its gradient is closer to, as the host oracle does.
  std::span<const RowJudgement> judged_rows() override {
    const std::span<const RowComparison> compared = gpu_reference_compare_wait(*shard_);
    rows_.assign(compared.size(), RowJudgement{});
    for (std::size_t k = 0; k < compared.size(); ++k) rows_[k] = judgement(k, compared[k]);
    if (other_readings_.empty()) return rows_;
    for (const auto& [k, c] : other_readings_) {
      compare_.coef_a[k] = c.a;
      compare_.coef_b[k] = c.b;
      compare_.row_scale[k] = c.scale;
    }
    gpu_reference_compare_launch(*shard_, *out_.device_shard, case_, compare_, false);
    const std::span<const RowComparison> other = gpu_reference_compare_wait(*shard_);
    for (const auto& [k, c] : other_readings_) {
      if (other[k].margin < compared_margin(k)) rows_[k] = judgement(k, other[k]);
    }
    return rows_;
  }

  bool counts_lookups() const override { return true; }

 private:
  // Each valid row's a, b and tolerance scale from the reference (its first reading), and the other reading
  // of rows that have two.
  void row_coefficients(std::span<const RowStats> stats) {
    const std::size_t rows = stats.size();
    compare_.coef_a.assign(rows, 0.0);
    compare_.coef_b.assign(rows, 0.0);
    compare_.row_scale.assign(rows, 1.0);
    other_readings_.clear();
    const KindReference& kind = reference_.row();
    for (std::size_t k = 0; k < rows; ++k) {
      if (compare_.kind[k] != 0) continue;
      const std::int64_t t = out_.assignment.rows[k].token;
      const KindReference::RowCoefficients c = kind.row_coefficients(t, stats[k]);
      compare_.coef_a[k] = c.a;
      compare_.coef_b[k] = c.b;
      compare_.row_scale[k] = c.scale;
      if (kind.branches(t, stats[k]) < 2) continue;
      RowStats other = stats[k];
      other.branch = 1;
      other_readings_.emplace_back(k, kind.row_coefficients(t, other));
    }
  }

  double compared_margin(std::size_t k) const { return rows_[k].grad.margin; }

  RowJudgement judgement(std::size_t k, const RowComparison& rc) const { return row_judgement(out_, k, rc); }

  const Case& case_;
  const InputSource& inputs_;
  std::shared_ptr<OracleShard> shard_;
  const RankOutput& out_;
  const LossReference reference_;
  const DeviceRowModel model_;
  const bool compare_early_;
  std::vector<std::pair<std::size_t, KindReference::RowCoefficients>> other_readings_;
  std::vector<int> valid_;
  GpuCompareInputs compare_;
  std::vector<RowJudgement> rows_;
};

}  // namespace

RowJudgement row_judgement(const RankOutput& out, std::size_t k, const RowComparison& rc) {
  const std::int64_t begin = out.assignment.vocab.begin;
  const int rank = out.assignment.world_rank;
  const LocalRow& row = out.assignment.rows[k];
  const bool padding = row.token < 0;
  RowJudgement j;
  j.grad = PackedStats{rc.compared,
                       rc.mismatches,
                       rc.max_ulp,
                       rc.compared > 0,
                       rc.max_abs,
                       rc.max_rel,
                       rc.margin,
                       PackedElement{row.token, begin + rc.worst_column, rank, padding ? row.sequence : -1,
                                     padding ? row.position : -1, rc.worst_expected, rc.worst_got, rc.worst_tolerance}};
  j.sum = rc.sum;
  j.sum_error = rc.sum_error;
  j.magnitude = rc.magnitude;
  j.nan = rc.nan;
  j.pos_inf = rc.pos_inf;
  j.neg_inf = rc.neg_inf;
  j.subnormal = rc.subnormal;
  j.first_bad_column = rc.first_bad_column >= 0 ? begin + rc.first_bad_column : -1;
  j.first_bad_value = rc.first_bad_value;
  j.lookups = rc.lookups;
  return j;
}

std::unique_ptr<Oracle> make_device_oracle(const Case& c, const InputSource& inputs, std::shared_ptr<OracleShard> shard,
                                           const RankOutput& out, const GradJudgement& judgement, bool whole_rows) {
  return std::make_unique<DeviceOracle>(c, inputs, std::move(shard), out, judgement, whole_rows);
}

}  // namespace lossverify::cuda
