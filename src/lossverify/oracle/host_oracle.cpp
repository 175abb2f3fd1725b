#include "lossverify/oracle/host_oracle.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "lossverify/checks/checks.hpp"
#include "lossverify/checks/element_judge.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify {

HostOracle::ShardCache::ShardCache(DType dtype, std::int64_t rows, std::int64_t cols, ProgressBeacon* beacon)
    : dtype_(dtype), cols_(cols) {
  assign_zeros_beating(bytes_, static_cast<std::size_t>(rows * cols) * dtype_size(dtype), beacon);
}

template <class Fill>
void HostOracle::ShardCache::store(std::int64_t row, Fill fill) {
  dispatch_dtype(dtype_, [&](auto type) {
    using T = typename decltype(type)::type;
    fill(reinterpret_cast<T*>(bytes_.data()) + row * cols_);
  });
}

void HostOracle::ShardCache::widen(std::int64_t row, double* out) const {
  dispatch_dtype(dtype_, [&](auto type) {
    using T = typename decltype(type)::type;
    const T* in = reinterpret_cast<const T*>(bytes_.data()) + row * cols_;
    for (std::int64_t v = 0; v < cols_; ++v) out[v] = static_cast<double>(static_cast<float>(in[v]));
  });
}

HostOracle::HostOracle(const Case& c, const InputSource& inputs, const RankOutput& out, const GradJudgement& judgement,
                       int threads)
    : case_(c),
      inputs_(inputs),
      out_(out),
      reference_(c, inputs),
      stage_reference_(reference_.stage()),
      judgement_(judgement),
      threads_(threads),
      has_teacher_(reference_.needs_teacher()),
      beacon_(ProgressBeacon::current()),
      student_(c.inputs.dtype, out.rows(), out.columns(), beacon_),
      teacher_(c.inputs.dtype, has_teacher_ ? out.rows() : 0, out.columns(), beacon_) {}

void HostOracle::load_row(std::int64_t i, std::vector<double>& student, std::vector<double>& teacher) const {
  if (stage_logits()) {
    const auto cols = static_cast<std::size_t>(out_.columns());
    std::copy_n(&stage_logits_[static_cast<std::size_t>(i) * cols], cols, student.begin());
  } else {
    student_.widen(i, student.data());
  }
  if (has_teacher_) teacher_.widen(i, teacher.data());
}

void HostOracle::row_partials(std::vector<double>& partials, std::vector<char>& valid) {
  const std::int64_t rows = out_.rows();
  const std::int64_t cols = out_.columns();
  const VocabRange range = out_.assignment.vocab;
  valid_.assign(static_cast<std::size_t>(rows), 0);
  if (stage_logits()) stage_logits_.assign(static_cast<std::size_t>(rows * cols), 0.0);
#pragma omp parallel num_threads(threads_)
  {
    std::vector<double> student(static_cast<std::size_t>(cols));
    std::vector<double> teacher(has_teacher_ ? static_cast<std::size_t>(cols) : 0);
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t i = 0; i < rows; ++i) {
      beat_row(beacon_, i);
      const std::int64_t t = out_.token_of(i);
      if (t < 0 || !inputs_.is_valid(t)) continue;
      valid_[static_cast<std::size_t>(i)] = 1;
      if (stage_logits()) {
        stage_reference_->logits(t, range.begin, range.end, &stage_logits_[static_cast<std::size_t>(i * cols)]);
      } else {
        student_.store(i, [&](auto* row) { inputs_.logits(t, range.begin, range.end, row); });
      }
      if (has_teacher_) teacher_.store(i, [&](auto* row) { inputs_.teacher_logits(t, range.begin, range.end, row); });
      load_row(i, student, teacher);
      const RowPartial p = reference_.partial(t, range.begin, student, teacher);
      p.store(&partials[static_cast<std::size_t>(i * RowPartial::kDoubles)]);
    }
  }
  valid = valid_;
}

