#include "lossverify/impl/rank_plan.hpp"

#include <algorithm>

#include "lossverify/core/dtype.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

bool RankPlan::labelled() const { return kind_of(case_.loss).inputs().labels; }

namespace {

// Pairwise float32 sum: the error grows with log n, as in the framework reductions it models.
float pairwise_sum(const float* x, std::int64_t n) {
  if (n <= 16) {
    float s = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
  const std::int64_t half = n / 2;
  return pairwise_sum(x, half) + pairwise_sum(x + half, n - half);
}

// The MTP layer's main loss, as Megatron-LM's process_mtp_loss sees it: a case's rows are the MTP layer's,
// and the MTP labels and mask are the main loss's rolled one position left within each (padded) sequence.
// So the main mask at position p is the case's at p - 1, and position 0 is a valid main-loss token.
bool main_loss_valid(const InputSource& inputs, const Sequence& seq, std::int64_t position) {
  if (position == 0) return true;
  return position - 1 < seq.length && inputs.is_valid(seq.begin + position - 1);
}

// mtp-local-count-ratio, each micro-batch's token weight. Megatron-LM's process_mtp_loss in per-token mode
// scales a micro-batch's summed MTP loss by its local main-loss count over its local MTP count (this rank's
// rows: at CP > 1 its two chunks of each sequence), and finalize_model_grads divides every gradient by the
// step's main-loss count.
std::vector<double> mtp_local_count_weights(const RankAssignment& assignment, const std::vector<RowPlan>& rows,
                                            const InputSource& inputs, std::int64_t cp) {
  const GlobalBatch& batch = inputs.batch();
  std::int64_t main_total = 0;
  for (const Sequence& seq : batch.sequences()) {
    const std::int64_t padded = padded_length(seq.length, 2 * cp);
    for (std::int64_t p = 0; p < padded; ++p) main_total += main_loss_valid(inputs, seq, p);
  }
  const auto& offsets = assignment.micro_batch_begin;
  std::vector<double> weights;
  for (std::size_t k = 0; k + 1 < offsets.size(); ++k) {
    std::int64_t valid = 0;
    std::int64_t main = 0;
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const LocalRow& row = assignment.rows[static_cast<std::size_t>(i)];
      valid += rows[static_cast<std::size_t>(i)].valid;
      main += main_loss_valid(inputs, batch.sequences()[static_cast<std::size_t>(row.sequence)], row.position);
    }
    const double ratio = static_cast<double>(main) / static_cast<double>(std::max<std::int64_t>(valid, 1));
    weights.push_back(ratio / static_cast<double>(main_total));
  }
  return weights;
}

}  // namespace

RankPlan::RankPlan(const Case& c, const InputSource& inputs, const RankAssignment& assignment, RankGroups& groups,
                   const BugSwitches& bugs)
    : case_(c), inputs_(inputs), bugs_(bugs) {
  plan_labels(assignment);
  plan_weights(assignment, groups);
}

// Labels and masks of the local rows: the framework's label step, correct or catalogued.
void RankPlan::plan_labels(const RankAssignment& assignment) {
  const auto& rows_in = assignment.rows;
  rows_.assign(rows_in.size(), RowPlan{});
  const std::int64_t ignore = case_.loss.ignore_index;
  const auto& offsets = assignment.micro_batch_begin;
  for (std::size_t k = 0; k + 1 < offsets.size(); ++k) {
    std::int64_t group_start = offsets[k];  // first local row of the current sequence
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const LocalRow& row = rows_in[static_cast<std::size_t>(i)];
      if (i > offsets[k] && rows_in[static_cast<std::size_t>(i - 1)].sequence != row.sequence) group_start = i;
      RowPlan& p = rows_[static_cast<std::size_t>(i)];
      p.label = ignore;
      if (row.token < 0) continue;  // CP padding: masked
      if (!labelled()) {
        p.valid = inputs_.is_valid(row.token);
        continue;
      }
      p.label = inputs_.label(row.token);
      if (bugs_.cp_roll_after_split && p.label != ignore && case_.batch.labels == BatchSpec::Labels::next_token) {
        // torch.roll(local_ids, -1) after the split: the next local row, whichever chunk it belongs to.
        const std::int64_t next = i + 1 < offsets[k + 1] ? i + 1 : offsets[k];
        const std::int64_t next_token = rows_in[static_cast<std::size_t>(next)].token;
        p.label = next_token >= 0 ? inputs_.token_id(next_token) : ignore;
      }
      if (bugs_.cp_pad_to_cp) p.label = label_with_cp_padding(assignment, row, i - group_start);
      p.valid = bugs_.ignore_index_unmasked ? true : p.label != ignore;
    }
  }
  for (RowPlan& p : rows_) p.active = p.valid;
  if (bugs_.zloss_on_ignored) {
    for (std::size_t i = 0; i < rows_.size(); ++i) rows_[i].active = rows_in[i].token >= 0;
  }
}

