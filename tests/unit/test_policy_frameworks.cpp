// The policy kind's catalogue entries that the post-training frameworks' judgement added (docs/frameworks.md):
// each one's effect derived from its definition, on the correct run's per-token values and the generated
// inputs, and where each one cannot show.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/runner/run_case.hpp"
#include "policy_support.hpp"
#include "test_support.hpp"

using namespace lossverify;
using testing::failing;
using testing::gradients;
using testing::policy_json;
using testing::ratio_range;

namespace {

RankRun run_ranks(const Case& c, const InputSource& inputs, const std::string& impl) {
  RunOptions options;
  options.threads = 1;
  return execute_ranks(c, inputs, *find_implementation(impl), options);
}

// Per valid token, from a run's TP-leader rows: its log-probability and entropy.
struct TokenValues {
  std::map<std::int64_t, double> logprob, entropy;
};

TokenValues token_values(const InputSource& inputs, const RankRun& run) {
  TokenValues v;
  for (const RankOutput& out : run.outputs) {
    if (out.assignment.coordinates.tp != 0) continue;
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      const std::int64_t t = out.token_of(i);
      if (t < 0 || !inputs.is_valid(t)) continue;
      v.logprob[t] = out.token_values[2 * static_cast<std::size_t>(i)];
      v.entropy[t] = out.token_values[2 * static_cast<std::size_t>(i) + 1];
    }
  }
  return v;
}

// k3: e^(r - lambda) - (r - lambda) - 1 with r the reference log-probability.
double k3(const Case& c, const InputSource& inputs, std::int64_t token, double logprob) {
  const double d = logprob - policy_token_inputs(c, inputs, token).ref_logprob;
  return std::exp(-d) + d - 1.0;
}

// A case without whitening (its advantages are the generated ones) and without dual clip.
nlohmann::json plain_json(int tp, int cp, int dp, int ga) {
  nlohmann::json j = policy_json(tp, cp, dp, ga);
  j["loss"].erase("whiten_advantages");
  j["loss"].erase("dual_clip");
  j["inputs"]["dtype"] = "fp32";
  return j;
}

}  // namespace

TEST_CASE("rl-drgrpo-rank-batch-sum: loss and gradient x B/DP; rl-drgrpo-batch-sum's figure at GA = 1") {
  nlohmann::json j = policy_json(1, 1, 2, 2);
  j["loss"]["aggregation"] = "seq-mean-token-sum-norm";
  j["loss"]["norm_constant"] = 40;
  // Six sequences over two DP ranks: B/DP = 3, whatever the micro-batches hold.
  const auto [low, high] = ratio_range(testing::make_case(j), "rl-drgrpo-rank-batch-sum");
  CHECK(low == doctest::Approx(3.0).epsilon(1e-5));
  CHECK(high == doctest::Approx(3.0).epsilon(1e-5));
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = run_ranks(c, inputs, "correct");
  const RankRun wrong = run_ranks(c, inputs, "rl-drgrpo-rank-batch-sum");
  CHECK(wrong.outputs[0].reduced_loss == doctest::Approx(3.0 * right.outputs[0].reduced_loss).epsilon(1e-5));
  // At GA = 1 each rank's micro-batch is its B/DP sequences: the legacy actors' rl-drgrpo-batch-sum.
  j["layout"]["ga"] = 1;
  const Case ga1 = testing::make_case(j);
  const auto one = gradients(ga1, "rl-drgrpo-rank-batch-sum");
  const auto other = gradients(ga1, "rl-drgrpo-batch-sum");
  for (const auto& [at, value] : one) CHECK(value == doctest::Approx(other.at(at)).epsilon(1e-6));
  j["loss"]["aggregation"] = "token-mean";
  j["loss"].erase("norm_constant");
  CHECK(testing::run_with(testing::make_case(j), "rl-drgrpo-rank-batch-sum").verdict == Verdict::pass);
}

