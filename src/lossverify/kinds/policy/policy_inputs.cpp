#include "lossverify/kinds/policy/policy_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "lossverify/layout/global_batch.hpp"

namespace lossverify {

namespace {

struct Interval {
  double low, high;
};

// The intervals between the clip edges that ratios are drawn from, each shrunk by the margin at both ends,
// with the share of tokens each gets: below 1 - eps_low, unclipped, above 1 + eps_high, beyond c.
struct Placement {
  std::vector<Interval> intervals;
  std::vector<double> shares;
};

Placement placement(const PolicyOptions& o) {
  std::vector<double> edges = {1.0 - o.clip_low, 1.0 + o.clip_high};
  if (o.dual_clip > 0.0) edges.push_back(o.dual_clip);
  std::sort(edges.begin(), edges.end());
  edges.erase(std::unique(edges.begin(), edges.end()), edges.end());
  std::vector<Interval> raw = {{0.5 * edges.front(), edges.front()}};
  for (std::size_t k = 0; k + 1 < edges.size(); ++k) raw.push_back({edges[k], edges[k + 1]});
  raw.push_back({edges.back(), edges.back() + std::max(0.5, 0.5 * (edges.back() - edges.front()))});
  Placement p;
  for (const Interval& i : raw) {
    const double margin = std::min(0.02, 0.1 * (i.high - i.low));
    p.intervals.push_back({i.low + margin, i.high - margin});
  }
  // The unclipped interval (the second) gets the largest share; every other an equal part of the rest.
  for (std::size_t k = 0; k < p.intervals.size(); ++k) {
    p.shares.push_back(k == 1 ? 0.4 : 0.6 / static_cast<double>(p.intervals.size() - 1));
  }
  return p;
}

// A case's override of one of the token's inputs (kPolicyTokenInputNames[index]), if it has one.
std::optional<float> overridden(const InputSource& inputs, std::int64_t token, std::size_t index) {
  const RowOverride* row = inputs.override_of(token);
  if (row == nullptr) return std::nullopt;
  const auto it = row->token_inputs.find(kPolicyTokenInputNames[index]);
  if (it == row->token_inputs.end()) return std::nullopt;
  return static_cast<float>(it->second);
}

}  // namespace

namespace {

double advantage_draw(const Case& c, std::int64_t sequence) {
  return token_uniform(c.inputs.seed, InputStream::policy_advantage, static_cast<std::uint64_t>(sequence));
}

}  // namespace

// GRPO's group-normalised advantages take both signs in every group, and a case of a few sequences drawn
// independently could have one sign only (a clip region then goes unreached). Within each window of eight
// consecutive sequences, the larger half of the draws of those holding a valid token are positive (ties have
// probability 0); a sequence without one takes its draw's sign (it weighs nothing).
bool generated_advantage_positive(const Case& c, const InputSource& inputs, std::int64_t sequence) {
  const double u = advantage_draw(c, sequence);
  if (!inputs.sequence_has_valid_token(sequence)) return u >= 0.5;
  const auto count = static_cast<std::int64_t>(inputs.batch().sequences().size());
  const std::int64_t first = sequence - sequence % 8;
  std::int64_t valid = 0, above = 0;
  for (std::int64_t s = first; s < std::min(first + 8, count); ++s) {
    if (!inputs.sequence_has_valid_token(s)) continue;
    ++valid;
    above += advantage_draw(c, s) > u;
  }
  return above < (valid + 1) / 2;
}

float policy_token_advantage(const Case& c, const InputSource& inputs, std::int64_t token) {
  if (inputs.is_explicit()) return inputs.explicit_token_input(2)[static_cast<std::size_t>(token)];
  if (const std::optional<float> value = overridden(inputs, token, 2)) return *value;
  const std::int64_t sequence = inputs.batch().sequence_of(token);
  // |A| in [0.2, 2]: away from 0, where the clip's side flips.
  const double magnitude = 0.2 + 1.8 * std::fabs(2.0 * advantage_draw(c, sequence) - 1.0);
  return static_cast<float>(generated_advantage_positive(c, inputs, sequence) ? magnitude : -magnitude);
}

namespace {

// A ratio drawn from the placement's intervals by one Philox block (the token's, or the sequence's).
double placed_ratio(const Placement& p, const PhiloxBlock& r) {
  const double pick = uniform_open01(r.word[0], r.word[1]);
  const double where = uniform_open01(r.word[2], r.word[3]);
  std::size_t k = 0;
  for (double acc = p.shares[0]; k + 1 < p.shares.size() && pick > acc; acc += p.shares[++k]) {
  }
  return p.intervals[k].low + where * (p.intervals[k].high - p.intervals[k].low);
}

// The clip outcome a ratio gets under an advantage of the given sign: 0 unclipped, 1 the upper clip (A > 0),
// 2 the lower clip (A < 0), 3 the dual clip (A < 0, rho > c).
int clip_outcome(const PolicyOptions& o, double rho, bool positive) {
  if (positive) return rho > 1.0 + o.clip_high ? 1 : 0;
  if (o.dual_clip > 0.0 && rho > o.dual_clip) return 3;
  return rho < 1.0 - o.clip_low ? 2 : 0;
}

// The placement's intervals in the order the sequences of one advantage sign take them: one interval of each clip
// outcome that sign can reach, then the unclipped interval around 1 (always the second), then the rest.
std::vector<std::size_t> interval_order(const PolicyOptions& o, const Placement& p, bool positive) {
  std::vector<std::size_t> order;
  std::vector<std::size_t> rest = {1};
  std::vector<int> outcomes;
  for (std::size_t k = 0; k < p.intervals.size(); ++k) {
    const int outcome = clip_outcome(o, 0.5 * (p.intervals[k].low + p.intervals[k].high), positive);
    if (outcome != 0 && std::find(outcomes.begin(), outcomes.end(), outcome) == outcomes.end()) {
      outcomes.push_back(outcome);
      order.push_back(k);
    } else if (k != 1) {
      rest.push_back(k);
    }
  }
  order.insert(order.end(), rest.begin(), rest.end());
  return order;
}

// A sequence's ratio rho_s. A case has a few sequences, so drawing each one's interval would leave a clip region
// to chance (eight sequences miss the upper clip about one time in six). Instead, within every window of eight
// consecutive sequences, those of one advantage sign (generated_advantage_positive) that hold a valid token take
// interval_order's intervals in turn: two sequences of each sign reach every clip region the settings allow.
// Where in the interval stays drawn.
double placed_sequence_ratio(const Case& c, const InputSource& inputs, const Placement& p, std::int64_t s,
                             const PhiloxBlock& r) {
  const PolicyOptions& o = policy_options(c.loss);
  const bool positive = generated_advantage_positive(c, inputs, s);
  std::size_t turn = 0;
  for (std::int64_t before = s - s % 8; before < s; ++before) {
    turn += inputs.sequence_has_valid_token(before) && generated_advantage_positive(c, inputs, before) == positive;
  }
  const std::vector<std::size_t> order = interval_order(o, p, positive);
  const Interval& i = p.intervals[order[turn % order.size()]];
  return i.low + uniform_open01(r.word[2], r.word[3]) * (i.high - i.low);
}

// Under the sequence-level ratio, each token's spread j_t around its sequence's log-ratio, in [-0.15, 0.15].
double sequence_spread(const Case& c, std::int64_t token) {
  const PhiloxBlock r = philox_block(c.inputs.seed, InputStream::policy_ratio, static_cast<std::uint64_t>(token), 1);
  return 0.15 * (2.0 * uniform_open01(r.word[0], r.word[1]) - 1.0);
}

// The token's log(lambda / old) as placed: log of its own ratio, or under the sequence-level ratio its
// sequence's log rho_s plus the token's spread less the spreads' mean over the sequence's valid tokens, so
// that the mean of lambda - old over the sequence is exactly log rho_s (a margin from every edge), while each
// token's own ratio differs from rho_s (a token-level ratio does not pass for the sequence's).
double placed_log_ratio(const Case& c, const InputSource& inputs, std::int64_t token) {
  const PolicyOptions& o = policy_options(c.loss);
  const Placement p = placement(o);
  if (o.ratio == PolicyOptions::Ratio::token) {
    return std::log(
        placed_ratio(p, philox_block(c.inputs.seed, InputStream::policy_ratio, static_cast<std::uint64_t>(token), 0)));
  }
  const std::int64_t s = inputs.batch().sequence_of(token);
  const Sequence& sequence = inputs.batch().sequences()[static_cast<std::size_t>(s)];
  const PhiloxBlock r = philox_block(c.inputs.seed, InputStream::policy_ratio, static_cast<std::uint64_t>(s), 2);
  double spread_sum = 0.0;
  std::int64_t valid = 0;
  for (std::int64_t t = sequence.begin; t < sequence.begin + sequence.length; ++t) {
    if (!inputs.is_valid(t)) continue;
    spread_sum += sequence_spread(c, t);
    ++valid;
  }
  return std::log(placed_sequence_ratio(c, inputs, p, s, r)) + sequence_spread(c, token) -
         spread_sum / static_cast<double>(valid);
}

}  // namespace

PolicyRowLogits::PolicyRowLogits(const Case& c, const InputSource& inputs)
    : case_(c), inputs_(inputs), stage_(c.loss.stage != nullptr ? c.loss.stage->float64_logits(c, inputs) : nullptr) {}

PolicyRowLogits::~PolicyRowLogits() = default;

void PolicyRowLogits::row(std::int64_t token, std::span<double> out, std::span<double> error) const {
  if (stage_ != nullptr) {
    stage_->row(token, out, error);
    return;
  }
  inputs_.logits(token, 0, case_.shape.vocab, out.data());
  std::fill(error.begin(), error.end(), 0.0);
}

double policy_placement_logprob(const Case& c, std::span<const double> row, std::int64_t label) {
  const double inverse_t = 1.0 / policy_options(c.loss).temperature;
  double max = -INFINITY;
  for (double x : row) max = std::max(max, x * inverse_t);
  double sum = 0.0;
  for (double x : row) sum += std::exp(x * inverse_t - max);
  return row[static_cast<std::size_t>(label)] * inverse_t - max - std::log(sum);
}

PolicyTokenInputs policy_token_inputs(const Case& c, const InputSource& inputs, std::int64_t token) {
  const PolicyRowLogits logits(c, inputs);
  return policy_token_inputs(c, inputs, logits, token);
}

PolicyTokenInputs policy_token_inputs(const Case& c, const InputSource& inputs, const PolicyRowLogits& logits,
                                      std::int64_t token) {
  std::vector<double> row;
  if (!inputs.is_explicit() && inputs.is_valid(token)) {
    row.resize(static_cast<std::size_t>(c.shape.vocab));
    logits.row(token, row);
  }
  return policy_token_inputs_from_row(c, inputs, token, row);
}

PolicyTokenInputs policy_token_inputs_from_row(const Case& c, const InputSource& inputs, std::int64_t token,
                                               std::span<const double> row) {
  PolicyTokenInputs in;
  in.advantage = policy_token_advantage(c, inputs, token);
  if (inputs.is_explicit()) {
    const auto t = static_cast<std::size_t>(token);
    in.old_logprob = inputs.explicit_token_input(0)[t];
    in.ref_logprob = inputs.explicit_token_input(1)[t];
    return in;
  }
  if (!inputs.is_valid(token)) return in;
  const double logprob = policy_placement_logprob(c, row, inputs.label(token));
  in.old_logprob = static_cast<float>(logprob - placed_log_ratio(c, inputs, token));
  const double v = token_uniform(c.inputs.seed, InputStream::policy_reference, static_cast<std::uint64_t>(token));
  const double gap = 0.05 + 0.45 * std::fabs(2.0 * v - 1.0);
  in.ref_logprob = static_cast<float>(logprob - (v < 0.5 ? -gap : gap));
  if (const std::optional<float> old = overridden(inputs, token, 0)) in.old_logprob = *old;
  if (const std::optional<float> ref = overridden(inputs, token, 1)) in.ref_logprob = *ref;
  return in;
}

}  // namespace lossverify
