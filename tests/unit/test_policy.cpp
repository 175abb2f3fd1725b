// The policy kind (docs/spec.md §3.3): its float64 reference against an independent long-double evaluation
// of the definitions, the placement of its generated inputs, the correct sharded implementation at every
// aggregation and several layouts, each catalogued bug's predicted signal, and the case section's refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/run_case.hpp"
#include "policy_support.hpp"
#include "test_support.hpp"

using namespace lossverify;
using testing::failing;
using testing::gradients;
using testing::policy_json;
using testing::ratio_range;
using testing::token_weights;
using testing::TokenWeights;

namespace {

// The definitions in long double for one token: lambda, H, l and d l / d x, given the advantage after
// whitening (computed here from the generated advantages, independently of the reference).
struct LongDoubleToken {
  long double logprob = 0, entropy = 0, loss = 0;
  std::vector<long double> grad;  // d l / d x (weight 1)
};

LongDoubleToken long_double_token(const std::vector<double>& x, std::int64_t label, long double t, long double old,
                                  long double ref, long double a) {
  LongDoubleToken r;
  long double max = -INFINITY;
  for (double v : x) max = std::max(max, static_cast<long double>(v) / t);
  long double sum = 0;
  for (double v : x) sum += expl(static_cast<long double>(v) / t - max);
  const long double lse = max + logl(sum);
  std::vector<long double> p(x.size()), log_p(x.size());
  for (std::size_t v = 0; v < x.size(); ++v) {
    log_p[v] = static_cast<long double>(x[v]) / t - lse;
    p[v] = expl(log_p[v]);
    r.entropy -= p[v] * log_p[v];
  }
  r.logprob = log_p[static_cast<std::size_t>(label)];
  const long double ratio = expl(r.logprob - old);
  const long double clipped = std::clamp(ratio, 0.8L, 1.28L);
  long double surrogate = std::max(-ratio * a, -clipped * a);
  long double g = -clipped * a > -ratio * a ? 0.0L : -ratio * a;
  if (a < 0 && surrogate > -3.0L * a) surrogate = -3.0L * a, g = 0;
  const long double d = r.logprob - ref;
  const long double kl = expl(-d) + d - 1;
  g += 0.05L * (1 - expl(-d));
  r.loss = surrogate + 0.05L * kl - 0.01L * r.entropy;
  r.grad.resize(x.size());
  for (std::size_t v = 0; v < x.size(); ++v) {
    const long double delta = static_cast<std::int64_t>(v) == label ? 1 : 0;
    r.grad[v] = (g * (delta - p[v]) + 0.01L * p[v] * (log_p[v] + r.entropy)) / t;
  }
  return r;
}

}  // namespace

TEST_CASE("the policy reference matches the definitions in long double, token by token") {
  const Case c = testing::make_case(policy_json(1, 1, 1, 1));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  // mu and the unbiased sigma of the advantages over valid tokens.
  long double n = 0, sum = 0, squares = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    const long double a = policy_token_inputs(c, inputs, t).advantage;
    n += 1, sum += a, squares += a * a;
  }
  const long double mean = sum / n;
  const long double sigma = sqrtl((squares - n * mean * mean) / (n - 1));
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::vector<double> x(vocab), grad(vocab);
  int checked = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    inputs.logits(t, 0, c.shape.vocab, x.data());
    const PolicyTokenInputs in = policy_token_inputs(c, inputs, t);
    const long double a = (in.advantage - mean) / (sigma + 1e-6L);
    const LongDoubleToken expected = long_double_token(x, inputs.label(t), 0.7L, in.old_logprob, in.ref_logprob, a);
    const ReferenceToken got = reference.evaluate(t, x, {}, grad);
    CHECK(got.loss == doctest::Approx(static_cast<double>(expected.loss)).epsilon(1e-11));
    std::vector<double> values(2);
    reference.row().token_values(t, got.stats, values);
    CHECK(values[0] == doctest::Approx(static_cast<double>(expected.logprob)).epsilon(1e-13));
    CHECK(values[1] == doctest::Approx(static_cast<double>(expected.entropy)).epsilon(1e-12));
    CHECK(got.weight == doctest::Approx(1.0 / static_cast<double>(reference.valid_tokens())));
    for (std::size_t v = 0; v < vocab; ++v) {
      CHECK(grad[v] == doctest::Approx(static_cast<double>(got.weight * expected.grad[v])).epsilon(1e-9).scale(1e-12));
    }
    ++checked;
  }
  CHECK(checked > 60);
}

TEST_CASE("each aggregation mode weighs a token as its definition says") {
  for (const std::string mode :
       {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}) {
    CAPTURE(mode);
    nlohmann::json j = policy_json(1, 1, 1, 1);
    j["loss"]["aggregation"] = mode;
    if (mode == "seq-mean-token-sum-norm") j["loss"]["norm_constant"] = 40;
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const LossReference reference(c, inputs);
    const GlobalBatch& batch = inputs.batch();
    std::vector<double> n_s(batch.sequences().size(), 0.0);
    double n = 0;
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      if (inputs.is_valid(t)) n_s[static_cast<std::size_t>(batch.sequence_of(t))] += 1, n += 1;
    }
    const double b = static_cast<double>(std::count_if(n_s.begin(), n_s.end(), [](double v) { return v > 0; }));
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      const double s = n_s[static_cast<std::size_t>(batch.sequence_of(t))];
      std::map<std::string, double> expected = {{"token-mean", 1 / n},
                                                {"token-sum", 1.0},
                                                {"seq-mean-token-sum", 1 / b},
                                                {"seq-mean-token-mean", 1 / (b * s)},
                                                {"seq-mean-token-sum-norm", 1 / (b * 40)}};
      CHECK(reference.token_weight(t) == doctest::Approx(inputs.is_valid(t) ? expected[mode] : 0.0));
    }
  }
}

TEST_CASE("generated ratios keep a margin from every clip edge and fill every branch") {
  const Case c = testing::make_case(policy_json(1, 1, 1, 1));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  std::vector<double> x(static_cast<std::size_t>(c.shape.vocab)), grad(x.size());
  int below = 0, unclipped = 0, above = 0, beyond_dual = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    inputs.logits(t, 0, c.shape.vocab, x.data());
    const ReferenceToken r = reference.evaluate(t, x, {}, grad);
    std::vector<double> values(2);
    reference.row().token_values(t, r.stats, values);
    const PolicyTokenInputs in = policy_token_inputs(c, inputs, t);
    const double ratio = std::exp(values[0] - in.old_logprob);
    for (double edge : {0.8, 1.28, 3.0}) CHECK(std::fabs(ratio - edge) > 0.019);
    below += ratio < 0.8;
    unclipped += ratio > 0.8 && ratio < 1.28;
    above += ratio > 1.28 && ratio < 3.0;
    beyond_dual += ratio > 3.0;
    CHECK(std::fabs(values[0] - in.ref_logprob) >= 0.0499);
  }
  CHECK(below > 5);
  CHECK(unclipped > 15);
  CHECK(above > 5);
  CHECK(beyond_dual > 5);
}