std::vector<double> HostOracle::value_partials(std::span<const RowStats> stats) {
  const std::int64_t rows = out_.rows();
  const std::int64_t cols = out_.columns();
  std::vector<double> kl(static_cast<std::size_t>(2 * rows), 0.0);
#pragma omp parallel num_threads(threads_)
  {
    std::vector<double> student(static_cast<std::size_t>(cols));
    std::vector<double> teacher(static_cast<std::size_t>(cols));
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t i = 0; i < rows; ++i) {
      beat_row(beacon_, i);
      if (!valid_[static_cast<std::size_t>(i)]) continue;
      load_row(i, student, teacher);
      const auto [sum, error] =
          reference_.value_partial(out_.token_of(i), stats[static_cast<std::size_t>(i)], student, teacher);
      kl[static_cast<std::size_t>(2 * i)] = sum;
      kl[static_cast<std::size_t>(2 * i + 1)] = error;
    }
  }
  return kl;
}

namespace {

// The finite census of one stored value, and the row's first non-finite one.
void count_value(RowJudgement& row, double value, std::int64_t column, double smallest_normal_value) {
  if (std::isnan(value)) {
    ++row.nan;
  } else if (std::isinf(value)) {
    ++(value > 0 ? row.pos_inf : row.neg_inf);
  } else if (value != 0.0 && std::fabs(value) < smallest_normal_value) {
    ++row.subnormal;
  }
  if (!std::isfinite(value) && row.first_bad_column < 0) {
    row.first_bad_column = column;
    row.first_bad_value = value;
  }
}

}  // namespace

// CP padding: masked, so an exactly zero gradient.
RowJudgement HostOracle::judge_padding_row(std::int64_t i, std::span<const double> got) const {
  const LocalRow& row = out_.assignment.rows[static_cast<std::size_t>(i)];
  const std::int64_t begin = out_.assignment.vocab.begin;
  const int rank = out_.assignment.world_rank;
  RowJudgement judged;
  ErrorStats stats;
  for (std::size_t v = 0; v < got.size(); ++v) {
    const std::int64_t column = begin + static_cast<std::int64_t>(v);
    const double g = got[v] * judgement_.framework_scale;
    const bool mismatch = g != 0.0;
    stats.add_with_margin({-1, column, rank, 0.0, g, 0.0, row.sequence, row.position},
                          mismatch ? std::numeric_limits<double>::infinity() : 0.0, mismatch);
    count_value(judged, got[v], column, judgement_.smallest_normal);
  }
  judged.grad = stats.pack();
  return judged;
}

RowJudgement HostOracle::judge_token_row(std::int64_t i, const RowStats& row_stats, std::span<const double> got,
                                         std::vector<double>& student, std::vector<double>& teacher,
                                         std::vector<double>& expected) const {
  const auto k = static_cast<std::size_t>(i);
  const std::int64_t t = out_.token_of(i);
  const std::int64_t begin = out_.assignment.vocab.begin;
  const int rank = out_.assignment.world_rank;
  const GradJudge judge{judgement_};
  const double weight = valid_[k] ? reference_.token_weight(t) : 0.0;
  if (valid_[k]) {
    load_row(i, student, teacher);
    reference_.gradient(t, row_stats, begin, student, teacher, expected);
  } else {
    std::fill(expected.begin(), expected.end(), 0.0);
  }
  const double token_scale = std::fabs(weight) * judgement_.grad_scale *
                             (valid_[k] ? reference_.row().gradient_scale(t, row_stats).value_or(1.0) : 1.0);
  std::vector<double> slack;
  if (valid_[k] && reference_.row().has_gradient_slack()) {
    slack.resize(got.size());
    reference_.row().gradient_slack(t, weight, student, slack);
  }
  RowJudgement judged;
  ErrorStats stats;
  CompensatedSum sum;
  CompensatedSum magnitude;
  for (std::size_t v = 0; v < got.size(); ++v) {
    const std::int64_t column = begin + static_cast<std::int64_t>(v);
    const double e = expected[v];
    bool mismatch = false;
    std::int64_t ulp = 0;
    const double widened = slack.empty() ? 0.0 : slack[v];
    const double m = judge.judge(got[v], e, token_scale, mismatch, ulp, widened);
    const double g = got[v] * judgement_.framework_scale;
    stats.add_in_order(g, e, m, mismatch, [&] {
      return ElementRecord{t, column, rank, e, g, judge.tolerance_at(e, token_scale, widened)};
    });
    stats.add_ulp(ulp);
    sum.add(g);
    magnitude.add(std::fabs(g));
    count_value(judged, got[v], column, judgement_.smallest_normal);
  }
  judged.grad = stats.pack();
  judged.sum = sum.sum();
  judged.sum_error = sum.error();
  judged.magnitude = magnitude.value();
  return judged;
}

