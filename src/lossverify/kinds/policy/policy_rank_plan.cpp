// The framework side of a policy loss on one rank, before its kernels run: each row's weight in the
// step's objective under the case's aggregation (docs/spec.md §3.3), with the catalogued aggregation bugs,
// and each row's old and reference log-probabilities and whitened advantage.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

namespace {

using Aggregation = PolicyOptions::Aggregation;

// Valid tokens of every sequence of the step, over the batch group (every rank gets every count).
std::vector<std::int64_t> sequence_counts(const RowPlanRequest& q) {
  std::vector<std::int64_t> counts(q.inputs.batch().sequences().size(), 0);
  for (std::size_t i = 0; i < q.assignment.rows.size(); ++i) {
    if (q.valid[i]) ++counts[static_cast<std::size_t>(q.assignment.rows[i].sequence)];
  }
  q.groups.batch.allreduce_sum(std::span<std::int64_t>(counts));
  return counts;
}

// Per DP rank and micro-batch: its valid tokens (over its CP group) and its sequences that hold any.
struct MicroBatchCounts {
  std::vector<std::int64_t> tokens, sequences;  // [dp * GA + k]
  std::int64_t at(const std::vector<std::int64_t>& v, int dp, std::size_t k, std::size_t ga) const {
    return v[static_cast<std::size_t>(dp) * ga + k];
  }
};

MicroBatchCounts micro_batch_counts(const RowPlanRequest& q, const std::vector<std::int64_t>& per_sequence) {
  const auto& offsets = q.assignment.micro_batch_begin;
  const std::size_t ga = offsets.size() - 1;
  const int dp = q.assignment.coordinates.dp;
  MicroBatchCounts m;
  m.tokens.assign(static_cast<std::size_t>(q.c.layout.dp) * ga, 0);
  m.sequences = m.tokens;
  for (std::size_t k = 0; k < ga; ++k) {
    std::set<std::int64_t> sequences;
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const auto row = static_cast<std::size_t>(i);
      m.tokens[static_cast<std::size_t>(dp) * ga + k] += q.valid[row];
      const std::int64_t s = q.assignment.rows[row].sequence;
      if (per_sequence[static_cast<std::size_t>(s)] > 0) sequences.insert(s);
    }
    // Every CP rank holds a part of each of its sequences: the first counts them.
    if (q.assignment.coordinates.cp == 0) {
      m.sequences[static_cast<std::size_t>(dp) * ga + k] = static_cast<std::int64_t>(sequences.size());
    }
  }
  q.groups.batch.allreduce_sum(std::span<std::int64_t>(m.tokens));
  q.groups.batch.allreduce_sum(std::span<std::int64_t>(m.sequences));
  return m;
}

// Each row's weight in L. Correct: token-mean 1/N, token-sum 1, seq-mean-token-sum 1/B,
// seq-mean-token-mean 1/(B n_s), seq-mean-token-sum-norm 1/(B H_max), B the sequences that hold a valid token.
std::vector<double> row_weights(const RowPlanRequest& q, const PolicyOptions& o,
                                const std::vector<std::int64_t>& per_sequence, const MicroBatchCounts& m) {
  const std::uint64_t bugs = q.bugs.kind_switches;
  const bool count_empty = (bugs & policy_bug::seq_mean_counts_empty) != 0;
  std::int64_t tokens = 0, sequences = 0;
  for (std::int64_t n : per_sequence) {
    tokens += n;
    sequences += n > 0 || count_empty;
  }
  const auto& offsets = q.assignment.micro_batch_begin;
  const std::size_t ga = offsets.size() - 1;
  const int dp = q.assignment.coordinates.dp;
  const auto dp_size = static_cast<double>(q.c.layout.dp);
  std::int64_t rank_sequences = 0;
  for (std::size_t k = 0; k < ga; ++k) rank_sequences += m.at(m.sequences, dp, k, ga);
  std::vector<double> w(q.assignment.rows.size(), 0.0);
  for (std::size_t k = 0; k < ga; ++k) {
    const auto micro_tokens = static_cast<double>(std::max<std::int64_t>(m.at(m.tokens, dp, k, ga), 1));
    const auto micro_sequences = static_cast<double>(m.at(m.sequences, dp, k, ga));
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const auto row = static_cast<std::size_t>(i);
      if (!q.valid[row]) continue;
      const auto n_s = static_cast<double>(per_sequence[static_cast<std::size_t>(q.assignment.rows[row].sequence)]);
      double weight = 0.0;
      switch (o.aggregation) {
        case Aggregation::token_mean:
          weight = 1.0 / static_cast<double>(tokens);
          if (bugs & policy_bug::token_mean_sample_weighted) {
            weight = (1.0 / micro_tokens) * (micro_sequences / static_cast<double>(rank_sequences)) / dp_size;
          }
          if (bugs & policy_bug::microbatch_self_normalized) weight = 1.0 / (dp_size * micro_tokens);
          break;
        case Aggregation::token_sum:
          weight = 1.0;
          break;
        case Aggregation::seq_mean_token_sum:
          weight = 1.0 / static_cast<double>(sequences);
          break;
        case Aggregation::seq_mean_token_mean:
          weight = 1.0 / (static_cast<double>(sequences) * n_s);
          break;
        case Aggregation::seq_mean_token_sum_norm:
          weight = 1.0 / (static_cast<double>(sequences) * o.norm_constant);
          if (bugs & policy_bug::drgrpo_batch_sum) weight *= micro_sequences;
          if (bugs & policy_bug::drgrpo_rank_batch_sum) weight = 1.0 / (dp_size * o.norm_constant);
          break;
      }
      w[row] = weight;
    }
  }
  return w;
}