TEST_CASE("the correct policy implementation passes at every aggregation, dtype and layout") {
  struct Layout {
    int tp, cp, dp, ga;
  };
  for (const Layout l : {Layout{1, 1, 1, 1}, Layout{2, 1, 2, 2}, Layout{3, 2, 1, 2}, Layout{4, 2, 2, 1}}) {
    for (const std::string mode : {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}) {
      for (const std::string dtype : {"fp32", "bf16", "fp16"}) {
        CAPTURE(l.tp);
        CAPTURE(l.cp);
        CAPTURE(l.dp);
        CAPTURE(l.ga);
        CAPTURE(mode);
        CAPTURE(dtype);
        nlohmann::json j = policy_json(l.tp, l.cp, l.dp, l.ga);
        j["loss"]["aggregation"] = mode;
        if (mode == "seq-mean-token-sum-norm") j["loss"]["norm_constant"] = 40;
        j["inputs"]["dtype"] = dtype;
        const RunResult r = testing::run_with(testing::make_case(j), "correct");
        CHECK(failing(r).empty());
        CHECK(testing::check_named(r, "logprob").verdict == Verdict::pass);
        CHECK(testing::check_named(r, "stats").verdict == Verdict::pass);
      }
    }
  }
  nlohmann::json logprob = policy_json(2, 1, 1, 2);
  logprob["loss"] = {{"kind", "policy"}, {"objective", "logprob"}, {"temperature", 1.3}, {"entropy_coef", 0.05}};
  CHECK(testing::run_with(testing::make_case(logprob), "correct").verdict == Verdict::pass);
}

TEST_CASE("rl-logprob-allgather-grad-sum: the gradient is TP times the correct one, the loss exact") {
  nlohmann::json j = policy_json(2, 1, 1, 1);
  j["loss"]["entropy_coef"] = 0.0;
  const auto [low, high] = ratio_range(testing::make_case(j), "rl-logprob-allgather-grad-sum");
  CHECK(low == doctest::Approx(2.0).epsilon(1e-5));
  CHECK(high == doctest::Approx(2.0).epsilon(1e-5));
  const RunResult r = testing::run_with(testing::make_case(j), "rl-logprob-allgather-grad-sum");
  CHECK(failing(r) == std::vector<std::string>{"grad"});
}

TEST_CASE("rl-schedule-double-divide: the gradient is 1/K of the correct one, and right at K = 1") {
  const auto [low, high] = ratio_range(testing::make_case(policy_json(1, 1, 2, 2)), "rl-schedule-double-divide");
  CHECK(low == doctest::Approx(0.5).epsilon(1e-5));
  CHECK(high == doctest::Approx(0.5).epsilon(1e-5));
  CHECK(testing::run_with(testing::make_case(policy_json(2, 1, 2, 1)), "rl-schedule-double-divide").verdict ==
        Verdict::pass);
}

TEST_CASE("rl-drgrpo-batch-sum: each token's gradient times its micro-batch's sequence count") {
  nlohmann::json j = policy_json(1, 1, 1, 2);
  j["loss"]["aggregation"] = "seq-mean-token-sum-norm";
  j["loss"]["norm_constant"] = 40;
  // Six sequences round-robin over two micro-batches: three each.
  const auto [low, high] = ratio_range(testing::make_case(j), "rl-drgrpo-batch-sum");
  CHECK(low == doctest::Approx(3.0).epsilon(1e-5));
  CHECK(high == doctest::Approx(3.0).epsilon(1e-5));
}