// The kind's reference gradient of row i over the whole row and how far a correct implementation's may lie from it
// (the logits' error a stage in front gives, through the kind's model, then the kind's own tolerance and one rounding
// to the dtype); zero where the row is no valid token.
void HostOracle::whole_row_gradient(std::int64_t i, const RowStats& row_stats, std::vector<double>& grad,
                                    std::vector<double>& error) const {
  const std::int64_t t = out_.token_of(i);
  const auto vocab = static_cast<std::size_t>(case_.shape.vocab);
  grad.assign(vocab, 0.0);
  error.assign(vocab, 0.0);
  if (t < 0 || !valid_[static_cast<std::size_t>(i)]) return;
  std::vector<double> student(vocab), teacher(has_teacher_ ? vocab : 0), logit_error(vocab, 0.0);
  const auto end = static_cast<std::int64_t>(vocab);
  if (stage_logits()) {
    stage_reference_->logits(t, 0, end, student.data());
    stage_reference_->logit_error(t, 0, end, logit_error.data());
  } else {
    inputs_.logits(t, 0, end, student.data());
  }
  if (has_teacher_) inputs_.teacher_logits(t, 0, end, teacher.data());
  reference_.gradient(t, row_stats, 0, student, teacher, grad);
  const double weight = reference_.token_weight(t);
  if (stage_logits()) {
    const double delta = *std::max_element(logit_error.begin(), logit_error.end());
    if (!reference_.row().gradient_under_logit_error(t, row_stats, weight, delta, 0, student, error)) {
      throw InternalError("kind " + std::string(kind_of(case_.loss).name()) + " has no logit-error model");
    }
    // A token with two admissible readings (a policy ratio the logits' error may carry across a clip edge): the
    // stage's gradients sum this gradient with others, so either reading must lie within the bound.
    const int readings = reference_.row().branches(t, row_stats);
    std::vector<double> other(readings > 1 ? vocab : 0);
    for (int b = 1; b < readings; ++b) {
      RowStats reading = row_stats;
      reading.branch = b;
      reference_.gradient(t, reading, 0, student, teacher, other);
      for (std::size_t v = 0; v < vocab; ++v) error[v] += std::fabs(other[v] - grad[v]);
    }
  }
  const GradJudge judge{judgement_};
  const double token_scale = std::fabs(weight) * judgement_.grad_scale;
  const double unit = unit_roundoff(case_.inputs.dtype);  // the gradient's rounding to the dtype
  for (std::size_t v = 0; v < vocab; ++v) {
    const double moved = std::fabs(grad[v]) + error[v];
    error[v] += judge.tolerance_at(moved, token_scale) + unit * moved;
  }
}

// A stage's error bound for elements the implementation stores once in the dtype: that rounding added, so that the
// bound alone covers a correct implementation (the gradient rule's own ulp allowance aside).
void HostOracle::round_once(std::span<const double> expected, std::span<double> bound) const {
  if (!stage_logits()) return;
  const double unit = unit_roundoff(case_.inputs.dtype);
  for (std::size_t k = 0; k < bound.size(); ++k) bound[k] += unit * (std::fabs(expected[k]) + bound[k]);
}

