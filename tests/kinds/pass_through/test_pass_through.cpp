// A stage added at run time, from this folder alone, runs in front of a loss kind through the case reader, thread
// ranks, the host oracle (which judges its gradient as a check of its own) and the gate.
#include <doctest/doctest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/runner/gate.hpp"
#include "pass_through_stage.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

nlohmann::json staged_case(const std::string& kind, int tp, int cp, int dp, int ga) {
  nlohmann::json doc = {{"name", "pass-through-" + kind},
                        {"shape", {{"vocab", 96}}},
                        {"loss", {{"kind", kind}}},
                        {"stage", {{"kind", testing::kPassThrough}}},
                        {"inputs", {{"seed", 5}, {"scale", 2.0}, {"ignore_fraction", 0.2}}},
                        {"batch", {{"sequence_lengths", {9, 4, 7, 12}}}},
                        {"layout", {{"tp", tp}, {"cp", cp}, {"dp", dp}, {"ga", ga}}},
                        {"timeout_seconds", 60.0}};
  if (kind == "cross_entropy") doc["loss"]["label_smoothing"] = 0.1, doc["loss"]["smoothing_convention"] = "pytorch";
  return doc;
}

}  // namespace

TEST_CASE("a case names its stage, and an unknown stage is refused naming the registered ones") {
  testing::register_pass_through();
  const Case c = testing::make_case(staged_case("cross_entropy", 2, 1, 1, 1));
  REQUIRE(c.loss.stage != nullptr);
  CHECK(c.resolved()["stage"]["kind"] == testing::kPassThrough);
  nlohmann::json unknown = staged_case("cross_entropy", 1, 1, 1, 1);
  unknown["stage"]["kind"] = "lm_head_9000";
  CHECK_THROWS_WITH_AS(testing::make_case(unknown), doctest::Contains("$.stage.kind: expected a registered stage"),
                       CaseError);
  CHECK(testing::make_case(testing::case_json(8, 32, 2)).resolved().contains("stage") == false);
}

TEST_CASE("the correct implementation passes in front of every kind, its stage gradient judged as its own check") {
  testing::register_pass_through();
  for (const std::string kind : {"cross_entropy", "kd"}) {
    for (const auto& [tp, cp, dp, ga] : std::vector<std::array<int, 4>>{{1, 1, 1, 1}, {2, 1, 2, 2}, {2, 2, 1, 1}}) {
      CAPTURE(kind);
      CAPTURE(tp);
      CAPTURE(cp);
      const RunResult r = testing::run_with(testing::make_case(staged_case(kind, tp, cp, dp, ga)), "correct");
      CHECK(r.verdict == Verdict::pass);
      CHECK(testing::check_named(r, "dh").verdict == Verdict::pass);
    }
  }
}

TEST_CASE("the stage's bug fails dh and nothing else, and applies only to cases with the stage") {
  testing::register_pass_through();
  const Implementation* bug = find_implementation(testing::kPassThroughTwice);
  REQUIRE(bug != nullptr);
  const RunResult r = testing::run_with(testing::make_case(staged_case("cross_entropy", 2, 1, 2, 1)), bug->name);
  CHECK(r.verdict == Verdict::fail);
  CHECK(testing::check_named(r, "dh").verdict == Verdict::fail);
  CHECK(testing::check_named(r, "dh").margin > 1e3);  // 2 g against g: the whole gradient off
  CHECK(testing::check_named(r, "grad").verdict == Verdict::pass);
  CHECK(testing::check_named(r, "loss").verdict == Verdict::pass);
  CHECK_THROWS_AS(testing::run_with(testing::make_case(testing::case_json(8, 32, 2)), bug->name), CaseError);
}

TEST_CASE("a stage without a CUDA part: CUDA refuses the case before any work") {
  testing::register_pass_through();
  RunOptions options;
  options.device = RunOptions::Device::cuda;
  const Case c = testing::make_case(staged_case("cross_entropy", 1, 1, 1, 1));
  if (cuda::built_with_cuda()) {
    CHECK_THROWS_WITH_AS(run_case(c, options), doctest::Contains("the stage pass_through has no CUDA implementation"),
                         CaseError);
  } else {  // a build without CUDA refuses every --backend cuda run, naming that
    CHECK_THROWS_WITH_AS(run_case(c, options), doctest::Contains("this build has no CUDA"), InternalError);
  }
}

TEST_CASE("the gate runs a staged case, records golden outcomes with the stage's check and holds them") {
  testing::register_pass_through();
  nlohmann::json doc = staged_case("cross_entropy", 2, 1, 2, 1);
  doc["sweep"] = {{"tp", {1, 2}}, {"ga", {1, 2}}};
  const auto [recorded, again] = testing::gate_record_and_hold(
      doc, "lossverify-stage-pass-through", {"correct", testing::kPassThroughTwice, "dp-local-mean"});
  CHECK(recorded.golden_updated);
  CHECK(recorded.false_alarms == 0);
  CHECK(again.passed());
  CHECK(again.mismatches == 0);
  CHECK(again.false_alarms == 0);
  CHECK(again.bugs_caught == 2);
}

}  // namespace lossverify