// microbatch-local-mean: each rank's micro-batch aggregated with its own counts (its valid rows, its
// sequences B_k with valid rows there and each one's n_s within it), divided by GA, the ranks' results averaged
// over DP x CP. token-sum has no count: it keeps its weight (as a reduction sum does).
std::vector<double> rank_local_weights(const RowPlanRequest& q, const PolicyOptions& o, std::vector<double> w) {
  const auto& offsets = q.assignment.micro_batch_begin;
  const std::size_t ga = offsets.size() - 1;
  const double divisor = static_cast<double>(q.c.layout.dp) * q.c.layout.cp * static_cast<double>(ga);
  for (std::size_t k = 0; k < ga; ++k) {
    std::map<std::int64_t, std::int64_t> own;  // sequence -> its valid rows in this micro-batch on this rank
    std::int64_t tokens = 0;
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const auto row = static_cast<std::size_t>(i);
      if (!q.valid[row]) continue;
      ++own[q.assignment.rows[row].sequence];
      ++tokens;
    }
    const auto b_k = static_cast<double>(own.size());
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const auto row = static_cast<std::size_t>(i);
      if (!q.valid[row]) continue;
      const auto n_s = static_cast<double>(own[q.assignment.rows[row].sequence]);
      switch (o.aggregation) {
        case Aggregation::token_mean:
          w[row] = 1.0 / (static_cast<double>(tokens) * divisor);
          break;
        case Aggregation::token_sum:
          break;
        case Aggregation::seq_mean_token_sum:
          w[row] = 1.0 / (b_k * divisor);
          break;
        case Aggregation::seq_mean_token_mean:
          w[row] = 1.0 / (b_k * n_s * divisor);
          break;
        case Aggregation::seq_mean_token_sum_norm:
          w[row] = 1.0 / (b_k * o.norm_constant * divisor);
          break;
      }
    }
  }
  return w;
}

// rl-stats-microbatch-mean: each logged token statistic a token mean over micro-batch k of every rank
// (its valid rows over DP x CP, N_k), the K micro-batches' means then averaged: weight 1/(K N_k).
std::vector<double> microbatch_statistic_weights(const RowPlanRequest& q, const MicroBatchCounts& m) {
  const auto& offsets = q.assignment.micro_batch_begin;
  const std::size_t ga = offsets.size() - 1;
  std::vector<double> w(q.assignment.rows.size(), 0.0);
  for (std::size_t k = 0; k < ga; ++k) {
    std::int64_t step_tokens = 0;  // N_k
    for (int dp = 0; dp < q.c.layout.dp; ++dp) step_tokens += m.at(m.tokens, dp, k, ga);
    const double weight = 1.0 / (static_cast<double>(std::max<std::int64_t>(step_tokens, 1)) * static_cast<double>(ga));
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      if (q.valid[static_cast<std::size_t>(i)]) w[static_cast<std::size_t>(i)] = weight;
    }
  }
  return w;
}

// The aux-term bugs: the KL's and the entropy's own weight per row, whatever the aggregation, divided by the
// row's weight w. rl-aux-token-mean: both 1/N. rl-aux-sample-weighted: within micro-batch k of a DP rank, the KL
// a mean over its b_k sequences of each one's token mean, the entropy its token mean over N_k, each weighted by
// b_k / B_r, then the DP mean. rl-aux-microbatch-mean: the same means, each micro-batch / K.
void aux_weight_ratios(const RowPlanRequest& q, const std::vector<std::int64_t>& per_sequence,
                       const MicroBatchCounts& m, const std::vector<double>& w, std::vector<float>& in) {
  const std::uint64_t bugs = q.bugs.kind_switches;
  const auto& offsets = q.assignment.micro_batch_begin;
  const std::size_t ga = offsets.size() - 1;
  const int dp = q.assignment.coordinates.dp;
  const auto dp_size = static_cast<double>(q.c.layout.dp);
  std::int64_t tokens = 0, rank_sequences = 0;
  for (std::int64_t n : per_sequence) tokens += n;
  for (std::size_t k = 0; k < ga; ++k) rank_sequences += m.at(m.sequences, dp, k, ga);
  for (std::size_t k = 0; k < ga; ++k) {
    const auto n_k = static_cast<double>(std::max<std::int64_t>(m.at(m.tokens, dp, k, ga), 1));
    const auto b_k = static_cast<double>(std::max<std::int64_t>(m.at(m.sequences, dp, k, ga), 1));
    // micro-batch k's weight in the rank's step: b_k / B_r, or 1 / K
    const double share = (bugs & policy_bug::aux_sample_weighted)
                             ? b_k / static_cast<double>(std::max<std::int64_t>(rank_sequences, 1))
                             : 1.0 / static_cast<double>(ga);
    for (std::int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      const auto row = static_cast<std::size_t>(i);
      if (!q.valid[row] || w[row] == 0.0) continue;
      double kl = 1.0 / static_cast<double>(tokens), entropy = kl;
      if (bugs & (policy_bug::aux_sample_weighted | policy_bug::aux_microbatch_mean)) {
        const auto n_s = static_cast<double>(per_sequence[static_cast<std::size_t>(q.assignment.rows[row].sequence)]);
        kl = share / (b_k * n_s * dp_size);
        entropy = share / (n_k * dp_size);
      }
      in[row * kPolicyRowInputs + 4] = static_cast<float>(kl / w[row]);
      in[row * kPolicyRowInputs + 5] = static_cast<float>(entropy / w[row]);
    }
  }
}