// cp-pad-to-cp: the label split assumes sequences padded to a multiple of CP, so its chunks of
// floor(L_pad' / 2CP) positions do not line up with the logits' chunks.
std::int64_t RankPlan::label_with_cp_padding(const RankAssignment& assignment, const LocalRow& row,
                                             std::int64_t local_index) const {
  const Sequence& seq = inputs_.batch().sequences()[static_cast<std::size_t>(row.sequence)];
  const std::int64_t cp = case_.layout.cp;
  const std::int64_t c = assignment.coordinates.cp;
  const std::int64_t chunk = padded_length(seq.length, cp) / (2 * cp);
  if (local_index >= 2 * chunk) return case_.loss.ignore_index;
  const std::int64_t position =
      local_index < chunk ? c * chunk + local_index : (2 * cp - 1 - c) * chunk + (local_index - chunk);
  return position < seq.length ? inputs_.label(seq.begin + position) : case_.loss.ignore_index;
}

// Valid-token counts over the batch group and each token's weights under the framework model.
void RankPlan::plan_weights(const RankAssignment& assignment, RankGroups& groups) {
  const auto& offsets = assignment.micro_batch_begin;
  const std::size_t ga = offsets.size() - 1;
  std::vector<std::int64_t> counts(2 * ga, 0);  // [valid per micro-batch | non-padding rows per micro-batch]
  for (std::size_t k = 0; k < ga; ++k) {
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      counts[k] += rows_[static_cast<std::size_t>(i)].valid;
      counts[ga + k] += assignment.rows[static_cast<std::size_t>(i)].token >= 0;
    }
  }
  std::int64_t rank_valid = 0;
  for (std::size_t k = 0; k < ga; ++k) rank_valid += counts[k];
  const std::vector<std::int64_t> local_valid(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(ga));
  groups.batch.allreduce_sum(std::span<std::int64_t>(counts));
  std::int64_t valid_total = 0;
  std::int64_t rows_total = 0;
  for (std::size_t k = 0; k < ga; ++k) {
    valid_total += counts[k];
    rows_total += counts[ga + k];
  }
  logged_valid_tokens_ = valid_total;
  if (bugs_.cp_stats_dp_only || bugs_.cp_loss_stat_dp_only) {
    // The valid tokens of this CP rank's slice, over the DP group only.
    std::int64_t dp_only[1] = {rank_valid};
    groups.dp.allreduce_sum(std::span<std::int64_t>(dp_only, 1));
    if (bugs_.cp_stats_dp_only) logged_valid_tokens_ = dp_only[0];
    slice_valid_tokens_ = dp_only[0];
  }

  const LayoutSpec& layout = case_.layout;
  const double scale = effective_gradient_scale(case_, inputs_.valid_tokens());
  const double data_ranks = static_cast<double>(layout.dp) * layout.cp;
  const Reduction reduction = case_.loss.reduction;
  double first_upstream = 1.0;
  for (const LocalRow& row : assignment.rows) {
    if (row.token >= 0) {
      first_upstream = inputs_.upstream_weight(row.token);
      break;
    }
  }
  const std::vector<double> mtp_weights = mtp_local_count_weights(assignment, rows_, inputs_, case_.layout.cp);
  std::vector<char> valid(rows_.size());
  for (std::size_t i = 0; i < rows_.size(); ++i) valid[i] = rows_[i].valid;
  kind_plan_ = kind_of(case_.loss).plan_rows(RowPlanRequest{case_, inputs_, assignment, valid, groups, bugs_});
  const std::optional<std::vector<double>>& kind_weights = kind_plan_.weights;
  for (std::size_t k = 0; k < ga; ++k) {
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      RowPlan& p = rows_[static_cast<std::size_t>(i)];
      // A kind may weigh rows that get no loss (a catalogued router bug routes padding as tokens): they are weighed
      // too.
      const bool weighed = kind_weights && (*kind_weights)[static_cast<std::size_t>(i)] != 0.0;
      if (!p.active && !weighed) continue;
      const std::int64_t token = assignment.rows[static_cast<std::size_t>(i)].token;
      double forward = 1.0;
      double backward = 0.0;
      if (reduction == Reduction::mean) {
        forward = 1.0 / static_cast<double>(valid_total);
        if (bugs_.mean_over_all_rows) forward = 1.0 / static_cast<double>(rows_total);
        if (bugs_.ga_microbatch_mean) forward = 1.0 / (static_cast<double>(layout.ga) * static_cast<double>(counts[k]));
        if (bugs_.dp_local_mean) forward = 1.0 / (data_ranks * static_cast<double>(rank_valid));
        if (bugs_.microbatch_local_mean) {
          // this rank's micro-batch over its own valid count, divided by GA; the ranks' losses averaged
          forward = 1.0 / (data_ranks * static_cast<double>(layout.ga) *
                           static_cast<double>(std::max<std::int64_t>(local_valid[k], 1)));
        }
        if (bugs_.mtp_local_count_ratio) forward = mtp_weights[k];
      } else if (reduction == Reduction::none) {
        forward = inputs_.upstream_weight(token);
      }
      if (kind_weights) forward = (*kind_weights)[static_cast<std::size_t>(i)];
      backward = forward / scale;
      if (reduction == Reduction::mean && bugs_.dp_local_mean) {
        // the rank's own mean, then the framework's DP x CP average: 1/(R N_r) after averaging
        backward = (1.0 / static_cast<double>(rank_valid)) *
                   (case_.framework.ga_reduce == FrameworkSpec::GaReduce::mean ? layout.ga : 1.0);
      }
      if (bugs_.microbatch_local_mean &&
          (kind_weights ? kind_plan_.rank_local_weights : reduction == Reduction::mean)) {
        // the rank's own gradient, 1/(GA n(r,k)) for a mean, whatever the framework then does with it (as
        // dp-local-mean): DP x CP averaging makes it the forward weight
        backward = forward * data_ranks *
                   (case_.framework.ga_reduce == FrameworkSpec::GaReduce::mean ? static_cast<double>(layout.ga) : 1.0);
      }
      if (reduction == Reduction::none && bugs_.none_divides_grad) {
        backward = inputs_.upstream_weight(token) / static_cast<double>(rows_total) / scale;
      }
      if (reduction == Reduction::none && bugs_.grad_output_first) backward = first_upstream / scale;
      if (bugs_.cp_duplicated_loss) backward *= layout.cp;
      if (bugs_.schedule_double_divide) backward /= static_cast<double>(layout.ga);
      p.forward_weight = static_cast<float>(forward);
      p.backward_weight = static_cast<float>(backward);
    }
  }
}

