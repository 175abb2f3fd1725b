#include "lossverify/reference/loss_reference.hpp"

#include <utility>

#include <algorithm>
#include <cmath>
#include <optional>

#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify {

LossReference::LossReference(const Case& c, const InputSource& inputs)
    : LossReference(c, inputs, kind_of(c.loss).reference(c, inputs)) {}

LossReference::LossReference(const Case& c, const InputSource& inputs, std::unique_ptr<KindReference> row)
    : LossReference(c, inputs, std::move(row), c.loss.stage != nullptr ? c.loss.stage->reference(c, inputs) : nullptr) {
}

LossReference::LossReference(const Case& c, const InputSource& inputs, std::unique_ptr<KindReference> row,
                             std::unique_ptr<StageReference> stage)
    : case_(c),
      inputs_(inputs),
      row_(std::move(row)),
      stage_(std::move(stage)),
      valid_(static_cast<std::size_t>(c.shape.tokens)) {
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    const bool v = inputs.is_valid(t);
    valid_[static_cast<std::size_t>(t)] = v;
    valid_tokens_ += v;
  }
  // sum_t |w_t|: exact for the reductions mean (1) and sum (N_v); summed (compensated, in token order) where
  // the weights vary, under reduction none or a kind's own aggregation (which weighs every token, so token 0
  // tells whether it has one).
  const bool kind_weights = row_->token_weight(0).has_value();
  if (!kind_weights && c.loss.reduction == Reduction::sum) weight_total_ = static_cast<double>(valid_tokens_);
  if (!kind_weights && c.loss.reduction == Reduction::mean) weight_total_ = 1.0;
  if (kind_weights || c.loss.reduction == Reduction::none) {
    CompensatedSum total;
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) total.add(std::fabs(token_weight(t)));
    weight_total_ = total.value();
  }
}

double LossReference::token_weight(std::int64_t token) const {
  if (!valid_[static_cast<std::size_t>(token)]) return 0.0;
  if (const std::optional<double> own = row_->token_weight(token)) return *own;
  switch (case_.loss.reduction) {
    case Reduction::mean:
      return 1.0 / static_cast<double>(valid_tokens_);
    case Reduction::sum:
      return 1.0;
    case Reduction::none:
      return inputs_.upstream_weight(token);
  }
  return 0.0;
}

ReferenceToken LossReference::evaluate(std::int64_t token, std::span<const double> student,
                                       std::span<const double> teacher, std::span<double> grad) const {
  if (!valid_[static_cast<std::size_t>(token)]) {
    std::fill(grad.begin(), grad.end(), 0.0);
    return ReferenceToken{};
  }
  // The whole row as one slice.
  const RowPartial p = row_->partial(token, 0, student, teacher);
  RowStats s = row_->stats(RowPartial::rescaled(p, p.max, p.teacher_max));
  if (row_->needs_value_pass()) {
    const auto [sum, error] = row_->value_partial(token, s, student, teacher);
    s.value = sum + error;
  }
  ReferenceToken r;
  r.valid = true;
  r.stats = s;
  r.lse = s.lse;
  r.weight = token_weight(token);
  r.loss = row_->token_loss(token, s);
  row_->gradient(token, s, r.weight, 0, student, teacher, grad);
  return r;
}

double LossReference::reduced_loss(std::span<const double> token_losses) const {
  CompensatedSum total;
  for (std::size_t t = 0; t < token_losses.size(); ++t) {
    total.add(token_weight(static_cast<std::int64_t>(t)) * token_losses[t]);
  }
  return total.value();
}

}  // namespace lossverify
