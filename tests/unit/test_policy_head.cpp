// The policy kind behind the LM head (docs/spec.md §11): its inputs placed against the head's float64 logits, its
// reference's bounds under the head's logit error against long-double perturbations of those logits, the correct
// implementation behind the head at several layouts, and the bugs that show through dh and dW; and the head's
// head-target-rounded-early at confident rows against its predicted figure.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "policy_support.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

using LD = long double;

// policy_json's objective (T = 0.7, clips 0.8 / 1.28, dual clip 3, k3 KL 0.05, entropy 0.01, whitened advantages)
// behind a head of H = 16 in bf16.
nlohmann::json policy_head_json(int tp, int cp, int ga) {
  nlohmann::json j = testing::policy_json(tp, cp, 1, ga);
  j["shape"]["vocab"] = 96;
  j["stage"] = {{"kind", "lm_head"}, {"hidden", 16}, {"chunks", 4}};
  j["inputs"]["dtype"] = "bf16";
  return j;
}

// One token's objective in long double from its row (policy_json's settings), given its inputs and whitened
// advantage: lambda, H, l and d l / d x (weight 1).
struct Token {
  LD logprob = 0, entropy = 0, loss = 0;
  std::vector<LD> grad;
};

Token evaluate(const std::vector<LD>& x, std::int64_t label, LD old, LD ref, LD a) {
  const LD t = 0.7L;
  Token r;
  LD max = -INFINITY;
  for (LD v : x) max = std::max(max, v / t);
  LD sum = 0;
  for (LD v : x) sum += expl(v / t - max);
  const LD lse = max + logl(sum);
  std::vector<LD> p(x.size()), log_p(x.size());
  for (std::size_t v = 0; v < x.size(); ++v) {
    log_p[v] = x[v] / t - lse;
    p[v] = expl(log_p[v]);
    r.entropy -= p[v] * log_p[v];
  }
  r.logprob = log_p[static_cast<std::size_t>(label)];
  const LD ratio = expl(r.logprob - old);
  const LD clipped = std::clamp(ratio, 0.8L, 1.28L);
  LD surrogate = std::max(-ratio * a, -clipped * a);
  LD g = -clipped * a > -ratio * a ? 0.0L : -ratio * a;
  if (a < 0 && surrogate > -3.0L * a) surrogate = -3.0L * a, g = 0;
  const LD d = r.logprob - ref;
  g += 0.05L * (1 - expl(-d));
  r.loss = surrogate + 0.05L * (expl(-d) + d - 1) - 0.01L * r.entropy;
  r.grad.resize(x.size());
  for (std::size_t v = 0; v < x.size(); ++v) {
    const LD delta = static_cast<std::int64_t>(v) == label ? 1 : 0;
    r.grad[v] = (g * (delta - p[v]) + 0.01L * p[v] * (log_p[v] + r.entropy)) / t;
  }
  return r;
}

// The whitened advantages over the step's valid tokens (mu and the unbiased sigma, delta 1e-6).
std::vector<LD> whitened(const Case& c, const InputSource& inputs) {
  LD n = 0, sum = 0, squares = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    const LD a = policy_token_advantage(c, inputs, t);
    n += 1, sum += a, squares += a * a;
  }
  const LD mean = sum / n, sigma = sqrtl((squares - n * mean * mean) / (n - 1));
  std::vector<LD> out(static_cast<std::size_t>(c.shape.tokens));
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    out[static_cast<std::size_t>(t)] = (policy_token_advantage(c, inputs, t) - mean) / (sigma + 1e-6L);
  }
  return out;
}

}  // namespace

TEST_CASE("policy behind the head: old log-probs are placed against the head's logits, a margin from every edge") {
  const Case c = testing::make_case(policy_head_json(1, 1, 1));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  REQUIRE(reference.stage() != nullptr);
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::vector<double> head(vocab), generated(vocab);
  const PolicyRowLogits rows(c, inputs);
  CHECK(rows.from_stage());
  int placed = 0, off = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    reference.stage()->logits(t, 0, c.shape.vocab, head.data());
    std::vector<double> row(vocab);
    rows.row(t, row);
    for (std::size_t v = 0; v < vocab; ++v) CHECK(row[v] == head[v]);  // the head's rows, as its reference has them
    inputs.logits(t, 0, c.shape.vocab, generated.data());
    const double old = policy_token_inputs(c, inputs, t).old_logprob;
    const double ratio = std::exp(policy_placement_logprob(c, head, inputs.label(t)) - old);
    // Each interval's margin is min(0.02, a tenth of its width) in the ratio; float32 old log-probs move it ~1e-7.
    bool clear = true;
    for (const double edge : {0.8, 1.28, 3.0}) clear = clear && std::fabs(ratio - edge) > 0.0199;
    CHECK(clear);
    placed += clear;
    // The generated rows (the head's input stream, not its logits) would have placed them elsewhere.
    const double wrong = std::exp(policy_placement_logprob(c, generated, inputs.label(t)) - old);
    off += std::fabs(wrong - ratio) > 0.05;
  }
  CHECK(placed > 60);
  CHECK(off > placed / 2);
}