TEST_CASE("rl-kl-score-function: the gradient adds beta KL_t times the log-prob's gradient; loss exact") {
  // l = surrogate + beta KL e^(lambda - sg lambda): d l / d lambda gains beta KL_t. The log-prob's own gradient
  // per unit weight is that of the logprob objective (l = -lambda) negated, at the same token-mean weights.
  const Case c = testing::make_case(plain_json(2, 1, 1, 2));
  nlohmann::json lp = plain_json(2, 1, 1, 2);
  lp["loss"] = {{"kind", "policy"}, {"objective", "logprob"}, {"temperature", 0.7}};
  const Case logprob_case = testing::make_case(lp);
  const InputSource inputs(c);
  const TokenValues values = token_values(inputs, run_ranks(c, inputs, "correct"));
  const auto right = gradients(c, "correct");
  const auto wrong = gradients(c, "rl-kl-score-function");
  const auto logprob_grad = gradients(logprob_case, "correct");  // d(-lambda)/dx / N
  std::int64_t compared = 0;
  for (const auto& [at, value] : right) {
    const auto it = values.logprob.find(at.first);
    if (it == values.logprob.end()) continue;
    const double beta_kl = 0.05 * k3(c, inputs, at.first, it->second);
    const double expected = value - beta_kl * logprob_grad.at(at);
    CHECK(wrong.at(at) == doctest::Approx(expected).epsilon(1e-4).scale(1e-6));
    ++compared;
  }
  CHECK(compared > 10000);
  CHECK(failing(testing::run_with(c, "rl-kl-score-function")) == std::vector<std::string>{"grad"});
  nlohmann::json no_kl = plain_json(2, 1, 1, 2);
  no_kl["loss"]["kl_coef"] = 0.0;
  CHECK(testing::run_with(testing::make_case(no_kl), "rl-kl-score-function").verdict == Verdict::pass);
}

TEST_CASE("the aux-term bugs: the logged loss is the policy term plus the KL and entropy at their own weights") {
  // From the definitions: L' = L(no KL, no entropy) + beta sum_t w_KL(t) KL_t - c_H sum_t w_H(t) H_t, with
  // per-token KL and H from the correct run and the weights from where each token sits (world rank = DP rank at
  // tp = cp = 1; micro-batch k; B_r the rank's sequences, b_k and N_k micro-batch k's sequences and tokens).
  for (const char* bug : {"rl-aux-token-mean", "rl-aux-sample-weighted", "rl-aux-microbatch-mean"}) {
    CAPTURE(std::string(bug));
    nlohmann::json j = plain_json(1, 1, 2, 2);
    j["loss"]["aggregation"] = "seq-mean-token-mean";
    const Case c = testing::make_case(j);
    nlohmann::json policy_only = j;
    policy_only["loss"]["kl_coef"] = 0.0;
    policy_only["loss"]["entropy_coef"] = 0.0;
    const Case pc = testing::make_case(policy_only);
    const InputSource inputs(c);
    const TokenValues values = token_values(inputs, run_ranks(c, inputs, "correct"));
    const testing::TokenWeights t = testing::token_weights(c);
    const InputSource policy_inputs(pc);
    const double policy_term = run_ranks(pc, policy_inputs, "correct").outputs[0].reduced_loss;
    const auto n = static_cast<double>(t.sequence_of.size());
    std::map<int, double> rank_sequences;
    for (const auto& [place, sequences] : t.local) rank_sequences[place.first] += static_cast<double>(sequences.size());
    double expected = policy_term;
    for (const auto& [token, s] : t.sequence_of) {
      const auto& place = t.place.at(token);
      const auto& micro = t.local.at(place);
      double n_k = 0.0;
      for (const auto& [seq, count] : micro) n_k += static_cast<double>(count);
      const auto b_k = static_cast<double>(micro.size());
      const auto n_s = static_cast<double>(t.n_s.at(s));
      const double share = std::string(bug) == "rl-aux-sample-weighted" ? b_k / rank_sequences.at(place.first) : 0.5;
      double w_kl = 1.0 / n, w_h = 1.0 / n;
      if (std::string(bug) != "rl-aux-token-mean") {
        w_kl = share / (b_k * n_s * 2.0);
        w_h = share / (n_k * 2.0);
      }
      expected += 0.05 * w_kl * k3(c, inputs, token, values.logprob.at(token)) - 0.01 * w_h * values.entropy.at(token);
    }
    const RankRun wrong = run_ranks(c, inputs, bug);
    for (const RankOutput& out : wrong.outputs) CHECK(out.reduced_loss == doctest::Approx(expected).epsilon(2e-6));
    const RankRun right = run_ranks(c, inputs, "correct");
    CHECK(std::fabs(wrong.outputs[0].reduced_loss - right.outputs[0].reduced_loss) > 1e-4);
    // Each token's own loss stays the objective's: only the weights differ.
    for (std::size_t k = 0; k < right.outputs.size(); ++k)
      CHECK(wrong.outputs[k].token_loss == right.outputs[k].token_loss);
    CHECK(failing(testing::run_with(c, bug)) == std::vector<std::string>{"grad", "loss"});
  }
  // rl-aux-token-mean under token-mean is the correct objective, bit for bit.
  const Case token_mean = testing::make_case(plain_json(1, 1, 2, 2));
  CHECK(gradients(token_mean, "rl-aux-token-mean") == gradients(token_mean, "correct"));
}