TEST_CASE("rl-seq-mean-counts-empty: gradient and loss B / B_all under each sequence aggregation, exact without one") {
  // A seventh sequence of 4 tokens, every label ignored: B = 6 of B_all = 7.
  nlohmann::json j = policy_json(2, 1, 2, 2);
  j["batch"]["sequence_lengths"].push_back(4);
  j["inputs"]["overrides"] = nlohmann::json::array();
  for (int t = 94; t < 97; ++t) j["inputs"]["overrides"].push_back({{"token", t}, {"label", -100}});
  for (const char* aggregation : {"seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}) {
    CAPTURE(aggregation);
    j["loss"]["aggregation"] = aggregation;
    j["loss"]["norm_constant"] = std::string(aggregation) == "seq-mean-token-sum-norm" ? 40.0 : 0.0;
    const auto [low, high] = ratio_range(testing::make_case(j), "rl-seq-mean-counts-empty");
    CHECK(low == doctest::Approx(6.0 / 7.0).epsilon(1e-5));
    CHECK(high == doctest::Approx(6.0 / 7.0).epsilon(1e-5));
    CHECK(failing(testing::run_with(testing::make_case(j), "rl-seq-mean-counts-empty")) ==
          std::vector<std::string>{"grad", "loss"});
  }
  // Without the empty sequence, or under token-mean, the count is right.
  j["loss"]["aggregation"] = "token-mean";
  j["loss"]["norm_constant"] = 0.0;
  CHECK(testing::run_with(testing::make_case(j), "rl-seq-mean-counts-empty").verdict == Verdict::pass);
  nlohmann::json full = policy_json(2, 1, 2, 2);
  full["loss"]["aggregation"] = "seq-mean-token-mean";
  CHECK(testing::run_with(testing::make_case(full), "rl-seq-mean-counts-empty").verdict == Verdict::pass);
}

TEST_CASE("rl-microbatch-self-normalized: each micro-batch's gradient N / (DP N_k) times the correct one") {
  const Case c = testing::make_case(policy_json(1, 1, 1, 2));
  const auto [low, high] = ratio_range(c, "rl-microbatch-self-normalized");
  // Two micro-batches with N_1 + N_2 = N: the ratios N / N_1 and N / N_2, about K = 2 and both above 1.
  CHECK(low > 1.0);
  CHECK(high > low);
  CHECK(1.0 / low + 1.0 / high == doctest::Approx(1.0).epsilon(1e-5));
}

namespace {

// A trainer's log-prob and entropy pass (l = -lambda - 0.05 H, token-mean) at T = 2, fp32, over TP ranks only:
// x / 2 is exact in float32, so the kernels' local argmax is the argmax of x.
nlohmann::json logprob_pass_json(int tp) {
  nlohmann::json j = policy_json(tp, 1, 1, 1);
  j["loss"] = {{"kind", "policy"}, {"objective", "logprob"}, {"temperature", 2.0}, {"entropy_coef", 0.05}};
  j["inputs"]["dtype"] = "fp32";
  return j;
}

}  // namespace

TEST_CASE("rl-logsoftmax-untracked-allreduce: each element follows ms-swift's autograd graph, row sums stay 0") {
  // ms-swift's compute_logps_and_entropy_from_logits (3602360a): log q_v = x_v/T - m_r - log S with the local
  // max m_r in the graph and S, the gathered log-prob and the entropy's partials all-reduced outside it. On
  // shard r, d log q_v / dz_u = delta_uv - D_u with D_u = p_u + [u = local argmax] (1 - P_r); so
  // d lambda / dz = [r owns y] (delta_y - D), and d H_r / dz_u = -(1 + log p_u) p_u + D_u (P_r - H_r) with
  // H_r = -sum_{v in r} p_v log p_v. Here g_lambda = -1 and g_H = -c_H.
  const int tp = 4;
  const double t = 2.0, c_h = 0.05;
  const Case c = testing::make_case(logprob_pass_json(tp));
  const InputSource inputs(c);
  RunOptions options;
  options.threads = 1;
  const RankRun buggy = execute_ranks(c, inputs, *find_implementation("rl-logsoftmax-untracked-allreduce"), options);
  const RankRun right = execute_ranks(c, inputs, *find_implementation("correct"), options);
  double n = 0;
  for (std::int64_t k = 0; k < c.shape.tokens; ++k) n += inputs.is_valid(k);
  const double w = 1.0 / n;  // token-mean
  const double unit = w / t;
  const double tol = 1e-5 * unit;  // float32 values of size <= 1 in units of w / T
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::vector<double> x(vocab), p(vocab), log_p(vocab);
  int tokens = 0;
  double max_error = 0.0;
  for (std::size_t r = 0; r < buggy.outputs.size(); ++r) {
    const RankOutput& b = buggy.outputs[r];
    const RankOutput& g = right.outputs[r];
    const VocabRange shard = b.assignment.vocab;
    CHECK(b.token_values == g.token_values);  // log-prob and entropy exact: the values never saw the bug
    for (std::int64_t i = 0; i < b.rows(); ++i) {
      const std::int64_t k = b.token_of(i);
      if (k < 0 || !inputs.is_valid(k)) continue;
      inputs.logits(k, 0, c.shape.vocab, x.data());
      double m = -INFINITY, sum = 0.0;
      for (double v : x) m = std::max(m, v / t);
      for (double v : x) sum += std::exp(v / t - m);
      for (std::size_t v = 0; v < vocab; ++v) {
        log_p[v] = x[v] / t - m - std::log(sum);
        p[v] = std::exp(log_p[v]);
      }
      double mass = 0.0, shard_entropy = 0.0;
      std::int64_t argmax = shard.begin;
      for (std::int64_t v = shard.begin; v < shard.end; ++v) {
        mass += p[static_cast<std::size_t>(v)];
        shard_entropy -= p[static_cast<std::size_t>(v)] * log_p[static_cast<std::size_t>(v)];
        if (x[static_cast<std::size_t>(v)] > x[static_cast<std::size_t>(argmax)]) argmax = v;
      }
      const std::int64_t y = inputs.label(k);
      const bool owner = y >= shard.begin && y < shard.end;
      double row_sum = 0.0, abs_sum = 0.0;
      for (std::int64_t v = shard.begin; v < shard.end; ++v) {
        const auto u = static_cast<std::size_t>(v);
        const double d = p[u] + (v == argmax ? 1.0 - mass : 0.0);
        const double d_lambda = owner ? (v == y ? 1.0 : 0.0) - d : 0.0;
        const double d_entropy = -(1.0 + log_p[u]) * p[u] + d * (mass - shard_entropy);
        const double expected = unit * (-1.0 * d_lambda + -c_h * d_entropy);
        CAPTURE(k);
        CAPTURE(v);
        CHECK(std::fabs(b.grad_at(i, v) - expected) <= tol);
        row_sum += b.grad_at(i, v);
        abs_sum += std::fabs(b.grad_at(i, v));
        max_error = std::max(max_error, std::fabs(b.grad_at(i, v) - g.grad_at(i, v)));
      }
      CHECK(std::fabs(row_sum) <= 1e-5 * abs_sum);  // each shard's row sum stays 0
      ++tokens;
    }
  }
  CHECK(tokens > 4 * 60);
  CHECK(max_error > 100.0 * tol);  // far off the correct gradient
}

TEST_CASE("rl-logsoftmax-untracked-allreduce: without the entropy it is rl-logprob-untracked-allreduce exactly") {
  // g_H = 0 leaves g_lambda [owner] (delta - D): the log-prob entry's gradient, element for element.
  nlohmann::json j = logprob_pass_json(4);
  j["loss"]["entropy_coef"] = 0.0;
  const Case c = testing::make_case(j);
  CHECK(gradients(c, "rl-logsoftmax-untracked-allreduce") == gradients(c, "rl-logprob-untracked-allreduce"));
  // With the entropy, it is neither of the two single-quantity entries.
  const Case both = testing::make_case(logprob_pass_json(4));
  const auto g = gradients(both, "rl-logsoftmax-untracked-allreduce");
  CHECK(g != gradients(both, "rl-logprob-untracked-allreduce"));
  CHECK(g != gradients(both, "rl-entropy-untracked-allreduce"));
}

TEST_CASE("microbatch-local-mean: each aggregation mode with the rank's micro-batch's own counts, / (DP CP GA)") {
  // Weight ratios from the definitions: right 1/N, 1/B, 1/(B n_s), 1/(B H_max); wrong 1/(R GA n(r,k)),
  // 1/(R GA B_k), 1/(R GA B_k n_s(r,k)), 1/(R GA B_k H_max), with R = DP CP and B_k, n_s(r,k) counted on the
  // rank's rows of micro-batch k; token-sum keeps weight 1.
  for (const char* mode :
       {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}) {
    const std::string shown = mode;
    CAPTURE(shown);
    nlohmann::json j = policy_json(1, 2, 2, 2);
    j["loss"]["aggregation"] = mode;
    if (std::string(mode) == "seq-mean-token-sum-norm") j["loss"]["norm_constant"] = 40;
    const Case c = testing::make_case(j);
    const TokenWeights t = token_weights(c);
    const double r_ga = 2.0 * 2.0 * 2.0;
    const auto n = static_cast<double>(t.sequence_of.size());
    const auto b = static_cast<double>(t.n_s.size());
    const auto right = gradients(c, "correct");
    const auto wrong = gradients(c, "microbatch-local-mean");
    std::set<double> ratios;
    std::int64_t compared = 0;
    for (const auto& [at, value] : right) {
      if (std::fabs(value) < 1e-7) continue;
      const std::int64_t token = at.first;
      const std::int64_t s = t.sequence_of.at(token);
      const auto& mine = t.local.at(t.place.at(token));
      std::int64_t n_k = 0;
      for (const auto& [seq, count] : mine) n_k += count;
      const auto b_k = static_cast<double>(mine.size());
      const auto n_sk = static_cast<double>(mine.at(s));
      const auto n_s = static_cast<double>(t.n_s.at(s));
      double ratio = 1.0;  // wrong / right
      const std::string m = mode;
      if (m == "token-mean") ratio = n / (r_ga * static_cast<double>(n_k));
      if (m == "seq-mean-token-sum" || m == "seq-mean-token-sum-norm") ratio = b / (r_ga * b_k);
      if (m == "seq-mean-token-mean") ratio = (b * n_s) / (r_ga * b_k * n_sk);
      CHECK(wrong.at(at) == doctest::Approx(ratio * value).epsilon(1e-5));
      ratios.insert(std::round(ratio * 1e6) / 1e6);
      ++compared;
    }
    CHECK(compared > 1000);
    if (std::string(mode) != "token-sum") CHECK(ratios.size() > 1);  // not one scale: unequal counts
  }
}

TEST_CASE("rl-stats-microbatch-mean: each statistic the mean over micro-batches of their token means over DP") {
  // From the definitions, on the correct run's per-token log-probabilities and entropies and the generated
  // inputs (no whitening, so the advantages are the generated ones): clipped where -clip(rho) A > -rho A,
  // dual-clipped where A < 0 and the surrogate exceeds -c A, k3 KL e^(r - lambda) - (r - lambda) - 1.
  nlohmann::json j = policy_json(1, 1, 2, 2);
  j["loss"].erase("whiten_advantages");
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  RunOptions options;
  options.threads = 1;
  const RankRun right = execute_ranks(c, inputs, *find_implementation("correct"), options);
  const RankRun wrong = execute_ranks(c, inputs, *find_implementation("rl-stats-microbatch-mean"), options);
  std::array<double, 4> expected{}, global{};
  std::array<std::array<double, 4>, 2> sums{};  // per micro-batch k, over the DP ranks
  std::array<std::int64_t, 2> n{};
  std::int64_t n_total = 0;
  for (const RankOutput& out : right.outputs) {
    const auto& begin = out.assignment.micro_batch_begin;
    REQUIRE(begin.size() == 3);
    for (std::size_t k = 0; k + 1 < begin.size(); ++k) {
      for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i) {
        const std::int64_t token = out.token_of(i);
        if (token < 0 || !inputs.is_valid(token)) continue;
        const double logprob = out.token_values[2 * static_cast<std::size_t>(i)];
        const double entropy = out.token_values[2 * static_cast<std::size_t>(i) + 1];
        const PolicyTokenInputs in = policy_token_inputs(c, inputs, token);
        const double a = in.advantage;
        const double rho = std::exp(logprob - in.old_logprob);
        const double clipped_rho = std::clamp(rho, 0.8, 1.28);
        const bool clipped = -clipped_rho * a > -rho * a;
        const double surrogate = std::max(-rho * a, -clipped_rho * a);
        const bool dual = a < 0.0 && surrogate > -3.0 * a;
        const double d = logprob - in.ref_logprob;
        const std::array<double, 4> token_stats{clipped ? 1.0 : 0.0, dual ? 1.0 : 0.0, std::exp(-d) + d - 1.0, entropy};
        for (std::size_t q = 0; q < 4; ++q) sums[k][q] += token_stats[q], global[q] += token_stats[q];
        ++n[k];
        ++n_total;
      }
    }
  }
  for (std::size_t k = 0; k < 2; ++k) {
    REQUIRE(n[k] > 0);
    for (std::size_t q = 0; q < 4; ++q) expected[q] += sums[k][q] / static_cast<double>(n[k]) / 2.0;  // GA = 2
  }
  for (std::size_t q = 0; q < 4; ++q) {
    CAPTURE(q);
    global[q] /= static_cast<double>(n_total);
    CHECK(right.outputs[0].logged_stats[q] == doctest::Approx(global[q]).epsilon(1e-5));
    for (const RankOutput& out : wrong.outputs)
      CHECK(out.logged_stats[q] == doctest::Approx(expected[q]).epsilon(1e-5));
  }
  CHECK(std::fabs(expected[2] - global[2]) > 1e-3 * std::fabs(global[2]));  // unequal micro-batches: the bug shows
  CHECK(std::fabs(expected[3] - global[3]) > 1e-4 * std::fabs(global[3]));
  // Loss and gradient untouched.
  for (std::size_t k = 0; k < right.outputs.size(); ++k) {
    CHECK(wrong.outputs[k].reduced_loss == right.outputs[k].reduced_loss);
    CHECK(wrong.outputs[k].grad == right.outputs[k].grad);
  }
  CHECK(failing(testing::run_with(c, "rl-stats-microbatch-mean")) == std::vector<std::string>{"stats"});
}