TEST_CASE("policy behind the head: loss, values and gradient move within their bounds under random logit errors") {
  // Each valid token's head logits moved by random errors within the head's largest logit error e (uniform, and
  // the corner that moves lambda most: +e at the label, -e elsewhere), everything re-evaluated in long double on the
  // same inputs: the changes stay within the reference's bounds on the reading it judges a token at (tokens with two
  // readings, near a clip edge, are judged by either and left out here), and the bounds are not loose by orders of
  // magnitude.
  const Case c = testing::make_case(policy_head_json(1, 1, 1));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const StageReference& stage = *reference.stage();
  const std::vector<LD> advantage = whitened(c, inputs);
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::mt19937_64 random(5);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::vector<double> x(vocab), grad(vocab), bound(vocab), values(2), value_bounds(2), stats(4), stat_bounds(4);
  double tightest[4] = {0.0, 0.0, 0.0, 0.0};  // largest change / bound: lambda, H, l, gradient
  int judged = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    stage.logits(t, 0, c.shape.vocab, x.data());
    const double e = stage.largest_logit_error(t);
    const ReferenceToken ref = reference.evaluate(t, x, {}, grad);
    if (reference.row().branches(t, ref.stats) > 1) continue;
    ++judged;
    const PolicyTokenInputs in = policy_token_inputs(c, inputs, t);
    const std::int64_t label = inputs.label(t);
    const LD a = advantage[static_cast<std::size_t>(t)];
    const std::vector<LD> base_row(x.begin(), x.end());
    const Token base = evaluate(base_row, label, in.old_logprob, in.ref_logprob, a);
    reference.row().token_value_rounding(t, ref.stats, value_bounds);
    const double loss_bound = *reference.row().loss_under_logit_error(t, ref.stats, e);
    REQUIRE(reference.row().gradient_under_logit_error(t, ref.stats, 1.0, e, 0, x, bound));
    for (int trial = 0; trial < 24; ++trial) {
      std::vector<LD> moved = base_row;
      for (std::size_t v = 0; v < vocab; ++v) {
        const double shift = trial == 0 ? (static_cast<std::int64_t>(v) == label ? 1.0 : -1.0) : unit(random);
        moved[v] += static_cast<LD>(e * shift);
      }
      const Token m = evaluate(moved, label, in.old_logprob, in.ref_logprob, a);
      const double changes[3] = {static_cast<double>(fabsl(m.logprob - base.logprob)),
                                 static_cast<double>(fabsl(m.entropy - base.entropy)),
                                 static_cast<double>(fabsl(m.loss - base.loss))};
      const double bounds[3] = {value_bounds[0], value_bounds[1], loss_bound};
      for (int k = 0; k < 3; ++k) {
        CHECK(changes[k] <= bounds[k]);
        tightest[k] = std::max(tightest[k], changes[k] / bounds[k]);
      }
      for (std::size_t v = 0; v < vocab; ++v) {
        const double change = static_cast<double>(fabsl(m.grad[v] - base.grad[v]));
        CHECK(change <= bound[v]);
        tightest[3] = std::max(tightest[3], change / bound[v]);
      }
    }
  }
  MESSAGE("largest change / bound: lambda " << tightest[0] << ", H " << tightest[1] << ", l " << tightest[2]
                                            << ", gradient " << tightest[3] << " over " << judged << " tokens");
  CHECK(judged > 40);
  CHECK(tightest[0] > 0.5);  // the corner reaches 2 e / T (1 - p_y) of 2 e / T
  CHECK(tightest[1] > 0.05);
  CHECK(tightest[2] > 0.05);
  CHECK(tightest[3] > 0.05);
}

TEST_CASE("policy behind the head: the correct implementation passes, at several layouts, bf16") {
  for (const auto& [tp, cp, ga] : std::vector<std::tuple<int, int, int>>{{1, 1, 1}, {2, 1, 2}, {2, 2, 2}}) {
    CAPTURE(tp);
    CAPTURE(cp);
    const RunResult r = testing::run_with(testing::make_case(policy_head_json(tp, cp, ga)), "correct");
    CHECK(r.verdict == Verdict::pass);
    for (const char* check : {"loss", "dh", "dW", "logprob", "entropy", "stats"}) {
      CAPTURE(check);
      CHECK(testing::check_named(r, check).verdict == Verdict::pass);
    }
    CHECK(testing::check_named(r, "grad").verdict == Verdict::not_applicable);
  }
}

