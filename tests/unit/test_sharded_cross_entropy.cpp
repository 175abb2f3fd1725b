// The sharded CPU implementation against the reference at many layouts, and the catalogued bugs caught
// with the signals docs/spec.md §7 predicts for them.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

const CheckResult& check_named(const RunResult& r, const std::string& name) {
  for (const auto& c : r.checks) {
    if (c.name == name) return c;
  }
  FAIL("no check named " << name);
  return r.checks.front();
}

RunResult run(const nlohmann::json& j, const std::string& impl = "correct") {
  RunOptions options;
  options.implementation = impl;
  options.threads = 2;
  return run_case(testing::make_case(j), options);
}

}  // namespace

TEST_CASE("tp_sharded_correct_implementation_matches_reference_for_every_tp_and_dtype") {
  const nlohmann::json losses[] = {
      {{"label_smoothing", 0.1}, {"smoothing_convention", "pytorch"}},
      {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}, {"z_loss_weight", 0.001}, {"reduction", "sum"}},
      {{"reduction", "none"}, {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.25}, {"high", 4.0}}}},
  };
  for (int tp : {1, 2, 3, 4, 8}) {
    for (const char* dtype : {"fp32", "bf16", "fp16"}) {
      for (const auto& loss : losses) {
        auto j = testing::case_json(48, 257, tp, dtype);
        j["loss"] = loss;
        j["inputs"]["ignore_fraction"] = 0.15;
        const RunResult r = run(j);
        CAPTURE(tp);
        CAPTURE(dtype);
        CAPTURE(loss.dump());
        CHECK(r.verdict == Verdict::pass);
        for (const auto& check : r.checks) {
          CAPTURE(check.name);
          CHECK(check.verdict != Verdict::fail);
          // Passes with a margin, not by a hair: 16-bit gradients are judged in ulps of the exact value,
          // where correct rounding is 0.5 plus the float32 compute error.
          CHECK(check.margin < (check.name == "grad" && std::string(dtype) != "fp32" ? 0.51 : 0.5));
        }
        CHECK(check_named(r, "rank_agreement").verdict == (tp > 1 ? Verdict::pass : Verdict::not_applicable));
      }
    }
  }
}

TEST_CASE("correct_implementation_is_finite_on_a_240_logit_gap") {
  auto j = testing::case_json(4, 32, 2);
  j["loss"] = {{"label_smoothing", 0.1}};
  std::vector<double> gap(32, 0.0);
  gap[5] = 240.0;
  j["inputs"]["overrides"] = {{{"token", 0}, {"logits", gap}, {"label", 5}}};
  const RunResult r = run(j);
  CHECK(r.verdict == Verdict::pass);
}

TEST_CASE("all_masked_batch_loss_0_and_zero_gradient_on_every_rank") {
  auto j = testing::case_json(8, 40, 4);
  j["inputs"]["ignore_fraction"] = 1.0;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation("correct"), RunOptions{});
  for (const RankOutput& out : ranks.outputs) {
    CHECK(out.reduced_loss == 0.0f);
    CHECK(out.logged_valid_tokens == 0);
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      for (std::int64_t v = out.assignment.vocab.begin; v < out.assignment.vocab.end; ++v)
        CHECK(out.grad_at(i, v) == 0.0);
    }
  }
}