TEST_CASE("rl-logprob-16bit: log-prob and entropy of x = bf16(z / T) with each op's output rounded to bf16") {
  // The definition, in double on the case's bf16 logits: x_v = bf16(z_v (1/T)), lse = M + log sum e^(x - M),
  // lambda = bf16(x_y - lse) (log_softmax: float inside, the output rounded), H = bf16(bf16(lse) -
  // bf16(sum_v p_v x_v)) (entropy_from_logits: logsumexp, softmax, sum p x). The kernel's float32 sums may
  // land on the other side of a rounding midpoint: every value within one bf16 step, nearly all equal.
  for (int tp : {1, 2}) {
    CAPTURE(tp);
    nlohmann::json j = policy_json(tp, 1, 1, 1);
    j["inputs"]["dtype"] = "bf16";
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    RunOptions options;
    options.threads = 1;
    const RankRun wrong = execute_ranks(c, inputs, *find_implementation("rl-logprob-16bit"), options);
    const RankRun right = execute_ranks(c, inputs, *find_implementation("correct"), options);
    const float inverse_t = static_cast<float>(1.0 / 0.7);
    const auto vocab = static_cast<std::size_t>(c.shape.vocab);
    std::vector<Eigen::bfloat16> z(vocab);
    std::vector<double> x(vocab);
    auto bf16 = [](double v) { return round_to_dtype(v, DType::bf16); };
    int tokens = 0, logprob_equal = 0, entropy_equal = 0, logprob_moved = 0;
    const RankOutput& out = wrong.outputs[0];
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      const std::int64_t t = out.token_of(i);
      if (t < 0 || !inputs.is_valid(t)) continue;
      inputs.logits(t, 0, c.shape.vocab, z.data());
      double m = -INFINITY;
      for (std::size_t v = 0; v < vocab; ++v) {
        x[v] = static_cast<double>(static_cast<float>(Eigen::bfloat16(static_cast<float>(z[v]) * inverse_t)));
        m = std::max(m, x[v]);
      }
      double sum = 0.0;
      for (std::size_t v = 0; v < vocab; ++v) sum += std::exp(x[v] - m);
      const double lse = m + std::log(sum);
      double sum_px = 0.0;
      for (std::size_t v = 0; v < vocab; ++v) sum_px += std::exp(x[v] - lse) * x[v];
      const double logprob = bf16(x[static_cast<std::size_t>(inputs.label(t))] - lse);
      const double entropy = bf16(bf16(lse) - bf16(sum_px));
      const double got_logprob = out.token_values[2 * static_cast<std::size_t>(i)];
      const double got_entropy = out.token_values[2 * static_cast<std::size_t>(i) + 1];
      const double step_l = std::ldexp(1.0, std::ilogb(std::fabs(logprob)) - 7);  // one bf16 step
      const double step_h = std::ldexp(1.0, std::ilogb(std::fabs(lse)) - 7);      // bf16(lse)'s step bounds H's error
      CHECK(std::fabs(got_logprob - logprob) <= step_l);
      CHECK(std::fabs(got_entropy - entropy) <= step_h + std::ldexp(1.0, std::ilogb(std::fabs(entropy)) - 7));
      logprob_equal += got_logprob == logprob;
      entropy_equal += got_entropy == entropy;
      logprob_moved += got_logprob != right.outputs[0].token_values[2 * static_cast<std::size_t>(i)];
      ++tokens;
    }
    CHECK(tokens > 60);
    CHECK(logprob_equal >= tokens - tokens / 50);
    CHECK(entropy_equal >= tokens - tokens / 50);
    CHECK(logprob_moved > tokens / 2);  // the float32 log-prob is not on the bf16 grid
    const RunResult r = testing::run_with(c, "rl-logprob-16bit");
    const std::vector<std::string> names = failing(r);
    for (const char* check : {"entropy", "grad", "logprob", "loss"}) {
      CAPTURE(check);
      CHECK(std::find(names.begin(), names.end(), check) != names.end());
    }
  }
  // fp32 logits: rounding to the storage dtype is the identity, the pass is the correct one bit for bit.
  const Case c = testing::make_case(policy_json(2, 1, 1, 1));
  const InputSource inputs(c);
  RunOptions options;
  options.threads = 1;
  const RankRun wrong = execute_ranks(c, inputs, *find_implementation("rl-logprob-16bit"), options);
  const RankRun right = execute_ranks(c, inputs, *find_implementation("correct"), options);
  for (std::size_t k = 0; k < right.outputs.size(); ++k) {
    CHECK(wrong.outputs[k].token_values == right.outputs[k].token_values);
    CHECK(wrong.outputs[k].token_loss == right.outputs[k].token_loss);
    CHECK(wrong.outputs[k].grad == right.outputs[k].grad);
  }
}