TEST_CASE("policy behind the head: GSPO's sequence ratio, k2 and the log-prob objective pass, with every aggregation") {
  // GSPO's rho_s moves with the largest error of its sequence's tokens; the log-prob objective has no ratio at all.
  for (const std::string aggregation : {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"}) {
    CAPTURE(aggregation);
    nlohmann::json gspo = policy_head_json(2, 2, 2);
    gspo["loss"]["ratio"] = "sequence";
    gspo["loss"]["kl_penalty"] = "k2";
    gspo["loss"]["aggregation"] = aggregation;
    const Case c = testing::make_case(gspo);
    CHECK(testing::run_with(c, "correct").verdict == Verdict::pass);
    CHECK(testing::check_named(testing::run_with(c, "rl-kl-no-grad"), "dh").verdict == Verdict::fail);
  }
  nlohmann::json logprob = policy_head_json(2, 1, 2);
  logprob["loss"] = {{"kind", "policy"}, {"objective", "logprob"}, {"temperature", 0.7}, {"entropy_coef", 0.01}};
  const Case c = testing::make_case(logprob);
  CHECK(testing::run_with(c, "correct").verdict == Verdict::pass);
  CHECK(testing::check_named(testing::run_with(c, "rl-temperature-one-side"), "dh").verdict == Verdict::fail);
}

TEST_CASE("policy behind the head: the policy's and the head's bugs show through dh and dW") {
  const Case c = testing::make_case(policy_head_json(2, 2, 2));
  for (const char* bug :
       {"rl-kl-no-grad", "rl-temperature-one-side", "head-dh-shard-partial", "head-dh-double-reduce"}) {
    CAPTURE(bug);
    const RunResult r = testing::run_with(c, bug);
    CHECK(r.verdict == Verdict::fail);
    CHECK(testing::check_named(r, "dh").verdict == Verdict::fail);
  }
}

TEST_CASE("head-target-rounded-early: half a 16-bit unit of w p_y at confident rows, against one rounding of g_y") {
  // V = 16 at logit scale 14: about one token in sixteen has its label as its largest logit by several units
  // (p_y -> 1). The correct head passes; the bug's error in dh at its worst element is at most half a bf16 unit of
  // w p_y times |W_yk| beyond the correct head's bound, and exceeds that bound (dW, which sums the row with every
  // other row's bound, need not show it); in float32 the early rounding is float32's own and passes.
  nlohmann::json j = {{"name", "confident"},
                      {"shape", {{"vocab", 16}}},
                      {"batch", {{"sequence_lengths", {40, 33, 51}}}},
                      {"stage", {{"kind", "lm_head"}, {"hidden", 24}, {"chunks", 2}}},
                      {"inputs", {{"seed", 29}, {"dtype", "bf16"}, {"scale", 14.0}}},
                      {"layout", {{"tp", 2}}},
                      {"timeout_seconds", 60.0}};
  const Case c = testing::make_case(j);
  CHECK(testing::run_with(c, "correct").verdict == Verdict::pass);
  const RunResult r = testing::run_with(c, "head-target-rounded-early");
  const CheckResult& dh = testing::check_named(r, "dh");
  CHECK(dh.verdict == Verdict::fail);
  REQUIRE(dh.worst.has_value());
  const InputSource inputs(c);
  const std::int64_t label = inputs.label(dh.worst->token);
  double w = 0.0;
  inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(label), dh.worst->column,
                      dh.worst->column + 1, head_weight_scale(c), &w);
  const LossReference reference(c, inputs);
  const double weight = reference.token_weight(dh.worst->token);
  const double figure = 0x1p-8 * weight * std::fabs(w);  // half a bf16 unit of w p_y <= w: at most 2^-8 w
  const double error = std::fabs(dh.worst->got - dh.worst->expected);
  MESSAGE("dh error " << error << ", tolerance " << dh.worst->tolerance << ", predicted at most " << figure);
  CHECK(error > dh.worst->tolerance);
  CHECK(error <= figure + dh.worst->tolerance);
  j["inputs"]["dtype"] = "fp32";
  CHECK(testing::run_with(testing::make_case(j), "head-target-rounded-early").verdict == Verdict::pass);
}

}  // namespace lossverify