TEST_CASE("smoothing_partition_vocab_fails_with_its_signals_at_tp4") {
  // Megatron convention, sum reduction (weight 1), no ignored tokens: the signals of docs/spec.md §7 exactly.
  const double alpha = 0.1;
  const std::int64_t vocab = 400;
  const int tp = 4;
  auto j = testing::case_json(32, vocab, tp);
  j["loss"] = {{"label_smoothing", alpha}, {"smoothing_convention", "megatron"}, {"reduction", "sum"}};
  const RunResult r = run(j, "smoothing-partition-vocab");
  CHECK(r.verdict == Verdict::fail);
  for (const std::string name : {"loss", "grad", "rank_agreement", "row_sum"}) {
    CAPTURE(name);
    CHECK(check_named(r, name).verdict == Verdict::fail);
    CHECK(check_named(r, name).margin > 10.0);
  }
  CHECK(check_named(r, "finite").verdict == Verdict::pass);

  // Non-target gradient offset -a (1/(V_p - 1) - 1/(V - 1)) and row sum -(TP - 1) a V_p / (V_p - 1).
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun buggy = execute_ranks(c, inputs, *find_implementation("smoothing-partition-vocab"), RunOptions{});
  const RankRun right = execute_ranks(c, inputs, *find_implementation("correct"), RunOptions{});
  const double shard = static_cast<double>(vocab / tp);
  const double offset = -alpha * (1.0 / (shard - 1.0) - 1.0 / static_cast<double>(vocab - 1));
  const double expected_row_sum = -(tp - 1) * alpha * shard / (shard - 1.0);
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    double row_sum = 0.0;
    for (int k = 0; k < tp; ++k) {
      const RankOutput& b = buggy.outputs[static_cast<std::size_t>(k)];
      const RankOutput& g = right.outputs[static_cast<std::size_t>(k)];
      for (std::int64_t v = b.assignment.vocab.begin; v < b.assignment.vocab.end; ++v) {
        row_sum += b.grad_at(t, v);
        if (v != inputs.label(t)) CHECK(b.grad_at(t, v) - g.grad_at(t, v) == doctest::Approx(offset).epsilon(1e-4));
      }
    }
    CHECK(row_sum == doctest::Approx(expected_row_sum).epsilon(1e-5));
  }
}

TEST_CASE("smoothing_partition_vocab_is_invisible_at_tp1_and_without_smoothing") {
  auto j = testing::case_json(32, 300, 1);
  j["loss"] = {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}};
  CHECK(run(j, "smoothing-partition-vocab").verdict == Verdict::pass);
  j["layout"]["tp"] = 4;
  j["loss"]["label_smoothing"] = 0.0;
  CHECK(run(j, "smoothing-partition-vocab").verdict == Verdict::pass);
  j["loss"]["label_smoothing"] = 0.1;
  CHECK(run(j, "smoothing-partition-vocab").verdict == Verdict::fail);
}

TEST_CASE("smoothing_log_after_exp_gives_infinite_loss_past_the_underflow_gap") {
  auto j = testing::case_json(8, 32, 2);
  j["loss"] = {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}};
  // No large gap: log(exp(x - M) / S) is finite and merely less accurate; the bug stays hidden.
  CHECK(run(j, "smoothing-log-after-exp").verdict == Verdict::pass);

  std::vector<double> gap(32, 0.0);
  gap[5] = 240.0;
  j["inputs"]["overrides"] = {{{"token", 3}, {"logits", gap}, {"label", 5}}};
  const RunResult r = run(j, "smoothing-log-after-exp");
  CHECK(r.verdict == Verdict::fail);
  CHECK(check_named(r, "loss").verdict == Verdict::fail);
  CHECK(check_named(r, "finite").verdict == Verdict::fail);
  CHECK(check_named(r, "grad").verdict == Verdict::pass);  // the backward never used log(p)

  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation("smoothing-log-after-exp"), RunOptions{});
  for (const RankOutput& out : ranks.outputs) {
    CHECK(out.token_loss[3] == std::numeric_limits<float>::infinity());
    CHECK(std::isfinite(out.token_loss[2]));
  }

  // The same rows at a gap of 80 (< ~103) stay finite.
  gap[5] = 80.0;
  j["inputs"]["overrides"] = {{{"token", 3}, {"logits", gap}, {"label", 5}}};
  CHECK(run(j, "smoothing-log-after-exp").verdict == Verdict::pass);
}

TEST_CASE("reports_are_bitwise_identical_from_run_to_run") {
  auto j = testing::case_json(64, 333, 3, "bf16");
  j["loss"] = {{"label_smoothing", 0.1}, {"z_loss_weight", 0.001}};
  const RunResult a = run(j);
  const RunResult b = run(j);
  REQUIRE(a.checks.size() == b.checks.size());
  for (std::size_t k = 0; k < a.checks.size(); ++k) {
    CHECK(a.checks[k].metrics == b.checks[k].metrics);
    CHECK(a.checks[k].margin == b.checks[k].margin);
  }
}