TEST_CASE("each policy bug is caught where its signal says, and passes where it cannot show") {
  struct Expectation {
    std::string bug;
    nlohmann::json shows, hides;  // cases
    std::vector<std::string> failing_checks;
  };
  auto with = [](int tp, int cp, int dp, int ga, const nlohmann::json& loss_patch) {
    nlohmann::json j = policy_json(tp, cp, dp, ga);
    if (loss_patch.is_object()) j["loss"].update(loss_patch);
    return j;
  };
  nlohmann::json v2048 = with(2, 1, 1, 1, nlohmann::json::object());
  v2048["shape"]["vocab"] = 2048;
  const std::vector<Expectation> expectations = {
      {"rl-logprob-untracked-allreduce", with(2, 1, 1, 1, {}), with(1, 1, 2, 2, {}), {"grad"}},
      {"rl-logsoftmax-untracked-allreduce", with(2, 1, 1, 1, {}), with(1, 2, 2, 2, {}), {"grad"}},
      {"rl-entropy-untracked-allreduce",
       with(2, 1, 1, 1, {}),
       with(2, 1, 1, 1, {{"entropy_coef", 0.0}}),
       {"grad", "row_sum"}},
      {"rl-temperature-one-side",
       with(1, 1, 1, 1, {}),
       with(1, 1, 1, 1, {{"temperature", 1.0}}),
       {"entropy", "grad", "logprob", "loss", "stats"}},
      {"rl-token-mean-sample-weighted", with(1, 1, 2, 2, {}), with(2, 1, 1, 1, {}), {"grad", "loss"}},
      {"rl-cp-extra-scale", with(1, 2, 1, 1, {}), with(2, 1, 2, 1, {}), {"grad", "stats"}},
      {"rl-adv-whiten-dp-only", with(1, 2, 2, 1, {}), with(2, 1, 2, 1, {}), {"grad", "loss"}},
      {"rl-fused-vocab-pad", with(2, 1, 1, 1, {}), v2048, {"entropy", "grad", "logprob", "loss", "row_sum", "stats"}},
      {"rl-kl-no-grad", with(1, 1, 1, 1, {}), with(1, 1, 1, 1, {{"kl_coef", 0.0}}), {"grad"}},
      // A layout bug of every kind: the policy loss's logged value, each CP rank its own slice's token mean.
      {"cp-loss-stat-dp-only", with(1, 2, 2, 1, {}), with(2, 1, 2, 1, {}), {"loss"}},
  };
  for (const Expectation& e : expectations) {
    CAPTURE(e.bug);
    const RunResult shown = testing::run_with(testing::make_case(e.shows), e.bug);
    CHECK(failing(shown) == e.failing_checks);
    CHECK(testing::run_with(testing::make_case(e.hides), e.bug).verdict == Verdict::pass);
  }
}

TEST_CASE("a policy case refuses impossible settings by name, before any work") {
  auto refused = [](const nlohmann::json& patch, const std::string& message) {
    nlohmann::json j = policy_json(1, 1, 1, 1);
    j["loss"].update(patch);
    CAPTURE(patch.dump());
    CHECK_THROWS_WITH_AS(testing::make_case(j), doctest::Contains(message.c_str()), CaseError);
  };
  refused({{"temperature", 0.0}}, "$.loss.temperature: must be in (0, 1e6]");
  refused({{"temperature", -1.0}}, "$.loss.temperature");
  refused({{"clip_low", 1.0}}, "$.loss.clip_low: must be in (0, 1)");
  refused({{"clip_low", 0.0}}, "$.loss.clip_low");
  refused({{"clip_high", 0.0}}, "$.loss.clip_high: must be in (0, 1000]");
  refused({{"dual_clip", 1.0}}, "$.loss.dual_clip: must be 0 (off) or in (1, 1000]");
  refused({{"whiten_epsilon", 0.0}}, "$.loss.whiten_epsilon: must be in (0, 1000]");
  refused({{"reduction", "sum"}}, "$.loss.reduction: a policy loss aggregates its tokens by \"aggregation\"");
  refused({{"aggregation", "seq-mean-token-sum-norm"}}, "needs norm_constant");
  refused({{"norm_constant", 4}}, "$.loss.norm_constant: applies to aggregation seq-mean-token-sum-norm only");
  refused({{"aggregation", "seq-mean-token-mean"}, {"norm_constant", -2}},
          "$.loss.norm_constant: applies to aggregation seq-mean-token-sum-norm only (0 leaves it unset)");
  refused({{"aggregation", "seq-mean-token-sum-norm"}, {"norm_constant", 0}},
          "$.loss.norm_constant: must be in [1e-6, 1e12]");
  refused({{"norm_constant", "0"}}, "$.loss.norm_constant: applies to aggregation seq-mean-token-sum-norm only");
  refused({{"kl_penalty", "none"}}, "$.loss.kl_coef: applies to a kl_penalty other than none");
  refused({{"kl_penalty", "k4"}}, "$.loss.kl_penalty: expected one of none|k1|k2|k3");
  refused({{"objective", "logprob"}}, "applies to objective policy_loss only");
  refused({{"label_smoothing", 0.1}}, "$.loss.label_smoothing: applies to cross_entropy only, not policy");
}

