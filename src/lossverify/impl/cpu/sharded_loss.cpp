#include "lossverify/impl/cpu/sharded_loss.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>

#include "lossverify/case/kind_settings.hpp"
#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/impl/kind_case.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

class RankKernel {
 public:
  RankKernel(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
             const BugSwitches& bugs, const CpuKernelOptions& options)
      : case_(c),
        kind_case_(kind_case_of(c, bugs)),
        inputs_(inputs),
        groups_(groups),
        bugs_(bugs),
        threads_(options.threads) {
    out_.assignment = std::move(assignment);
    out_.dtype = c.inputs.dtype;
  }

  template <class T>
  RankOutput run() {
    const auto start = Clock::now();
    const double collectives_before = collective_seconds();
    // The rank generates exactly its own shard (the whole vocabulary under full-vocab-through-tp).
    const VocabRange vocab = out_.assignment.vocab;
    work_ = kind_.kernel_columns(bugs_, vocab, case_.shape.vocab);
    std::vector<T> student, teacher;
    assign_zeros_beating(student, static_cast<std::size_t>(rows() * work_.size()), beacon_);
    if (teacher_logits()) assign_zeros_beating(teacher, student.size(), beacon_);
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < rows(); ++i) {
      beat_row(beacon_, i);
      const LocalRow& row = out_.assignment.rows[static_cast<std::size_t>(i)];
      T* s = student.data() + i * work_.size();
      if (row.token < 0) {
        inputs_.padding_logits(row.sequence, row.position, work_.begin, work_.end, s);
        if (teacher_logits())
          inputs_.padding_logits(row.sequence, row.position, work_.begin, work_.end, teacher.data() + i * work_.size());
      } else {
        inputs_.logits(row.token, work_.begin, work_.end, s);
        if (teacher_logits())
          inputs_.teacher_logits(row.token, work_.begin, work_.end, teacher.data() + i * work_.size());
      }
    }
    out_.generate_seconds = seconds_since(start);
    const auto compute_start = Clock::now();
    const Stage* stage = case_.loss.stage;
    if (stage != nullptr) {
      out_.stage_rows = stage->gradient_rows(case_, out_.assignment);
      const auto reported = static_cast<std::int64_t>(out_.stage_rows.size());
      for (std::size_t w = 0; w < stage->gradients().size(); ++w) {
        out_.stage_columns.push_back(stage->gradient_columns(w, case_, out_.assignment));
        out_.stage_grads.emplace_back(static_cast<std::size_t>(reported * out_.stage_columns.back()) * sizeof(T));
      }
      for (std::size_t p = 0; p < stage->parameters().size(); ++p) {
        const ParameterShape shape = stage->parameter_shape(p, case_, out_.assignment);
        out_.stage_params.emplace_back(static_cast<std::size_t>(shape.rows * shape.columns) * sizeof(T));
      }
      stage->cpu_forward(stage_rank(student));
    }

    plan_.emplace(kind_case_, inputs_, out_.assignment, groups_, bugs_);
    out_.logged_valid_tokens = plan_->logged_valid_tokens();
    out_.token_loss.assign(static_cast<std::size_t>(rows()), 0.0f);
    out_.logged_token_loss.assign(plan_->kind_plan().separate_logged_loss ? static_cast<std::size_t>(rows()) : 0, 0.0f);
    out_.token_values.assign(static_cast<std::size_t>(rows()) * kind_.token_quantities().size(), 0.0f);
    out_.logged_stats.assign(kind_.logged_statistics(case_.loss).size(), 0.0);
    out_.scope_values.assign(static_cast<std::size_t>(case_.layout.ga * kind_.scope_values_width(case_)), 0.0);
    assign_zeros_beating(out_.grad, static_cast<std::size_t>(rows() * vocab.size()) * sizeof(T), beacon_);
    const auto& offsets = out_.assignment.micro_batch_begin;
    for (std::size_t k = 0; k + 1 < offsets.size(); ++k) {
      if (offsets[k + 1] == offsets[k]) continue;  // an empty micro-batch: TP peers skip it too
      kind_.cpu_micro_batch(CpuMicroBatch{kind_case_,
                                          bugs_,
                                          *plan_,
                                          groups_,
                                          out_.assignment,
                                          offsets[k],
                                          offsets[k + 1] - offsets[k],
                                          case_.inputs.dtype,
                                          work_,
                                          reinterpret_cast<std::byte*>(student.data()),
                                          reinterpret_cast<const std::byte*>(teacher.data()),
                                          out_.grad.data(),
                                          threads_,
                                          beacon_,
                                          out_.token_loss,
                                          out_.logged_token_loss,
                                          out_.token_values,
                                          out_.logged_stats,
                                          static_cast<int>(k),
                                          &out_.scope_values});
    }
    if (stage != nullptr) {
      std::vector<float> row_weights;
      for (const RowPlan& row : plan_->rows()) row_weights.push_back(row.backward_weight);
      StageRank backward = stage_rank(student);
      backward.row_weights = row_weights;
      stage->cpu_backward(backward);
    }
    if (!out_.logged_stats.empty()) groups_.batch.allreduce_sum(std::span<double>(out_.logged_stats));
    if (const auto logged = plan_->logged_loss(out_, groups_)) {
      out_.has_reduced_loss = true;
      out_.reduced_loss = *logged;
    }
    out_.collective_seconds = collective_seconds() - collectives_before;
    out_.compute_seconds = seconds_since(compute_start) - out_.collective_seconds;
    return std::move(out_);
  }

 private:
  template <class T>
  StageRank stage_rank(std::vector<T>& logits) {
    return StageRank{case_,
                     bugs_,
                     out_.assignment,
                     case_.inputs.dtype,
                     work_,
                     reinterpret_cast<std::byte*>(logits.data()),
                     out_.grad.data(),
                     out_.stage_grads,
                     out_.stage_params,
                     inputs_,
                     groups_};
  }
  bool teacher_logits() const { return kind_.inputs().teacher_logits; }
  std::int64_t rows() const { return out_.rows(); }
  double collective_seconds() const {
    return groups_.tp.collective_seconds() + groups_.batch.collective_seconds() + groups_.dp.collective_seconds();
  }

  const Case& case_;
  const Case kind_case_;  // what the kind's kernels read: the case, or its settings as a stage's bug changes them
  const LossKind& kind_ = kind_of(case_.loss);
  const InputSource& inputs_;
  RankGroups groups_;
  const BugSwitches& bugs_;
  int threads_;
  // Captured on the rank thread, where current() is this rank's: the OpenMP workers beat through it.
  ProgressBeacon* const beacon_ = ProgressBeacon::current();
  RankOutput out_;
  std::optional<RankPlan> plan_;
  VocabRange work_;
};

}  // namespace

RankOutput run_sharded_loss(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                            const BugSwitches& bugs, const CpuKernelOptions& options) {
  RankKernel kernel(c, inputs, std::move(assignment), groups, bugs, options);
  return dispatch_dtype(c.inputs.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return kernel.template run<T>();
  });
}

}  // namespace lossverify