TEST_CASE("rl-temperature-16bit: log-prob of x = bf16(z / T) in float32, its gradient through x; fp32 and T = 1 pass") {
  nlohmann::json j = plain_json(2, 1, 1, 1);
  j["inputs"]["dtype"] = "bf16";
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun wrong = run_ranks(c, inputs, "rl-temperature-16bit");
  const float inverse_t = static_cast<float>(1.0 / 0.7);
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::vector<Eigen::bfloat16> z(vocab);
  const TokenValues got = token_values(inputs, wrong);
  int tokens = 0;
  for (const auto& [t, logprob] : got.logprob) {
    inputs.logits(t, 0, c.shape.vocab, z.data());
    std::vector<double> x(vocab);
    double m = -INFINITY;
    for (std::size_t v = 0; v < vocab; ++v) {
      x[v] = round_to_dtype(static_cast<double>(static_cast<float>(z[v]) * inverse_t), DType::bf16);
      m = std::max(m, x[v]);
    }
    double sum = 0.0;
    for (double xv : x) sum += std::exp(xv - m);
    const double lse = m + std::log(sum);
    CHECK(logprob == doctest::Approx(x[static_cast<std::size_t>(inputs.label(t))] - lse).epsilon(1e-5));
    ++tokens;
  }
  CHECK(tokens > 60);
  const std::vector<std::string> names = failing(testing::run_with(c, "rl-temperature-16bit"));
  for (const char* check : {"grad", "logprob", "loss"}) {
    CAPTURE(check);
    CHECK(std::find(names.begin(), names.end(), check) != names.end());
  }
  nlohmann::json t1 = j;
  t1["loss"]["temperature"] = 1.0;
  CHECK(testing::run_with(testing::make_case(t1), "rl-temperature-16bit").verdict == Verdict::pass);
  CHECK(testing::run_with(testing::make_case(plain_json(2, 1, 1, 1)), "rl-temperature-16bit").verdict == Verdict::pass);
}

TEST_CASE("the 16-bit gradients: each element from its definition on the log-prob pass (l = -lambda)") {
  // One rank, token-mean over N valid tokens, T = 0.7, bf16: x = bf16(z / T), lse over x in double.
  // rl-temperature-16bit: g_v = bf16(bf16((-1/N) (delta - p_v)) / T), the float32 pass's gradient cast back, then
  // div_'s backward. rl-logprob-16bit: a 16-bit log_softmax's backward from its rounded output and upstream
  // gradient, g_v = bf16(bf16(bf16(-1/N) (delta - e^(bf16(x_v - lse)))) / T). The kernel's float32 sums may put
  // an element on the other side of a rounding midpoint: all within one bf16 step, nearly all equal.
  nlohmann::json j = plain_json(1, 1, 1, 1);
  j["loss"] = {{"kind", "policy"}, {"objective", "logprob"}, {"temperature", 0.7}};
  j["inputs"]["dtype"] = "bf16";
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  const float inverse_t = static_cast<float>(1.0 / 0.7);
  auto bf16 = [](double v) { return round_to_dtype(v, DType::bf16); };
  for (const char* bug : {"rl-temperature-16bit", "rl-logprob-16bit"}) {
    CAPTURE(std::string(bug));
    const bool logsoftmax16 = std::string(bug) == "rl-logprob-16bit";
    const RankOutput out = run_ranks(c, inputs, bug).outputs[0];
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < out.rows(); ++i) n += out.token_of(i) >= 0 && inputs.is_valid(out.token_of(i));
    const double w = 1.0 / static_cast<double>(n);
    std::vector<Eigen::bfloat16> z(vocab);
    std::int64_t elements = 0, equal = 0;
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      const std::int64_t t = out.token_of(i);
      if (t < 0 || !inputs.is_valid(t)) continue;
      inputs.logits(t, 0, c.shape.vocab, z.data());
      std::vector<double> x(vocab);
      double m = -INFINITY;
      for (std::size_t v = 0; v < vocab; ++v) {
        x[v] = bf16(static_cast<double>(static_cast<float>(z[v]) * inverse_t));
        m = std::max(m, x[v]);
      }
      double sum = 0.0;
      for (double xv : x) sum += std::exp(xv - m);
      const double lse = m + std::log(sum);
      for (std::size_t v = 0; v < vocab; ++v) {
        const double delta = static_cast<std::int64_t>(v) == inputs.label(t) ? 1.0 : 0.0;
        const double inner = logsoftmax16 ? bf16(bf16(-w) * (delta - std::exp(bf16(x[v] - lse))))
                                          : bf16(-w * (delta - std::exp(x[v] - lse)));
        const double expected = bf16(inner * inverse_t);
        const double got = out.grad_at(i, static_cast<std::int64_t>(v));
        const double step = expected == 0.0 ? 0.0 : std::ldexp(1.0, std::ilogb(std::fabs(expected)) - 7);
        CHECK(std::fabs(got - expected) <= step);
        equal += got == expected;
        ++elements;
      }
    }
    CHECK(elements > 10000);
    CHECK(equal >= elements - elements / 100);
  }
}

