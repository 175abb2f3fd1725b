#pragma once
// Dense float64 reference of the global problem, written from the definitions of docs/spec.md §3 and nothing
// else: no shards, no packed sums, no shared math header. It is evaluated one token at a time from a
// whole row of logits, so no N x V float64 array ever exists. It knows nothing of rank layouts: token
// weights come from the global valid count, labels from the global sequences. The row's math is the loss
// kind's (KindReference, kinds/loss_kind.hpp); this class adds what every kind shares.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/reference/row_partial.hpp"

namespace lossverify {

struct ReferenceToken {
  bool valid = false;
  RowStats stats;       // the row's statistics (with the value pass, where the kind has one)
  double lse = 0.0;     // channel 0's log-sum-exp (log sum_v exp(x_v); of x / T for KD)
  double loss = 0.0;    // l_t (0 on masked tokens)
  double weight = 0.0;  // d L / d l_t: 1/N_v (mean), 1 (sum), g_t (none); 0 on masked tokens
};

class LossReference {
 public:
  LossReference(const Case& c, const InputSource& inputs);
  // With the kind's row reference made elsewhere (a kind's own GPU oracle, which takes part of it from the device).
  LossReference(const Case& c, const InputSource& inputs, std::unique_ptr<KindReference> row);
  // With the stage's reference made elsewhere too (a stage's own GPU oracle, which evaluates the stage on the device).
  LossReference(const Case& c, const InputSource& inputs, std::unique_ptr<KindReference> row,
                std::unique_ptr<StageReference> stage);

  const KindReference& row() const { return *row_; }
  // The case's stage's reference (kind_api/stage.hpp), or null.
  const StageReference* stage() const { return stage_.get(); }
  bool needs_teacher() const { return kind_of(case_.loss).inputs().teacher_logits; }
  std::int64_t valid_tokens() const { return valid_tokens_; }
  double token_weight(std::int64_t token) const;

  // Loss of token t and, into grad (V entries), d L / d x[t, :] of the global objective.
  // `teacher` is read by kinds that read teacher logits.
  ReferenceToken evaluate(std::int64_t token, std::span<const double> student, std::span<const double> teacher,
                          std::span<double> grad) const;

  // L of reduction mean or sum from the per-token losses (compensated, in token order).
  double reduced_loss(std::span<const double> token_losses) const;

  // The same reference split over column slices [begin, begin + size) of a row, for verification that
  // runs where the columns live (each TP rank its own slice), with per-rank memory independent of the
  // number of slices:
  //   partial(slice) for every slice -> the row's maxima (the max over slices, exact) -> RowPartial::rescaled
  //   summed over the slices in slice order -> stats_from_sums -> (value_partial summed over the slices, where
  //   the kind needs it) -> token_loss, and gradient(slice).
  RowPartial partial(std::int64_t token, std::int64_t begin, std::span<const double> student,
                     std::span<const double> teacher) const {
    return row_->partial(token, begin, student, teacher);
  }
  RowStats stats_from_sums(const RowPartial& total) const { return row_->stats(total); }
  bool needs_value_pass() const { return row_->needs_value_pass(); }
  std::pair<double, double> value_partial(std::int64_t token, const RowStats& stats, std::span<const double> student,
                                          std::span<const double> teacher) const {
    return row_->value_partial(token, stats, student, teacher);
  }
  double token_loss(std::int64_t token, const RowStats& stats) const { return row_->token_loss(token, stats); }
  // Sum over tokens of |w_t|: the scale of the logged loss's absolute tolerance (1 for mean, N_v for sum).
  double weight_total() const { return weight_total_; }
  // d L / d x of the slice's columns.
  void gradient(std::int64_t token, const RowStats& stats, std::int64_t begin, std::span<const double> student,
                std::span<const double> teacher, std::span<double> grad) const {
    row_->gradient(token, stats, token_weight(token), begin, student, teacher, grad);
  }

 private:
  const Case& case_;
  const InputSource& inputs_;
  std::unique_ptr<KindReference> row_;
  std::unique_ptr<StageReference> stage_;
  std::int64_t valid_tokens_ = 0;
  std::vector<char> valid_;
  double weight_total_ = 0.0;
};

}  // namespace lossverify
