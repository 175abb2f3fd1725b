#pragma once
// The host oracle: the float64 reference of one rank's rows x columns on the CPU (OpenMP threads). It
// regenerates the rank's inputs from the case's Philox streams into its own cache (kept in the input
// dtype, exact, between the stages) and reads nothing of the rank but its gradient, through RankOutput.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/oracle.hpp"
#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/outputs/rank_output.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify {

class HostOracle final : public Oracle {
 public:
  // `out` is the rank's outputs (read only; it must outlive the oracle). Made on the rank's thread: the row
  // loops beat that thread's progress beacon, so that the deadlock guard sees a verifying rank as busy.
  HostOracle(const Case& c, const InputSource& inputs, const RankOutput& out, const GradJudgement& judgement,
             int threads);

  const LossReference& reference() const override { return reference_; }
  void row_partials(std::vector<double>& partials, std::vector<char>& valid) override;
  std::vector<double> value_partials(std::span<const RowStats> stats) override;
  void start_judging(std::span<const RowStats> stats) override;
  std::span<const RowJudgement> judged_rows() override { return rows_; }
  std::vector<PackedStats> stage_parameters() override { return parameters_; }

 private:
  // A rank's rows x columns in the input dtype, generated once and widened to float64 on use.
  class ShardCache {
   public:
    ShardCache(DType dtype, std::int64_t rows, std::int64_t cols, ProgressBeacon* beacon);
    template <class Fill>
    void store(std::int64_t row, Fill fill);
    void widen(std::int64_t row, double* out) const;

   private:
    DType dtype_;
    std::int64_t cols_;
    std::vector<std::byte> bytes_;
  };

  void load_row(std::int64_t i, std::vector<double>& student, std::vector<double>& teacher) const;
  RowJudgement judge_padding_row(std::int64_t i, std::span<const double> got) const;
  RowJudgement judge_admissible_readings(std::int64_t i, const RowStats& stats, std::span<const double> got,
                                         std::vector<double>& student, std::vector<double>& teacher,
                                         std::vector<double>& expected) const;
  std::vector<PackedStats> judge_stage_row(std::int64_t i, const RowStats& stats);
  void whole_row_gradient(std::int64_t i, const RowStats& stats, std::vector<double>& grad,
                          std::vector<double>& error) const;
  void judge_stage_parameters();
  void round_once(std::span<const double> expected, std::span<double> bound) const;
  bool stage_logits() const { return stage_reference_ != nullptr && stage_reference_->makes_logits(); }
  RowJudgement judge_token_row(std::int64_t i, const RowStats& stats, std::span<const double> got,
                               std::vector<double>& student, std::vector<double>& teacher,
                               std::vector<double>& expected) const;

  const Case& case_;
  const InputSource& inputs_;
  const RankOutput& out_;
  const LossReference reference_;
  const StageReference* stage_reference_;  // the case's stage's (the reference's), or null
  const GradJudgement judgement_;
  const int threads_;
  const bool has_teacher_;
  ProgressBeacon* const beacon_;
  ShardCache student_;
  ShardCache teacher_;
  std::vector<char> valid_;
  std::vector<RowJudgement> rows_;
  std::vector<double> stage_logits_;  // rows x columns: a stage's logits in float64 (StageReference::makes_logits)
  // rows x columns: each row's reference gradient over the rank's columns and its error, for the parameters
  std::vector<double> stage_grad_, stage_grad_error_;
  std::vector<PackedStats> parameters_;
  std::vector<std::int64_t> stage_row_of_;  // rows: the row's place in the stage's gradients (out_.stage_rows), or -1
};

}  // namespace lossverify
