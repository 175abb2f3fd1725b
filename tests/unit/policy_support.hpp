#pragma once
// What the policy kind's unit tests share: a small policy case, the failing checks of a run, an implementation's
// effective gradients, and where each valid token sits with the counts the aggregation modes read.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

namespace lossverify::testing {

// Six unequal sequences, T = 0.7, asymmetric and dual clip, k3 KL, an entropy bonus, whitening, token-mean.
inline nlohmann::json policy_json(int tp, int cp, int dp, int ga) {
  return {{"name", "policy"},
          {"shape", {{"vocab", 200}}},
          {"batch", {{"sequence_lengths", {21, 9, 30, 12, 17, 5}}}},
          {"loss",
           {{"kind", "policy"},
            {"temperature", 0.7},
            {"clip_low", 0.2},
            {"clip_high", 0.28},
            {"dual_clip", 3.0},
            {"kl_penalty", "k3"},
            {"kl_coef", 0.05},
            {"entropy_coef", 0.01},
            {"whiten_advantages", true}}},
          {"inputs", {{"seed", 17}, {"scale", 2.0}, {"ignore_fraction", 0.2}}},
          {"layout", {{"tp", tp}, {"cp", cp}, {"dp", dp}, {"ga", ga}}},
          {"timeout_seconds", 60.0}};
}

inline std::vector<std::string> failing(const RunResult& r) {
  std::vector<std::string> names;
  for (const CheckResult& c : r.checks) {
    if (c.verdict == Verdict::fail) names.push_back(c.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The effective gradients of an implementation, per (token, column), from its rank outputs.
inline std::map<std::pair<std::int64_t, std::int64_t>, double> gradients(const Case& c, const std::string& impl) {
  const InputSource inputs(c);
  RunOptions options;
  options.threads = 1;
  const RankRun run = execute_ranks(c, inputs, *find_implementation(impl), options);
  std::map<std::pair<std::int64_t, std::int64_t>, double> g;
  for (const RankOutput& out : run.outputs) {
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      if (out.token_of(i) < 0) continue;
      for (std::int64_t v = 0; v < out.columns(); ++v) {
        g[{out.token_of(i), out.assignment.vocab.begin + v}] = out.grad_at(i, out.assignment.vocab.begin + v);
      }
    }
  }
  return g;
}

// got / correct over the elements where the correct gradient is not tiny: {min, max}.
inline std::pair<double, double> ratio_range(const Case& c, const std::string& impl) {
  const auto right = gradients(c, "correct");
  const auto wrong = gradients(c, impl);
  double low = INFINITY, high = -INFINITY;
  for (const auto& [at, value] : right) {
    if (std::fabs(value) < 1e-7) continue;
    const double r = wrong.at(at) / value;
    low = std::min(low, r);
    high = std::max(high, r);
  }
  return {low, high};
}

// Where each valid token sits (world rank, micro-batch) and the counts the aggregation modes read, from the rank
// assignments of a correct run.
struct TokenWeights {
  std::map<std::int64_t, std::int64_t> sequence_of;  // valid token -> its sequence
  std::map<std::int64_t, std::int64_t> n_s;          // sequence -> its valid tokens over the step
  // world rank and micro-batch of each valid token, and the counts of that micro-batch on that rank
  std::map<std::int64_t, std::pair<int, std::size_t>> place;
  std::map<std::pair<int, std::size_t>, std::map<std::int64_t, std::int64_t>> local;  // -> sequence -> n there
};

inline TokenWeights token_weights(const Case& c) {
  const InputSource inputs(c);
  RunOptions options;
  options.threads = 1;
  const RankRun run = execute_ranks(c, inputs, *find_implementation("correct"), options);
  TokenWeights t;
  for (const RankOutput& out : run.outputs) {
    if (out.assignment.coordinates.tp != 0) continue;
    const auto& begin = out.assignment.micro_batch_begin;
    for (std::size_t k = 0; k + 1 < begin.size(); ++k) {
      for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i) {
        const std::int64_t token = out.token_of(i);
        if (token < 0 || !inputs.is_valid(token)) continue;
        const std::int64_t s = out.assignment.rows[static_cast<std::size_t>(i)].sequence;
        t.sequence_of[token] = s;
        ++t.n_s[s];
        t.place[token] = {out.assignment.world_rank, k};
        ++t.local[{out.assignment.world_rank, k}][s];
      }
    }
  }
  return t;
}

}  // namespace lossverify::testing