std::optional<float> RankPlan::logged_loss(const RankOutput& out, RankGroups& groups) const {
  if (case_.loss.reduction == Reduction::none) return std::nullopt;
  const std::vector<float>& token_loss = kind_plan_.separate_logged_loss ? out.logged_token_loss : out.token_loss;
  // cp-loss-stat-dp-only: the rank's own CP slice over the DP group, a mean by the slice's own count.
  const bool slice = bugs_.cp_loss_stat_dp_only;
  const auto slice_weight =
      static_cast<float>(1.0 / static_cast<double>(std::max<std::int64_t>(slice_valid_tokens_, 1)));
  const bool slice_mean = slice && case_.loss.reduction == Reduction::mean;
  const auto n = static_cast<std::int64_t>(rows_.size());
  std::vector<float> weighted(rows_.size(), 0.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    const RowPlan& p = rows_[static_cast<std::size_t>(i)];
    if (!p.active && p.forward_weight == 0.0f) continue;  // a weighed row without a loss of its own logs one too
    const float weight = slice_mean ? (p.valid ? slice_weight : 0.0f) : p.forward_weight;
    weighted[static_cast<std::size_t>(i)] = weight * token_loss[static_cast<std::size_t>(i)];
  }
  float reduced[1] = {pairwise_sum(weighted.data(), n)};
  (slice ? groups.dp : groups.batch).allreduce_sum(std::span<float>(reduced, 1));
  if (bugs_.compute_in_input_dtype && case_.loss.kind->logs_loss_in_input_dtype()) {
    return static_cast<float>(round_to_dtype(reduced[0], case_.inputs.dtype));
  }
  return reduced[0];
}

}  // namespace lossverify