// Each of the stage's gradients of row i against the stage's reference applied to the kind's reference gradient
// (zero where the row is no valid token), by the gradient's rule widened by the stage's error model; none where the
// rank does not report the row's (another TP rank's token shard under sequence parallelism). With parameters, the
// row's gradient and its error over the rank's columns are kept for judge_stage_parameters.
std::vector<PackedStats> HostOracle::judge_stage_row(std::int64_t i, const RowStats& row_stats) {
  const std::int64_t t = out_.token_of(i);
  const bool valid = t >= 0 && valid_[static_cast<std::size_t>(i)];
  const VocabRange rank = out_.assignment.vocab;
  const GradJudge judge{judgement_};
  std::vector<double> grad, error;
  whole_row_gradient(i, row_stats, grad, error);
  const double token_scale =
      judgement_.grad_scale *
      (valid ? std::fabs(reference_.token_weight(t)) * reference_.row().gradient_scale(t, row_stats).value_or(1.0)
             : 1.0);
  if (!out_.stage_params.empty()) {
    const auto cols = static_cast<std::size_t>(rank.size());
    std::copy_n(grad.begin() + rank.begin, cols, &stage_grad_[static_cast<std::size_t>(i) * cols]);
    std::copy_n(error.begin() + rank.begin, cols, &stage_grad_error_[static_cast<std::size_t>(i) * cols]);
  }
  std::vector<PackedStats> judged;
  const std::int64_t reported = stage_row_of_[static_cast<std::size_t>(i)];
  if (reported < 0) return judged;
  for (std::size_t w = 0; w < out_.stage_grads.size(); ++w) {
    const std::int64_t cols = out_.stage_columns[w];
    std::vector<double> want(static_cast<std::size_t>(cols), 0.0), bound(want.size(), 0.0), got(want.size());
    if (valid) stage_reference_->input_gradient(w, t, rank, grad, error, want, bound);
    round_once(want, bound);
    dispatch_dtype(out_.dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      const T* g = reinterpret_cast<const T*>(out_.stage_grads[w].data()) + reported * cols;
      for (std::int64_t c = 0; c < cols; ++c) got[static_cast<std::size_t>(c)] = static_cast<float>(g[c]);
    });
    ErrorStats stats;
    for (std::int64_t c = 0; c < cols; ++c) {
      const auto k = static_cast<std::size_t>(c);
      bool mismatch = false;
      std::int64_t ulp = 0;
      const double m = judge.judge(got[k], want[k], token_scale, mismatch, ulp, bound[k]);
      const double effective = got[k] * judgement_.framework_scale;
      stats.add_in_order(effective, want[k], m, mismatch, [&] {
        return ElementRecord{t,       c,         out_.assignment.world_rank,
                             want[k], effective, judge.tolerance_at(want[k], token_scale, bound[k])};
      });
      stats.add_ulp(ulp);
    }
    judged.push_back(stats.pack());
  }
  return judged;
}

// Each of the stage's parameter gradients of the rank (its shard, summed over its tokens) against the float64 sum of
// the stage's reference over the rank's valid rows in row order, each element's tolerance widened by the summed
// bound of the stage's error model; token_scale is the sum of the rows' |w_t|.
void HostOracle::judge_stage_parameters() {
  parameters_.clear();
  const Stage& stage = *case_.loss.stage;
  const VocabRange rank = out_.assignment.vocab;
  const auto cols = static_cast<std::size_t>(rank.size());
  const GradJudge judge{judgement_};
  for (std::size_t p = 0; p < out_.stage_params.size(); ++p) {
    const ParameterShape shape = stage.parameter_shape(p, case_, out_.assignment);
    const auto size = static_cast<std::size_t>(shape.rows * shape.columns);
    std::vector<double> sum(size, 0.0), bound(size, 0.0);
    double token_scale = 0.0;
    for (std::int64_t i = 0; size > 0 && i < out_.rows(); ++i) {
      const std::int64_t t = out_.token_of(i);
      if (t < 0 || !valid_[static_cast<std::size_t>(i)]) continue;
      token_scale += std::fabs(reference_.token_weight(t));
      const auto at = static_cast<std::size_t>(i) * cols;
      stage_reference_->accumulate_parameter(p, t, rank.begin, std::span<const double>(&stage_grad_[at], cols),
                                             std::span<const double>(&stage_grad_error_[at], cols), sum, bound);
    }
    token_scale *= judgement_.grad_scale;
    round_once(sum, bound);
    std::vector<double> got(size);
    dispatch_dtype(out_.dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      const T* g = reinterpret_cast<const T*>(out_.stage_params[p].data());
      for (std::size_t k = 0; k < size; ++k) got[k] = static_cast<float>(g[k]);
    });
    ErrorStats stats;
    for (std::size_t k = 0; k < size; ++k) {
      bool mismatch = false;
      std::int64_t ulp = 0;
      const double m = judge.judge(got[k], sum[k], token_scale, mismatch, ulp, bound[k]);
      const double effective = got[k] * judgement_.framework_scale;
      stats.add_in_order(effective, sum[k], m, mismatch, [&] {
        return ElementRecord{-1,
                             static_cast<std::int64_t>(k),
                             out_.assignment.world_rank,
                             sum[k],
                             effective,
                             judge.tolerance_at(sum[k], token_scale, bound[k])};
      });
      stats.add_ulp(ulp);
    }
    parameters_.push_back(stats.pack());
  }
}

