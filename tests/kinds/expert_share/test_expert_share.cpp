// A kind whose rows are whole on every rank and whose loss needs a collective over a scope runs through the case
// reader (layout.sp), thread ranks, the host oracle and the gate from this folder alone.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "expert_share_kind.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/gate.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

struct Layout {
  int tp, cp, dp, ga;
  bool sp;
};

nlohmann::json expert_share_case(const Layout& l) {
  return {{"name", "expert-share"},
          {"shape", {{"experts", 6}}},  // E = 6, fewer than some TP degrees below
          {"loss", {{"kind", testing::kExpertShare}}},
          {"inputs", {{"seed", 11}, {"scale", 2.0}, {"ignore_fraction", 0.2}}},
          {"batch", {{"sequence_lengths", {9, 5, 7, 12, 3, 8}}}},
          {"layout", {{"tp", l.tp}, {"cp", l.cp}, {"dp", l.dp}, {"ga", l.ga}, {"sp", l.sp}}},
          {"timeout_seconds", 60.0}};
}

// L of the whole step in long double, from the definition, with token `bumped`'s expert `e` moved by `h`.
long double step_loss(const Case& c, const InputSource& inputs, std::int64_t bumped, std::int64_t e, double h) {
  const auto experts = static_cast<std::size_t>(c.shape.vocab);
  long double total = 0.0L;
  int scopes = 0;
  for (int dp = 0; dp < c.layout.dp; ++dp) {
    for (int k = 0; k < c.layout.ga; ++k) {
      std::vector<long double> mean(experts, 0.0L);
      int n = 0;
      for (const std::int64_t s : sequences_of_slot(inputs.batch(), c.batch, c.layout, dp, k)) {
        const Sequence& q = inputs.batch().sequences()[static_cast<std::size_t>(s)];
        for (std::int64_t t = q.begin; t < q.begin + q.length; ++t) {
          if (!inputs.is_valid(t)) continue;
          std::vector<float> row(experts);
          inputs.logits(t, 0, c.shape.vocab, row.data());
          std::vector<long double> x(row.begin(), row.end());
          if (t == bumped) x[static_cast<std::size_t>(e)] += h;
          long double z = 0.0L;
          for (long double v : x) z += std::exp(v);
          for (std::size_t j = 0; j < experts; ++j) mean[j] += std::exp(x[j]) / z;
          ++n;
        }
      }
      if (n == 0) continue;
      ++scopes;
      long double sum = 0.0L;
      for (long double m : mean) sum += (m / n) * (m / n);
      total += static_cast<long double>(experts) * sum;
    }
  }
  return total / scopes;
}

}  // namespace

TEST_CASE("layout.sp is defined once: read for a kind with whole rows, refused for one that splits columns") {
  testing::register_expert_share();
  const Case c = testing::make_case(expert_share_case({8, 1, 1, 1, true}));  // tp 8 > E 6: no column to split
  CHECK(c.layout.sp);
  CHECK(c.resolved()["layout"]["sp"] == true);
  CHECK(c.resolved()["shape"]["experts"] == 6);  // the kind names its columns
  nlohmann::json vocab = expert_share_case({1, 1, 1, 1, false});
  vocab["shape"] = {{"vocab", 6}};
  CHECK_THROWS_WITH_AS(testing::make_case(vocab), doctest::Contains("experts"), CaseError);
  CHECK_FALSE(tp_splits_columns(c));
  CHECK(token_replicas(c) == 1);
  CHECK(token_replicas(testing::make_case(expert_share_case({4, 1, 1, 1, false}))) == 4);
  nlohmann::json ce = testing::case_json(8, 32, 2);
  ce["layout"]["sp"] = true;
  CHECK_THROWS_WITH_AS(testing::make_case(ce), doctest::Contains("$.layout.sp: applies to a kind whose rows are whole"),
                       CaseError);
}