TEST_CASE(
    "rl-temperature-after-logprob: lambda = log_softmax(z)_y / T over the TP group, its gradient (delta - softmax(z)) "
    "/ T; "
    "T = 1 passes") {
  // One log-prob objective at T = 0.7 over two TP ranks: every token's log-prob and every gradient element from
  // their definitions in double, the pass at T = 1 then scaled by float32(1 / T).
  nlohmann::json j = plain_json(2, 1, 1, 1);
  j["loss"] = {{"kind", "policy"}, {"objective", "logprob"}, {"temperature", 0.7}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun wrong = run_ranks(c, inputs, "rl-temperature-after-logprob");
  const double inverse_t = static_cast<float>(1.0 / 0.7);
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::vector<float> z(vocab);
  auto log_softmax = [&](std::int64_t t) {
    inputs.logits(t, 0, c.shape.vocab, z.data());
    double m = -INFINITY, sum = 0.0;
    for (float v : z) m = std::max(m, static_cast<double>(v));
    for (float v : z) sum += std::exp(v - m);
    std::vector<double> out(vocab);
    for (std::size_t v = 0; v < vocab; ++v) out[v] = z[v] - m - std::log(sum);
    return out;
  };
  const TokenValues got = token_values(inputs, wrong);
  std::int64_t n = 0;
  for (const auto& [t, logprob] : got.logprob) {
    const std::vector<double> lp = log_softmax(t);
    CHECK(logprob == doctest::Approx(lp[static_cast<std::size_t>(inputs.label(t))] * inverse_t).epsilon(1e-5));
    ++n;
  }
  CHECK(n > 60);
  // token-mean of l = -lambda: g_v = -(1 / N) (delta - p_v(z)) / T on each rank's columns
  std::int64_t elements = 0;
  for (const RankOutput& out : wrong.outputs) {
    const VocabRange cols = out.assignment.vocab;
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      const std::int64_t t = out.token_of(i);
      if (t < 0 || !inputs.is_valid(t)) continue;
      const std::vector<double> lp = log_softmax(t);
      for (std::int64_t v = cols.begin; v < cols.end; ++v) {
        const double delta = v == inputs.label(t) ? 1.0 : 0.0;
        const double expected =
            -(delta - std::exp(lp[static_cast<std::size_t>(v)])) * inverse_t / static_cast<double>(n);
        CHECK(out.grad_at(i, v) == doctest::Approx(expected).epsilon(1e-5).scale(1e-6 / static_cast<double>(n)));
        ++elements;
      }
    }
  }
  CHECK(elements == n * c.shape.vocab);
  const std::vector<std::string> names = failing(testing::run_with(c, "rl-temperature-after-logprob"));
  for (const char* check : {"grad", "logprob", "loss"}) {
    CAPTURE(check);
    CHECK(std::find(names.begin(), names.end(), check) != names.end());
  }
  nlohmann::json t1 = j;
  t1["loss"]["temperature"] = 1.0;
  CHECK(testing::run_with(testing::make_case(t1), "rl-temperature-after-logprob").verdict == Verdict::pass);
}
