// What the shipped cases' generated inputs leave to chance, and no longer may (docs/cases.md, "What every shipped
// case covers"): labels on the first and last column of every vocabulary shard at the TP degrees the case and its
// sweep name, whatever layout builds the inputs; a sequence with no valid token in every policy case; and every
// clip region a policy case's settings allow, reached by some valid token.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/vocab_range.hpp"

using namespace lossverify;

namespace {

std::vector<Case> shipped_cases() {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(LOSSVERIFY_SOURCE_DIR) + "/cases")) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<Case> cases;
  for (const auto& file : files) cases.push_back(load_case_file(file.string(), {}));
  return cases;
}

std::vector<std::int64_t> labels_of(const Case& c) {
  const InputSource inputs(c);
  std::vector<std::int64_t> labels(static_cast<std::size_t>(c.shape.tokens));
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) labels[static_cast<std::size_t>(t)] = inputs.label(t);
  return labels;
}

// The shard edges (first and last column of each shard) at this TP degree that no valid label sits on.
std::vector<std::int64_t> edges_missed(const Case& c, const std::vector<std::int64_t>& labels, int tp) {
  const std::set<std::int64_t> present(labels.begin(), labels.end());
  std::vector<std::int64_t> missed;
  for (int r = 0; r < tp; ++r) {
    const VocabRange shard = vocab_range(c.shape.vocab, tp, r);
    for (const std::int64_t edge : {shard.begin, shard.end - 1}) {
      if (!present.contains(edge)) missed.push_back(edge);
    }
  }
  return missed;
}

bool is_policy(const Case& c) { return kind_of(c.loss).name() == "policy"; }

double logprob_at_temperature(const Case& c, const InputSource& inputs, std::int64_t token) {
  std::vector<double> row(static_cast<std::size_t>(c.shape.vocab));
  inputs.logits(token, 0, c.shape.vocab, row.data());
  const double inverse_t = 1.0 / policy_options(c.loss).temperature;
  double max = -INFINITY;
  for (double x : row) max = std::max(max, x * inverse_t);
  double sum = 0.0;
  for (double x : row) sum += std::exp(x * inverse_t - max);
  return row[static_cast<std::size_t>(inputs.label(token))] * inverse_t - max - std::log(sum);
}

// The clip outcomes the case's valid tokens reach, with the ratio (the token's, or its sequence's under GSPO) and
// the advantage (whitened when the case whitens) as the reference sees them.
std::set<std::string> clip_outcomes(const Case& c) {
  const PolicyOptions& o = policy_options(c.loss);
  const InputSource inputs(c);
  const auto n = static_cast<std::size_t>(c.shape.tokens);
  std::vector<double> log_ratio(n, 0.0), advantage(n, 0.0);
  std::vector<bool> valid(n, false);
  double advantage_sum = 0.0, valid_count = 0.0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    const auto i = static_cast<std::size_t>(t);
    valid[i] = inputs.is_valid(t);
    if (!valid[i]) continue;
    const PolicyTokenInputs in = policy_token_inputs(c, inputs, t);
    log_ratio[i] = logprob_at_temperature(c, inputs, t) - in.old_logprob;
    advantage[i] = in.advantage;
    advantage_sum += in.advantage;
    valid_count += 1.0;
  }
  if (o.ratio == PolicyOptions::Ratio::sequence) {
    for (const Sequence& s : inputs.batch().sequences()) {
      double sum = 0.0, count = 0.0;
      for (std::int64_t t = s.begin; t < s.begin + s.length; ++t) {
        if (valid[static_cast<std::size_t>(t)]) sum += log_ratio[static_cast<std::size_t>(t)], count += 1.0;
      }
      for (std::int64_t t = s.begin; t < s.begin + s.length; ++t) log_ratio[static_cast<std::size_t>(t)] = sum / count;
    }
  }
  const double mean = advantage_sum / valid_count;
  std::set<std::string> reached;
  for (std::size_t i = 0; i < n; ++i) {
    if (!valid[i]) continue;
    const double rho = std::exp(log_ratio[i]);
    const bool positive = o.whiten_advantages ? advantage[i] > mean : advantage[i] > 0.0;
    if (positive) {
      reached.insert(rho > 1.0 + o.clip_high ? "upper clip" : "unclipped, A > 0");
    } else if (o.dual_clip > 0.0 && rho > o.dual_clip) {
      reached.insert("dual clip");
    } else {
      reached.insert(rho < 1.0 - o.clip_low ? "lower clip" : "unclipped, A < 0");
    }
  }
  return reached;
}

}  // namespace