TEST_CASE("the reference is the definition: L summed from its tokens, and its gradient by finite differences") {
  testing::register_expert_share();
  const Case c = testing::make_case(expert_share_case({1, 1, 2, 2, false}));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const auto experts = static_cast<std::size_t>(c.shape.vocab);
  long double logged = 0.0L;
  std::vector<double> logits(experts), grad(experts);
  int checked = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    std::vector<float> row(experts);
    inputs.logits(t, 0, c.shape.vocab, row.data());
    for (std::size_t e = 0; e < experts; ++e) logits[e] = row[e];
    const ReferenceToken r = reference.evaluate(t, logits, {}, grad);
    logged += static_cast<long double>(r.weight) * r.loss;
    if (t % 5 == 0) {  // central differences of L in long double, step 1e-5: error about 1e-10
      for (std::size_t e = 0; e < experts; ++e) {
        const long double h = 1e-5L;
        const long double slope = (step_loss(c, inputs, t, static_cast<std::int64_t>(e), static_cast<double>(h)) -
                                   step_loss(c, inputs, t, static_cast<std::int64_t>(e), -static_cast<double>(h))) /
                                  (2 * h);
        CHECK(grad[e] == doctest::Approx(static_cast<double>(slope)).epsilon(1e-6));
      }
      ++checked;
    }
  }
  CHECK(static_cast<double>(logged) ==
        doctest::Approx(static_cast<double>(step_loss(c, inputs, -1, 0, 0.0))).epsilon(1e-13));
  CHECK(checked > 3);
}

TEST_CASE("the correct sharded implementation passes with TP replicating tokens and with TP splitting them") {
  testing::register_expert_share();
  for (const Layout& l : std::vector<Layout>{{1, 1, 1, 1, false},
                                             {2, 1, 1, 1, false},
                                             {2, 1, 1, 1, true},
                                             {3, 2, 1, 2, true},
                                             {8, 1, 2, 1, true},
                                             {2, 2, 2, 2, false}}) {
    CAPTURE(l.tp);
    CAPTURE(l.cp);
    CAPTURE(l.dp);
    CAPTURE(l.ga);
    CAPTURE(l.sp);
    const RunResult r = testing::run_with(testing::make_case(expert_share_case(l)), "correct");
    CHECK(r.verdict == Verdict::pass);
    CHECK(testing::check_named(r, "loss").verdict == Verdict::pass);
    CHECK(testing::check_named(r, "grad").verdict == Verdict::pass);
    CHECK(testing::check_named(r, "row_sum").verdict == Verdict::pass);
  }
}

TEST_CASE("the scope's collective matters: its bug is caught wherever a scope spans ranks, and only there") {
  testing::register_expert_share();
  const std::string bug = testing::kExpertShareLocalScope;
  REQUIRE(find_implementation(bug) != nullptr);
  for (const Layout& l : std::vector<Layout>{{2, 1, 1, 1, true}, {1, 2, 1, 1, false}}) {
    const RunResult r = testing::run_with(testing::make_case(expert_share_case(l)), bug);
    CHECK(r.verdict == Verdict::fail);
    CHECK(testing::check_named(r, "loss").verdict == Verdict::fail);
    CHECK(testing::check_named(r, "grad").verdict == Verdict::fail);
  }
  // TP replicating tokens: each rank holds its whole scope, and the bug computes the same numbers.
  CHECK(testing::run_with(testing::make_case(expert_share_case({2, 1, 2, 1, false})), bug).verdict == Verdict::pass);
}

TEST_CASE("the gate runs the sketch over a sweep with sequence parallelism and holds its golden outcomes") {
  testing::register_expert_share();
  nlohmann::json doc = expert_share_case({2, 1, 1, 1, true});
  doc["sweep"] = {{"tp", {1, 2, 4}}, {"cp", {1, 2}}, {"sp", {false, true}}};
  const auto [recorded, again] =
      testing::gate_record_and_hold(doc, "lossverify-kind-expert-share", {"correct", testing::kExpertShareLocalScope});
  CHECK(recorded.golden_updated);
  CHECK(recorded.false_alarms == 0);
  CHECK(again.passed());
  CHECK(again.mismatches == 0);
  CHECK(again.false_alarms == 0);
  CHECK(again.bugs_caught == 1);
  REQUIRE(again.sweeps.size() == 1);
  CHECK(sweep_layouts(testing::make_case(doc)).size() == 10);  // tp x cp x sp, sp at tp 1 once
}

}  // namespace lossverify