TEST_CASE("an override row sets a token's old and reference log-probabilities and advantage, checked by name") {
  nlohmann::json j = policy_json(2, 1, 1, 1);
  j["inputs"]["overrides"] = {{{"token", 3}, {"old_logprob", -2.5}, {"ref_logprob", -3.0}, {"advantages", 0.7}},
                              {{"token", 40}, {"advantages", -1.25}}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  REQUIRE(inputs.is_valid(3));
  const PolicyTokenInputs three = policy_token_inputs(c, inputs, 3);
  CHECK(three.old_logprob == -2.5f);
  CHECK(three.ref_logprob == -3.0f);
  CHECK(three.advantage == 0.7f);
  const PolicyTokenInputs forty = policy_token_inputs(c, inputs, 40);
  CHECK(forty.advantage == -1.25f);
  const Case plain = testing::make_case(policy_json(2, 1, 1, 1));
  const InputSource plain_inputs(plain);
  const PolicyTokenInputs generated = policy_token_inputs(plain, plain_inputs, 40);
  CHECK(forty.old_logprob == generated.old_logprob);  // what the row does not set stays generated
  CHECK(forty.ref_logprob == generated.ref_logprob);
  CHECK(generated.advantage != -1.25f);
  CHECK(c.resolved()["inputs"]["overrides"][0]["old_logprob"] == -2.5);
  // The overridden inputs reach the ranks and the reference alike: the correct implementation passes, a bug
  // still fails.
  CHECK(testing::run_with(c, "correct").verdict == Verdict::pass);
  CHECK(testing::run_with(c, "rl-kl-no-grad").verdict == Verdict::fail);

  auto refused = [](const nlohmann::json& row, const std::string& message) {
    nlohmann::json bad = policy_json(1, 1, 1, 1);
    bad["inputs"]["overrides"] = {row};
    CAPTURE(row.dump());
    CHECK_THROWS_WITH_AS(testing::make_case(bad), doctest::Contains(message.c_str()), CaseError);
  };
  refused({{"token", 1}, {"old_logprob", 0.5}}, "$.inputs.overrides[0].old_logprob: 0.5 is not a log-probability");
  refused({{"token", 1}, {"advantages", 1e5}}, "$.inputs.overrides[0].advantages: 100000.0 is not a finite number");
  refused({{"token", 1}, {"ref_logprob", "NaN"}}, "$.inputs.overrides[0].ref_logprob: expected number");
  nlohmann::json ce = testing::case_json(8, 16, 1, "fp32");
  ce["inputs"]["overrides"] = {{{"token", 1}, {"old_logprob", -1.0}}};
  CHECK_THROWS_WITH_AS(testing::make_case(ce), doctest::Contains("$.inputs.overrides[0].old_logprob: unknown key"),
                       CaseError);
}

namespace {

// lambda of a token at the case's temperature, in float64 from its logits (the definition).
double logprob_of(const Case& c, const InputSource& inputs, std::int64_t token) {
  std::vector<double> row(static_cast<std::size_t>(c.shape.vocab));
  inputs.logits(token, 0, c.shape.vocab, row.data());
  const double inverse_t = 1.0 / 0.7;
  double max = -INFINITY;
  for (double x : row) max = std::max(max, x * inverse_t);
  double sum = 0.0;
  for (double x : row) sum += std::exp(x * inverse_t - max);
  return row[static_cast<std::size_t>(inputs.label(token))] * inverse_t - max - std::log(sum);
}

}  // namespace

TEST_CASE("a ratio within rounding of a clip edge is judged by either branch, and the count is reported") {
  nlohmann::json j = policy_json(2, 1, 1, 1);
  j["loss"]["whiten_advantages"] = false;
  const Case plain = testing::make_case(j);
  const InputSource plain_inputs(plain);
  std::vector<std::int64_t> tokens;
  for (std::int64_t t = 0; t < plain.shape.tokens && tokens.size() < 4; ++t) {
    if (plain_inputs.is_valid(t)) tokens.push_back(t);
  }
  REQUIRE(tokens.size() == 4);
  // rho = 1 + eps_high with A > 0; rho = 1 - eps_low and rho = c with A < 0: each exactly at its edge, up to
  // the float32 rounding of old_logprob; the fourth 100 tolerances away from the upper edge.
  const double edges[] = {1.28, 0.8, 3.0, 1.28 * std::exp(100 * 2e-5)};
  const double advantages[] = {1.0, -1.0, -1.0, 1.0};
  nlohmann::json overrides = nlohmann::json::array();
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    const double old = logprob_of(plain, plain_inputs, tokens[k]) - std::log(edges[k]);
    overrides.push_back({{"token", tokens[k]}, {"old_logprob", old}, {"advantages", advantages[k]}});
  }
  j["inputs"]["overrides"] = overrides;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  std::vector<double> row(static_cast<std::size_t>(c.shape.vocab)), grad(row.size());
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    CAPTURE(k);
    inputs.logits(tokens[k], 0, c.shape.vocab, row.data());
    const ReferenceToken r = reference.evaluate(tokens[k], row, {}, grad);
    CHECK(reference.row().branches(tokens[k], r.stats) == (k < 3 ? 2 : 1));
    if (k == 3) continue;
    // The two readings differ where it matters: the clip (or dual clip) indicator and the gradient's slope.
    RowStats other = r.stats;
    other.branch = 1;
    std::vector<double> a(4), b(4);
    reference.row().token_statistics(tokens[k], r.stats, a);
    reference.row().token_statistics(tokens[k], other, b);
    CHECK(std::fabs(a[0] - b[0]) + std::fabs(a[1] - b[1]) == 1.0);
    CHECK(*reference.row().gradient_scale(tokens[k], r.stats) !=
          doctest::Approx(*reference.row().gradient_scale(tokens[k], other)));
  }
  const RunResult run = testing::run_with(c, "correct");
  CHECK(run.verdict == Verdict::pass);
  for (const CheckResult& check : run.checks) {
    CAPTURE(check.name);
    if (check.name == "loss" || check.name == "grad" || check.name == "stats") {
      CHECK(check.metrics.value("either_branch_tokens", 0) == 3);
    }
  }
  // Accepting either branch at three tokens does not accept a wrong gradient elsewhere.
  CHECK(testing::run_with(c, "rl-kl-no-grad").verdict == Verdict::fail);
}