TEST_CASE("shipped_cases_put_labels_on_every_shard_edge_of_their_tp_degrees") {
  for (const Case& c : shipped_cases()) {
    if (!kind_of(c.loss).inputs().labels) continue;
    CAPTURE(c.name);
    const std::vector<std::int64_t> labels = labels_of(c);
    std::set<int> degrees(c.sweep.tp.begin(), c.sweep.tp.end());
    degrees.insert(c.layout.tp);
    for (const int tp : degrees) {
      CAPTURE(tp);
      CHECK(edges_missed(c, labels, tp).empty());
    }
  }
}

TEST_CASE("labels_on_shard_edges_do_not_depend_on_the_layout_that_builds_the_inputs") {
  for (const Case& c : shipped_cases()) {
    if (!kind_of(c.loss).inputs().labels) continue;
    CAPTURE(c.name);
    Case other = c;
    other.layout.tp = c.layout.tp == 1 ? 2 : 1;
    other.layout.cp = c.layout.cp == 1 ? 2 : 1;
    CHECK(labels_of(other) == labels_of(c));
  }
}

TEST_CASE("labels_on_shard_edges_keep_the_mask") {
  // Only the ids of valid tokens move: exactly the tokens that are neither masked nor a sequence's last stay valid,
  // and both ends of the vocabulary are among their labels.
  const Case c = load_case_file(std::string(LOSSVERIFY_SOURCE_DIR) + "/cases/cp-zigzag-packed.json", {});
  REQUIRE(c.inputs.overrides.empty());
  const std::vector<std::int64_t> labels = labels_of(c);
  const InputSource inputs(c);
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    CAPTURE(t);
    const bool valid = labels[static_cast<std::size_t>(t)] != c.loss.ignore_index;
    CHECK(valid == !(inputs.masked(t) || inputs.batch().is_last_of_sequence(t)));
  }
  CHECK(std::count(labels.begin(), labels.end(), 0) >= 1);
  CHECK(std::count(labels.begin(), labels.end(), c.shape.vocab - 1) >= 1);
}

TEST_CASE("labels_on_shard_edges_ignore_the_overrides_so_pinned_rows_change_no_other_label") {
  // A bundle pins rows as override rows (logits and label): every other token keeps its label.
  const Case c = load_case_file(std::string(LOSSVERIFY_SOURCE_DIR) + "/cases/cp-zigzag-packed.json", {});
  const std::vector<std::int64_t> before = labels_of(c);
  Case pinned = c;
  for (const std::int64_t token : {3, 20, 31}) {
    RowOverride row;
    row.token = token;
    row.label = (before[static_cast<std::size_t>(token)] + 1) % c.shape.vocab;
    pinned.inputs.overrides.push_back(row);
  }
  std::vector<std::int64_t> after = labels_of(pinned);
  for (const std::int64_t token : {3, 20, 31})
    after[static_cast<std::size_t>(token)] = before[static_cast<std::size_t>(token)];
  CHECK(after == before);
}

TEST_CASE("shipped_policy_cases_hold_a_sequence_with_no_valid_token") {
  for (const Case& c : shipped_cases()) {
    if (!is_policy(c)) continue;
    CAPTURE(c.name);
    const InputSource inputs(c);
    std::int64_t empty = 0;
    for (const Sequence& s : inputs.batch().sequences()) {
      bool any = false;
      for (std::int64_t t = s.begin; t < s.begin + s.length; ++t) any = any || inputs.is_valid(t);
      empty += !any;
    }
    CHECK(empty >= 1);
  }
}

TEST_CASE("shipped_policy_cases_reach_every_clip_region_their_settings_allow") {
  for (const Case& c : shipped_cases()) {
    if (!is_policy(c) || policy_options(c.loss).objective != PolicyOptions::Objective::policy_loss) continue;
    CAPTURE(c.name);
    std::set<std::string> wanted = {"upper clip", "lower clip", "unclipped, A > 0", "unclipped, A < 0"};
    if (policy_options(c.loss).dual_clip > 0.0) wanted.insert("dual clip");
    const std::set<std::string> reached = clip_outcomes(c);
    for (const std::string& region : wanted) {
      CAPTURE(region);
      CHECK(reached.contains(region));
    }
  }
}
