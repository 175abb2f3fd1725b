// A loss kind added at run time, from this folder alone, runs through the case reader, the CPU backend on
// thread ranks, the oracle and the gate like a built-in one.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "log_partition_kind.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/gate.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

nlohmann::json log_partition_case(int tp, int cp, int dp, int ga, double sharpness = 1.0) {
  return {{"name", "log-partition"},
          {"shape", {{"vocab", 96}}},
          {"loss", {{"kind", testing::kLogPartition}, {"sharpness", sharpness}}},
          {"inputs", {{"seed", 7}, {"scale", 3.0}, {"ignore_fraction", 0.25}}},
          {"batch", {{"sequence_lengths", {9, 4, 7, 12}}}},
          {"layout", {{"tp", tp}, {"cp", cp}, {"dp", dp}, {"ga", ga}}},
          {"timeout_seconds", 60.0}};
}

}  // namespace

TEST_CASE("a kind registered at run time is read from a case, and other kinds' keys are refused by name") {
  testing::register_log_partition();
  const Case c = testing::make_case(log_partition_case(2, 1, 1, 1));
  CHECK(kind_of(c.loss).name() == testing::kLogPartition);
  CHECK(c.resolved()["loss"]["kind"] == testing::kLogPartition);
  nlohmann::json smoothing = log_partition_case(1, 1, 1, 1);
  smoothing["loss"]["label_smoothing"] = 0.1;
  CHECK_THROWS_WITH_AS(testing::make_case(smoothing),
                       doctest::Contains("label_smoothing: applies to cross_entropy only, not log_partition"),
                       CaseError);
  nlohmann::json unknown = log_partition_case(1, 1, 1, 1);
  unknown["loss"]["kind"] = "no_such_kind";
  CHECK_THROWS_WITH_AS(testing::make_case(unknown), doctest::Contains("log_partition"), CaseError);
}

TEST_CASE("the kind's setting is read, checked and written back from its table") {
  testing::register_log_partition();
  CHECK(testing::make_case(log_partition_case(2, 1, 1, 1, 2.5)).resolved()["loss"]["sharpness"] == 2.5);
  CHECK(testing::make_case(log_partition_case(2, 1, 1, 1)).resolved()["loss"]["sharpness"] == 1.0);
  CHECK_THROWS_WITH_AS(testing::make_case(log_partition_case(1, 1, 1, 1, 0.0)),
                       doctest::Contains("$.loss.sharpness: must be in (0, 100], got 0.0"), CaseError);
  nlohmann::json ce = testing::case_json(8, 32, 1);
  ce["loss"]["sharpness"] = 2.0;
  CHECK_THROWS_WITH_AS(testing::make_case(ce), doctest::Contains("sharpness: applies to log_partition only"),
                       CaseError);
}

TEST_CASE("the oracle evaluates the kind's definition: l = lse(beta x) / beta, gradient softmax(beta x)") {
  testing::register_log_partition();
  const double beta = 2.5;
  const Case c = testing::make_case(log_partition_case(1, 1, 1, 1, beta));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const auto vocab = static_cast<std::size_t>(c.shape.vocab);
  std::vector<double> logits(vocab), grad(vocab);
  int checked = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    std::vector<float> row(vocab);
    inputs.logits(t, 0, c.shape.vocab, row.data());
    for (std::size_t v = 0; v < vocab; ++v) logits[v] = row[v];
    const ReferenceToken r = reference.evaluate(t, logits, {}, grad);
    long double sum = 0.0L;  // independently, in long double
    for (double x : logits) sum += std::exp(static_cast<long double>(beta) * x);
    const auto lse = static_cast<double>(std::log(sum));
    CHECK(r.loss == doctest::Approx(lse / beta).epsilon(1e-14));
    double grad_sum = 0.0;
    for (std::size_t v = 0; v < vocab; ++v) {
      CHECK(grad[v] == doctest::Approx(r.weight * std::exp(beta * logits[v] - lse)).epsilon(1e-12));
      grad_sum += grad[v];
    }
    CHECK(grad_sum == doctest::Approx(r.weight).epsilon(1e-12));
    ++checked;
  }
  CHECK(checked > 10);
}

TEST_CASE("the correct sharded implementation passes on thread ranks at every layout") {
  testing::register_log_partition();
  for (const auto& [tp, cp, dp, ga] : std::vector<std::array<int, 4>>{{1, 1, 1, 1}, {2, 1, 2, 2}, {3, 2, 1, 1}}) {
    CAPTURE(tp);
    CAPTURE(cp);
    CAPTURE(dp);
    CAPTURE(ga);
    const RunResult r = testing::run_with(testing::make_case(log_partition_case(tp, cp, dp, ga, 2.5)), "correct");
    CHECK(r.verdict == Verdict::pass);
    CHECK(testing::check_named(r, "loss").verdict == Verdict::pass);
    CHECK(testing::check_named(r, "grad").verdict == Verdict::pass);
    CHECK(testing::check_named(r, "row_sum").verdict == Verdict::pass);
  }
}