// A token with two admissible readings (a ratio at a clip edge) is judged by the one its gradient is closer to.
RowJudgement HostOracle::judge_admissible_readings(std::int64_t i, const RowStats& row_stats,
                                                   std::span<const double> got, std::vector<double>& student,
                                                   std::vector<double>& teacher, std::vector<double>& expected) const {
  RowJudgement best = judge_token_row(i, row_stats, got, student, teacher, expected);
  const std::int64_t t = out_.token_of(i);
  const int readings = valid_[static_cast<std::size_t>(i)] ? reference_.row().branches(t, row_stats) : 1;
  for (int b = 1; b < readings; ++b) {
    RowStats other = row_stats;
    other.branch = b;
    const RowJudgement judged = judge_token_row(i, other, got, student, teacher, expected);
    if (ErrorStats::unpack(judged.grad).margin() < ErrorStats::unpack(best.grad).margin()) best = judged;
  }
  return best;
}

void HostOracle::start_judging(std::span<const RowStats> stats) {
  const std::int64_t rows = out_.rows();
  const std::int64_t cols = out_.columns();
  rows_.assign(static_cast<std::size_t>(rows), RowJudgement{});
  if (!out_.stage_params.empty()) {
    stage_grad_.assign(static_cast<std::size_t>(rows * cols), 0.0);
    stage_grad_error_.assign(stage_grad_.size(), 0.0);
  }
  stage_row_of_.assign(static_cast<std::size_t>(rows), -1);
  for (std::size_t j = 0; j < out_.stage_rows.size(); ++j) {
    const std::int64_t i = out_.stage_rows[j];
    if (i < 0 || i >= rows) throw InternalError("a stage gradient's row " + std::to_string(i) + " outside the rank's");
    stage_row_of_[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(j);
  }
  // Each stage gradient holds exactly the rows stage_rows names: a backend or a dump that hands over gradients without
  // naming their rows would otherwise have none of them judged.
  const std::size_t element = dtype_size(out_.dtype);
  for (std::size_t w = 0; w < out_.stage_grads.size(); ++w) {
    const std::size_t want = out_.stage_rows.size() * static_cast<std::size_t>(out_.stage_columns[w]) * element;
    if (out_.stage_grads[w].size() != want) {
      throw InternalError("the stage's gradient " + std::to_string(w) + " holds " +
                          std::to_string(out_.stage_grads[w].size()) + " bytes, its rows (stage_rows) " +
                          std::to_string(want));
    }
  }
#pragma omp parallel num_threads(threads_)
  {
    std::vector<double> student(static_cast<std::size_t>(cols));
    std::vector<double> teacher(has_teacher_ ? static_cast<std::size_t>(cols) : 0);
    std::vector<double> expected(static_cast<std::size_t>(cols));
    std::vector<double> got(static_cast<std::size_t>(cols));
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t i = 0; i < rows; ++i) {
      beat_row(beacon_, i);
      const auto k = static_cast<std::size_t>(i);
      // A stage that keeps the kind's gradient inside hands none over (the CUDA head): its checks are not applicable.
      if (out_.grad.empty()) {
        std::fill(got.begin(), got.end(), 0.0);
      } else {
        out_.grad_row(i, got.data());
      }
      rows_[k] = out_.token_of(i) < 0 ? judge_padding_row(i, got)
                                      : judge_admissible_readings(i, stats[k], got, student, teacher, expected);
      if (stage_reference_ != nullptr) rows_[k].stage = judge_stage_row(i, stats[k]);
    }
  }
  if (stage_reference_ != nullptr && !out_.stage_params.empty()) judge_stage_parameters();
}

}  // namespace lossverify