namespace {

// GSPO's objective L = sum_t w_t l_t in long double from the definitions, over the whole step: every valid
// token's lambda, each sequence's rho_s = e^(mean of lambda - old), the clipped surrogate at rho_s, the k3 KL
// and the entropy bonus, with seq-mean-token-mean weights 1 / (B n_s). `logits` holds every token's row.
long double gspo_objective(const Case& c, const InputSource& inputs, const std::vector<std::vector<double>>& logits) {
  const long double t = 0.7L;
  std::map<std::int64_t, std::vector<std::int64_t>> sequences;
  for (std::int64_t k = 0; k < c.shape.tokens; ++k) {
    if (inputs.is_valid(k)) sequences[inputs.batch().sequence_of(k)].push_back(k);
  }
  std::vector<long double> logprob(static_cast<std::size_t>(c.shape.tokens)), entropy(logprob.size());
  for (const auto& [s, tokens] : sequences) {
    for (std::int64_t k : tokens) {
      const std::vector<double>& x = logits[static_cast<std::size_t>(k)];
      long double max = -INFINITY, sum = 0, h = 0;
      for (double v : x) max = std::max(max, static_cast<long double>(v) / t);
      for (double v : x) sum += expl(static_cast<long double>(v) / t - max);
      const long double lse = max + logl(sum);
      for (double v : x) h -= expl(static_cast<long double>(v) / t - lse) * (static_cast<long double>(v) / t - lse);
      logprob[static_cast<std::size_t>(k)] =
          static_cast<long double>(x[static_cast<std::size_t>(inputs.label(k))]) / t - lse;
      entropy[static_cast<std::size_t>(k)] = h;
    }
  }
  long double total = 0;
  const auto b = static_cast<long double>(sequences.size());
  for (const auto& [s, tokens] : sequences) {
    long double mean = 0;
    for (std::int64_t k : tokens)
      mean += logprob[static_cast<std::size_t>(k)] - policy_token_inputs(c, inputs, k).old_logprob;
    const auto n = static_cast<long double>(tokens.size());
    const long double ratio = expl(mean / n);
    for (std::int64_t k : tokens) {
      const PolicyTokenInputs in = policy_token_inputs(c, inputs, k);
      const long double a = in.advantage;
      const long double surrogate = std::max(-ratio * a, -std::clamp(ratio, 0.8L, 1.28L) * a);
      const long double d = logprob[static_cast<std::size_t>(k)] - in.ref_logprob;
      const long double l = surrogate + 0.05L * (expl(-d) + d - 1) - 0.01L * entropy[static_cast<std::size_t>(k)];
      total += l / (b * n);
    }
  }
  return total;
}

nlohmann::json gspo_json(int tp, int cp, int dp, int ga) {
  nlohmann::json j = policy_json(tp, cp, dp, ga);
  j["shape"]["vocab"] = 64;
  j["loss"].erase("dual_clip");
  j["loss"].erase("whiten_advantages");
  j["loss"]["ratio"] = "sequence";
  j["loss"]["aggregation"] = "seq-mean-token-mean";
  return j;
}

}  // namespace