// Old and reference log-probabilities and the advantage of every valid row, the advantage whitened over the
// step's valid tokens (DP x CP; DP only under adv-whiten-dp-only) with the unbiased deviation.
std::vector<float> row_inputs(const RowPlanRequest& q, const PolicyOptions& o) {
  const std::size_t rows = q.assignment.rows.size();
  std::vector<float> in(rows * kPolicyRowInputs, 0.0f);
  double moments[3] = {0.0, 0.0, 0.0};  // n, sum A, sum A^2
  const PolicyRowLogits logits(q.c, q.inputs);
  for (std::size_t i = 0; i < rows; ++i) {
    in[i * kPolicyRowInputs + 4] = 1.0f;
    in[i * kPolicyRowInputs + 5] = 1.0f;
    if (!q.valid[i]) continue;
    const PolicyTokenInputs t = policy_token_inputs(q.c, q.inputs, logits, q.assignment.rows[i].token);
    in[i * kPolicyRowInputs] = t.old_logprob;
    in[i * kPolicyRowInputs + 1] = t.ref_logprob;
    in[i * kPolicyRowInputs + 2] = t.advantage;
    in[i * kPolicyRowInputs + 3] = static_cast<float>(q.assignment.rows[i].sequence);
    moments[0] += 1.0;
    moments[1] += t.advantage;
    moments[2] += static_cast<double>(t.advantage) * t.advantage;
  }
  if (!o.whiten_advantages) return in;
  Communicator& over = (q.bugs.kind_switches & policy_bug::adv_whiten_dp_only) ? q.groups.dp : q.groups.batch;
  over.allreduce_sum(std::span<double>(moments));
  const double n = std::max(moments[0], 1.0);
  const double mean = moments[1] / n;
  const double variance = n > 1.0 ? std::max(moments[2] - n * mean * mean, 0.0) / (n - 1.0) : 0.0;
  const auto mean_f = static_cast<float>(mean);
  const float scale = 1.0f / (static_cast<float>(std::sqrt(variance)) + static_cast<float>(o.whiten_epsilon));
  for (std::size_t i = 0; i < rows; ++i) {
    if (q.valid[i]) in[i * kPolicyRowInputs + 2] = (in[i * kPolicyRowInputs + 2] - mean_f) * scale;
  }
  return in;
}

}  // namespace

KindRowPlan plan_policy_rows(const RowPlanRequest& q) {
  const PolicyOptions& o = policy_options(q.c.loss);
  const std::vector<std::int64_t> per_sequence = sequence_counts(q);
  // Per DP rank and micro-batch, its tokens and sequences: one all-reduce, read by every weighting below.
  const MicroBatchCounts counts = micro_batch_counts(q, per_sequence);
  KindRowPlan plan;
  std::vector<double> weights = row_weights(q, o, per_sequence, counts);
  if (o.objective == PolicyOptions::Objective::policy_loss) {
    plan.row_inputs = row_inputs(q, o);
    const std::uint64_t aux_bugs =
        policy_bug::aux_token_mean | policy_bug::aux_sample_weighted | policy_bug::aux_microbatch_mean;
    if ((q.bugs.kind_switches & aux_bugs) != 0) {
      aux_weight_ratios(q, per_sequence, counts, weights, plan.row_inputs);
      plan.separate_logged_loss = true;
    }
  }
  if (q.bugs.microbatch_local_mean) {
    weights = rank_local_weights(q, o, std::move(weights));
    plan.rank_local_weights = o.aggregation != Aggregation::token_sum;
  }
  const std::uint64_t weight_bugs = policy_bug::token_mean_sample_weighted | policy_bug::microbatch_self_normalized;
  if (o.sequence_mean() || q.bugs.microbatch_local_mean || (q.bugs.kind_switches & weight_bugs) != 0) {
    plan.weights = std::move(weights);
  }
  if ((q.bugs.kind_switches & policy_bug::stats_microbatch_mean) != 0) {
    plan.statistic_weights = microbatch_statistic_weights(q, counts);
  }
  plan.sequences = static_cast<std::int64_t>(per_sequence.size());
  return plan;
}

}  // namespace lossverify