TEST_CASE("the kind's catalogued bug is caught where it shows, at TP > 1, and only applies to its kind") {
  testing::register_log_partition();
  const Implementation* bug = find_implementation(testing::kLogPartitionLocalSum);
  REQUIRE(bug != nullptr);
  const RunResult tp2 = testing::run_with(testing::make_case(log_partition_case(2, 1, 1, 1)), bug->name);
  CHECK(tp2.verdict == Verdict::fail);
  CHECK(testing::check_named(tp2, "loss").verdict == Verdict::fail);
  CHECK(testing::check_named(tp2, "grad").verdict == Verdict::fail);
  const RunResult tp1 = testing::run_with(testing::make_case(log_partition_case(1, 1, 2, 1)), bug->name);
  CHECK(tp1.verdict == Verdict::pass);
  CHECK_THROWS_AS(testing::run_with(testing::make_case(testing::case_json(8, 32, 2)), bug->name), CaseError);
}

TEST_CASE("the bug that needs the setting: the loss off by beta where beta != 1, the gradient right") {
  testing::register_log_partition();
  const Implementation* bug = find_implementation(testing::kLogPartitionNoInverseSharpness);
  REQUIRE(bug != nullptr);
  const RunResult sharp = testing::run_with(testing::make_case(log_partition_case(2, 1, 2, 1, 2.5)), bug->name);
  CHECK(sharp.verdict == Verdict::fail);
  CHECK(testing::check_named(sharp, "loss").verdict == Verdict::fail);
  CHECK(testing::check_named(sharp, "grad").verdict == Verdict::pass);
  const RunResult plain = testing::run_with(testing::make_case(log_partition_case(2, 1, 2, 1, 1.0)), bug->name);
  CHECK(plain.verdict == Verdict::pass);
}

TEST_CASE("the gate runs the kind's case, records golden outcomes and then holds them") {
  testing::register_log_partition();
  nlohmann::json doc = log_partition_case(2, 1, 2, 1, 2.5);
  doc["sweep"] = {{"tp", {1, 2, 4}}, {"ga", {1, 2}}};
  const auto [recorded, again] = testing::gate_record_and_hold(
      doc, "lossverify-kind-log-partition",
      {"correct", testing::kLogPartitionLocalSum, testing::kLogPartitionNoInverseSharpness});
  CHECK(recorded.golden_updated);
  CHECK(recorded.false_alarms == 0);
  bool layout_bug_ran = false;
  for (const GateCell& cell : recorded.cells) {
    if (cell.implementation == "dp-local-mean") layout_bug_ran = cell.verdict == "fail";
  }
  CHECK(layout_bug_ran);  // unequal valid-token counts over DP: caught on this kind as on any other
  CHECK(again.passed());
  CHECK(again.mismatches == 0);
  CHECK(again.false_alarms == 0);
  CHECK(again.bugs_caught == 2);
  CHECK(again.sweeps.size() == 1);
}

TEST_CASE("a kind without a CUDA implementation is refused on the CUDA backend before any work") {
  testing::register_log_partition();
  RunOptions options;
  options.device = RunOptions::Device::cuda;
  CHECK_THROWS_AS(run_case(testing::make_case(log_partition_case(1, 1, 1, 1)), options), Error);
}

TEST_CASE("a native plugin computes the kind, named by string, and is judged like the kind's own ranks") {
  testing::register_log_partition();
  const std::string plugin = std::string("plugin:") + LOSSVERIFY_PLUGIN_LOG_PARTITION_PLUGIN;
  for (const auto& [tp, cp, dp, ga] : std::vector<std::array<int, 4>>{{1, 1, 1, 1}, {2, 2, 1, 2}, {3, 1, 2, 1}}) {
    CAPTURE(tp);
    CAPTURE(cp);
    CAPTURE(dp);
    CAPTURE(ga);
    const RunResult r = testing::run_with(testing::make_case(log_partition_case(tp, cp, dp, ga, 2.5)), plugin);
    CHECK(r.verdict == Verdict::pass);
    CHECK(testing::check_named(r, "grad").verdict == Verdict::pass);
    CHECK(testing::check_named(r, "loss").verdict == Verdict::pass);
  }
  // The plugin names only its kind: a cross-entropy case is not its to compute.
  CHECK_THROWS_WITH_AS(testing::run_with(testing::make_case(testing::case_json(8, 32, 2)), plugin),
                       doctest::Contains("does not compute cross_entropy losses"), CaseError);
}

TEST_CASE("the plugin ABI carries the setting: a plugin that does not name it gets it only at its fallback") {
  testing::register_log_partition();
  const std::string old_plugin = std::string("plugin:") + LOSSVERIFY_PLUGIN_KIND_ONLY_PLUGIN;
  CHECK(testing::run_with(testing::make_case(log_partition_case(2, 1, 1, 1, 1.0)), old_plugin).verdict ==
        Verdict::pass);
  CHECK_THROWS_WITH_AS(
      testing::run_with(testing::make_case(log_partition_case(2, 1, 1, 1, 2.5)), old_plugin),
      doctest::Contains("does not implement the log_partition setting sharpness 2.5 (its lossverify_plugin_names() "
                        "does not name \"log_partition.sharpness\")"),
      CaseError);
  // The plugin that names it reads it from the block: at beta = 2.5 its loss is judged right (above), and the
  // unscaled loss of the catalogued bug would not be.
}

}  // namespace lossverify