TEST_CASE("GSPO: the reference's gradient is the derivative of the whole step's objective, rho_s included") {
  // Tokens of sequences 0 and 2 get their own advantages of both signs, so A varies inside a sequence and
  // some of its tokens are clipped while others are not: there the sequence ratio's derivative (each token's
  // gradient sums its sequence's unclipped terms) differs from a token's own -rho_s A_t [unclipped].
  nlohmann::json j = gspo_json(1, 1, 1, 1);
  j["inputs"]["overrides"] = {{{"token", 2}, {"advantages", -1.5}},
                              {{"token", 3}, {"advantages", 1.2}},
                              {{"token", 33}, {"advantages", -0.9}},
                              {{"token", 34}, {"advantages", 1.6}}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  std::vector<std::vector<double>> logits(static_cast<std::size_t>(c.shape.tokens),
                                          std::vector<double>(static_cast<std::size_t>(c.shape.vocab)));
  for (std::int64_t k = 0; k < c.shape.tokens; ++k)
    inputs.logits(k, 0, c.shape.vocab, logits[static_cast<std::size_t>(k)].data());
  // The reference's loss: sum_t w_t l_t.
  long double logged = 0;
  std::vector<double> grad(static_cast<std::size_t>(c.shape.vocab));
  for (std::int64_t k = 0; k < c.shape.tokens; ++k) {
    if (!inputs.is_valid(k)) continue;
    const ReferenceToken got = reference.evaluate(k, logits[static_cast<std::size_t>(k)], {}, grad);
    logged += got.weight * got.loss;
  }
  CHECK(static_cast<double>(logged) ==
        doctest::Approx(static_cast<double>(gspo_objective(c, inputs, logits))).epsilon(1e-12));
  // Central differences of the long-double objective at a few (token, column) pairs of several sequences.
  int checked = 0;
  for (std::int64_t k : {0, 2, 3, 11, 23, 33, 40, 61, 80}) {
    if (!inputs.is_valid(k)) continue;
    reference.evaluate(k, logits[static_cast<std::size_t>(k)], {}, grad);
    for (std::int64_t v : {std::int64_t{0}, inputs.label(k), std::int64_t{37}}) {
      auto& x = logits[static_cast<std::size_t>(k)][static_cast<std::size_t>(v)];
      const double saved = x, h = 1e-4;
      x = saved + h;
      const long double up = gspo_objective(c, inputs, logits);
      x = saved - h;
      const long double down = gspo_objective(c, inputs, logits);
      x = saved;
      const auto numeric = static_cast<double>((up - down) / (2.0L * h));
      CHECK(grad[static_cast<std::size_t>(v)] == doctest::Approx(numeric).epsilon(1e-6).scale(1e-9));
      ++checked;
    }
  }
  CHECK(checked >= 15);
}

TEST_CASE("GSPO: generated sequence ratios keep their margin, each token's own ratio spread around them") {
  const Case c = testing::make_case(gspo_json(1, 1, 1, 1));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  std::map<std::int64_t, std::vector<double>> log_ratios;  // per sequence, each valid token's lambda - old
  std::vector<double> x(static_cast<std::size_t>(c.shape.vocab)), grad(x.size());
  for (std::int64_t k = 0; k < c.shape.tokens; ++k) {
    if (!inputs.is_valid(k)) continue;
    inputs.logits(k, 0, c.shape.vocab, x.data());
    const ReferenceToken got = reference.evaluate(k, x, {}, grad);
    std::vector<double> values(2);
    reference.row().token_values(k, got.stats, values);
    log_ratios[inputs.batch().sequence_of(k)].push_back(values[0] - policy_token_inputs(c, inputs, k).old_logprob);
  }
  int spread = 0;
  for (const auto& [s, r] : log_ratios) {
    double mean = 0;
    for (double v : r) mean += v;
    mean /= static_cast<double>(r.size());
    const double ratio = std::exp(mean);
    for (double edge : {0.8, 1.28}) CHECK(std::fabs(ratio - edge) > 0.015);
    for (double v : r) spread += std::fabs(v - mean) > 0.01;
  }
  CHECK(spread > 30);
}

TEST_CASE("GSPO: the correct implementation passes over TP x CP x DP x GA; a CP-local ratio fails only at cp > 1") {
  for (const auto& [tp, cp, dp, ga] : {std::array{1, 1, 1, 1}, std::array{2, 2, 1, 2}, std::array{1, 2, 2, 1}}) {
    CAPTURE(tp);
    CAPTURE(cp);
    CAPTURE(dp);
    CAPTURE(ga);
    const Case c = testing::make_case(gspo_json(tp, cp, dp, ga));
    CHECK(testing::run_with(c, "correct").verdict == Verdict::pass);
    const RunResult local = testing::run_with(c, "rl-gspo-cp-local-ratio");
    if (cp == 1) {
      CHECK(local.verdict == Verdict::pass);
    } else {
      CHECK(failing(local) == std::vector<std::string>{"grad", "loss"});
    }
  }
}

TEST_CASE("GSPO: thousands of tokens of one sequence do not drift the sums the kernels reduce per sequence") {
  // A token-sum objective over two sequences of 5000 and 3000 tokens: their sums of lambda - old and of
  // w (-A) accumulated in float drifted by 2e-5 relative (equal summands), failing grad at margin 2.06 with the
  // correct implementation; in double they stay within the tolerance by far.
  const Case c =
      testing::make_case({{"name", "gspo-long"},
                          {"shape", {{"vocab", 32}}},
                          {"batch", {{"sequence_lengths", {5000, 3000}}}},
                          {"loss", {{"kind", "policy"}, {"ratio", "sequence"}, {"aggregation", "token-sum"}}},
                          {"inputs", {{"seed", 5}, {"scale", 3.0}, {"dtype", "fp32"}}},
                          {"timeout_seconds", 60.0}});
  const RunResult r = testing::run_with(c, "correct");
  CHECK(r.verdict == Verdict::pass);
  for (const CheckResult& check : r.checks) {
    if (check.name == "grad") CHECK(check.margin < 0.5);
  }
}

TEST_CASE("a policy case's resolved form parses again, for each setting that leaves keys out") {
  // resolved() feeds dump manifests, bundles and replay: a key it wrote under a setting that refuses it
  // (kl_coef without a kl_penalty) made every dump of such a case unreadable.
  for (const nlohmann::json& loss :
       {nlohmann::json{{"kind", "policy"}}, nlohmann::json{{"kind", "policy"}, {"objective", "logprob"}},
        nlohmann::json{{"kind", "policy"}, {"ratio", "sequence"}, {"kl_penalty", "k1"}, {"kl_coef", 0.1}},
        nlohmann::json{{"kind", "policy"}, {"aggregation", "seq-mean-token-sum-norm"}, {"norm_constant", 8.0}},
        nlohmann::json{{"kind", "policy"}, {"aggregation", "token-sum"}, {"norm_constant", 0}}}) {
    CAPTURE(loss.dump());
    const Case c = testing::make_case(
        {{"name", "resolved"}, {"shape", {{"vocab", 16}}}, {"batch", {{"sequence_lengths", {5, 3}}}}, {"loss", loss}});
    const Case again = testing::make_case(c.resolved());
    CHECK(again.resolved() == c.resolved());
  }
}

TEST_CASE("0 switches a setting off: kl_coef beside kl_penalty none, whiten_epsilon beside no whitening, dual_clip") {
  // `--set` can only change keys, so a case that turned a feature on is turned off by setting its key to 0
  // beside the switch: the case it becomes equals the one written without the key, and its resolved form
  // parses again. A nonzero value beside the switch is still refused by name.
  nlohmann::json on = policy_json(1, 2, 2, 1);
  on["loss"]["kl_penalty"] = "k2";
  on["loss"]["kl_coef"] = 0.1;
  on["loss"]["whiten_advantages"] = true;
  on["loss"]["whiten_epsilon"] = 1e-6;
  on["loss"]["dual_clip"] = 3.0;
  nlohmann::json off = on;
  for (const char* set : {"loss.kl_penalty=none", "loss.kl_coef=0", "loss.whiten_advantages=false",
                          "loss.whiten_epsilon=0", "loss.dual_clip=0"}) {
    apply_set_override(off, set, "<test>");
  }
  nlohmann::json without = on;
  for (const char* key : {"kl_coef", "whiten_epsilon", "dual_clip"}) without["loss"].erase(key);
  without["loss"]["kl_penalty"] = "none";
  without["loss"]["whiten_advantages"] = false;
  const Case c = testing::make_case(off);
  CHECK(c.resolved() == testing::make_case(without).resolved());
  CHECK(testing::make_case(c.resolved()).resolved() == c.resolved());
  for (const char* key : {"kl_coef", "whiten_epsilon", "dual_clip"}) CHECK_FALSE(c.resolved()["loss"].contains(key));
  nlohmann::json still_on = off;
  still_on["loss"]["kl_coef"] = 0.1;
  CHECK_THROWS_WITH_AS(testing::make_case(still_on), doctest::Contains("$.loss.kl_coef: applies to a kl_penalty"),
                       CaseError);
  still_on = off;
  still_on["loss"]["whiten_epsilon"] = 1e-6;
  CHECK_THROWS_WITH_AS(testing::make_case(still_on),
                       doctest::Contains("$.loss.whiten_epsilon: applies to whiten_advantages true"), CaseError);
  still_on = off;
  still_on["loss"]["dual_clip"] = 0.5;
  CHECK_THROWS_WITH_AS(testing::make_case(still_on),
                       doctest::Contains("$.loss.dual_clip: must be 0 (off) or in (1, 1000]"), CaseError);
}

TEST_CASE("norm_constant 0 means unset under any aggregation: --set takes a Dr. GRPO case to another mode") {
  // `--set loss.norm_constant=0 --set loss.aggregation=token-mean` on a seq-mean-token-sum-norm case: the
  // token-mean case it becomes, with no norm_constant in its resolved form (which parses again).
  nlohmann::json j = policy_json(1, 2, 2, 1);
  j["loss"]["aggregation"] = "seq-mean-token-sum-norm";
  j["loss"]["norm_constant"] = 64;
  for (const char* set : {"loss.norm_constant=0", "loss.aggregation=token-mean"}) apply_set_override(j, set, "<test>");
  const Case c = testing::make_case(j);
  CHECK(c.loss.reduction == Reduction::mean);
  CHECK(c.resolved()["loss"]["aggregation"] == "token-mean");
  CHECK_FALSE(c.resolved()["loss"].contains("norm_constant"));
  CHECK(testing::make_case(c.resolved()).resolved() == c.resolved());
  for (const std::string mode : {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"}) {
    CAPTURE(mode);
    nlohmann::json k = policy_json(1, 1, 1, 1);
    k["loss"]["aggregation"] = mode;
    k["loss"]["norm_constant"] = 0.0;
    const Case zero = testing::make_case(k);
    k["loss"].erase("norm_constant");
    CHECK(zero.resolved() == testing::make_case(k).resolved());
  }
}
