// The router kind (kinds/router/, not in the registry yet: this program registers it) through the case reader,
// thread ranks at every TP / SP / CP / DP / GA layout, the host oracle and the gate, its reference held to an
// independent long-double evaluation of the step's loss and its finite differences, and its catalogued bugs each
// caught where MOE.md §4 predicts and passing where it does not.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/gate.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

void register_router() {
  static std::once_flag once;
  std::call_once(once, [] { register_loss_kind(make_router_kind()); });
}

struct Layout {
  int tp, cp, dp, ga;
  bool sp;
};

nlohmann::json router_case(const Layout& l, nlohmann::json loss = nlohmann::json::object(), double ignore = 0.15,
                           std::vector<std::int64_t> lengths = {11, 6, 9, 14, 5, 7}) {
  loss["kind"] = "router";
  if (!loss.contains("top_k")) loss["top_k"] = 2;
  return {{"name", "router"},
          {"shape", {{"experts", 8}}},
          {"loss", loss},
          {"inputs", {{"seed", 3}, {"scale", 1.5}, {"ignore_fraction", ignore}}},
          // independent labels: a router's token counts wherever it is not padding, next token or not
          {"batch", {{"sequence_lengths", lengths}, {"labels", "independent"}}},
          {"layout", {{"tp", l.tp}, {"cp", l.cp}, {"dp", l.dp}, {"ga", l.ga}, {"sp", l.sp}}},
          {"timeout_seconds", 60.0}};
}

using LD = long double;

// The step's loss from the definition in long double: the mean over DP x GA micro-batches of each micro-batch's
// alpha E / (k T^2) sum_e c_e sum_t p_te + alpha_z / T sum_t lse_t^2, plus the mean over its sequences holding a
// valid token of alpha_s E / (k T_s^2) sum_e c_se sum_{t in s} p_te, every count computed here (top-k of the
// softmax) at the unmoved logits and held constant; token `bumped`'s logit `e` moved by h.
struct Coefficients {
  LD aux, seq_aux, z, global = 0.0L;
  bool running = false;
};
LD step_loss(const Case& c, const InputSource& inputs, const Coefficients& a, int k, std::int64_t bumped,
             std::int64_t e_bumped, LD h) {
  const auto experts = static_cast<std::size_t>(c.shape.vocab);
  struct Sums {
    std::vector<LD> counts, p;
    LD tokens = 0.0L;
  };
  auto fresh = [&] { return Sums{std::vector<LD>(experts, 0.0L), std::vector<LD>(experts, 0.0L), 0.0L}; };
  auto dot = [&](const std::vector<LD>& counts, const std::vector<LD>& p) {
    LD d = 0.0L;
    for (std::size_t e = 0; e < experts; ++e) d += counts[e] * p[e];
    return d;
  };
  struct Slot {
    Sums batch;
    std::vector<Sums> sequences;
    LD z_sum = 0.0L;
  };
  std::vector<Slot> slots;  // dp-major
  for (int dp = 0; dp < c.layout.dp; ++dp) {
    for (int m = 0; m < c.layout.ga; ++m) {
      Slot slot{fresh(), {}, 0.0L};
      for (const std::int64_t q : sequences_of_slot(inputs.batch(), c.batch, c.layout, dp, m)) {
        const Sequence& seq = inputs.batch().sequences()[static_cast<std::size_t>(q)];
        Sums own = fresh();
        for (std::int64_t t = seq.begin; t < seq.begin + seq.length; ++t) {
          if (!inputs.is_valid(t)) continue;
          std::vector<float> raw(experts);
          inputs.logits(t, 0, c.shape.vocab, raw.data());
          std::vector<LD> z(raw.begin(), raw.end());
          auto softmax = [&](const std::vector<LD>& x) {
            LD s = 0.0L;
            for (LD v : x) s += std::exp(v);
            std::vector<LD> p(experts);
            for (std::size_t e = 0; e < experts; ++e) p[e] = std::exp(x[e]) / s;
            return std::make_pair(p, std::log(s));
          };
          const std::vector<LD> routed = softmax(z).first;  // the counts: at the unmoved logits
          std::vector<std::size_t> order(experts);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(),
                           [&](std::size_t x, std::size_t y) { return routed[x] > routed[y]; });
          if (t == bumped) z[static_cast<std::size_t>(e_bumped)] += h;
          const auto [p, lse] = softmax(z);
          for (Sums* x : {&slot.batch, &own}) {
            for (int j = 0; j < k; ++j) x->counts[order[static_cast<std::size_t>(j)]] += 1.0L;
            for (std::size_t e = 0; e < experts; ++e) x->p[e] += p[e];
            x->tokens += 1.0L;
          }
          slot.z_sum += lse * lse;
        }
        if (own.tokens > 0.0L) slot.sequences.push_back(own);
      }
      slots.push_back(slot);
    }
  }
  const auto ga = static_cast<std::size_t>(c.layout.ga);
  LD total = 0.0L;
  for (std::size_t b = 0; b < slots.size(); ++b) {
    const Slot& slot = slots[b];
    if (slot.batch.tokens == 0.0L) continue;
    // the global counts: every slot of the step, or (running) every DP rank's micro-batches 0..m
    Sums global = fresh();
    for (std::size_t other = 0; other < slots.size(); ++other) {
      if (a.running && other % ga > b % ga) continue;
      for (std::size_t e = 0; e < experts; ++e) global.counts[e] += slots[other].batch.counts[e];
      global.tokens += slots[other].batch.tokens;
    }
    const LD e_count = static_cast<LD>(experts);
    LD loss = a.aux * e_count / (k * slot.batch.tokens * slot.batch.tokens) * dot(slot.batch.counts, slot.batch.p);
    for (const Sums& x : slot.sequences) {
      loss +=
          a.seq_aux * e_count / (k * x.tokens * x.tokens) * dot(x.counts, x.p) / static_cast<LD>(slot.sequences.size());
    }
    loss += a.global * e_count / (k * global.tokens * slot.batch.tokens) * dot(global.counts, slot.batch.p);
    total += loss + a.z / slot.batch.tokens * slot.z_sum;
  }
  return total / (c.layout.dp * c.layout.ga);
}

}  // namespace

TEST_CASE("router: the case names experts, reads its settings from the table and refuses k beyond E") {
  register_router();
  const Case c = testing::make_case(router_case({2, 1, 1, 1, true}, {{"score", "sigmoid"}, {"z_loss_coef", 0.001}}));
  CHECK(c.resolved()["shape"]["experts"] == 8);
  CHECK(c.resolved()["loss"]["score"] == "sigmoid");
  CHECK(c.resolved()["loss"]["aux_coef"] == 0.01);
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, false}, {{"top_k", 9}})),
                       doctest::Contains("$.loss.top_k: 9 exceeds the experts, 8"), CaseError);
  // Six sequences over 4 DP ranks x 2 micro-batches leave slots empty: the global counts' all-reduce could not meet.
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 4, 2, false}, {{"global_aux_coef", 0.01}})),
                       doctest::Contains("the global aux loss needs every micro-batch of every DP rank"), CaseError);
}

TEST_CASE("router: the reference is the step's loss from the definition, and its gradient the finite differences") {
  register_router();
  for (const std::string counts : {"step", "running"}) {
    CAPTURE(counts);
    const Case c = testing::make_case(router_case(
        {1, 1, 2, 2, false},
        {{"z_loss_coef", 0.002}, {"seq_aux_coef", 0.003}, {"global_aux_coef", 0.005}, {"global_counts", counts}}));
    const Coefficients a{0.01L, 0.003L, 0.002L, 0.005L, counts == "running"};
    const InputSource inputs(c);
    const LossReference reference(c, inputs);
    const auto experts = static_cast<std::size_t>(c.shape.vocab);
    LD logged = 0.0L;
    std::vector<double> logits(experts), grad(experts);
    int checked = 0;
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      if (!inputs.is_valid(t)) continue;
      std::vector<float> row(experts);
      inputs.logits(t, 0, c.shape.vocab, row.data());
      for (std::size_t e = 0; e < experts; ++e) logits[e] = row[e];
      const ReferenceToken r = reference.evaluate(t, logits, {}, grad);
      logged += static_cast<LD>(r.weight) * r.loss;
      if (t % 7 != 0) continue;
      for (std::size_t e = 0; e < experts; ++e) {
        const LD h = 1e-6L;
        const LD slope = (step_loss(c, inputs, a, 2, t, static_cast<std::int64_t>(e), h) -
                          step_loss(c, inputs, a, 2, t, static_cast<std::int64_t>(e), -h)) /
                         (2 * h);
        CHECK(grad[e] == doctest::Approx(static_cast<double>(slope)).epsilon(1e-6));
      }
      ++checked;
    }
    CHECK(static_cast<double>(logged) ==
          doctest::Approx(static_cast<double>(step_loss(c, inputs, a, 2, -1, 0, 0.0L))).epsilon(1e-13));
    CHECK(checked >= 4);
  }
}

TEST_CASE("router: the correct implementation passes with TP replicating tokens, splitting them, and over CP DP GA") {
  register_router();
  for (const Layout& l : std::vector<Layout>{{1, 1, 1, 1, false},
                                             {2, 1, 1, 1, false},
                                             {2, 1, 1, 1, true},
                                             {3, 2, 1, 2, true},
                                             {8, 1, 2, 1, true},
                                             {2, 2, 2, 2, false}}) {
    for (const std::string score : {"softmax", "sigmoid"}) {
      CAPTURE(l.tp);
      CAPTURE(l.cp);
      CAPTURE(l.dp);
      CAPTURE(l.ga);
      CAPTURE(l.sp);
      CAPTURE(score);
      const RunResult r = testing::run_with(
          testing::make_case(router_case(l, {{"score", score}, {"z_loss_coef", 0.001}, {"seq_aux_coef", 0.004}})),
          "correct");
      CHECK(r.verdict == Verdict::pass);
      CHECK(testing::check_named(r, "loss").verdict == Verdict::pass);
      CHECK(testing::check_named(r, "grad").verdict == Verdict::pass);
    }
  }
}

TEST_CASE("router: each catalogued bug is caught where MOE.md predicts it, and passes where it cannot show") {
  register_router();
  struct Expect {
    const char* bug;
    Layout layout;
    double ignore;
    bool fails;
    bool loss_fails;
  };
  const std::vector<Expect> expectations = {
      {"moe-aux-local-counts", {2, 1, 1, 1, true}, 0.15, true, true},     // the scope spans TP under SP
      {"moe-aux-local-counts", {1, 2, 1, 1, false}, 0.15, true, true},    // and CP
      {"moe-aux-local-counts", {2, 1, 2, 2, false}, 0.15, false, false},  // replicated TP: each rank holds its scope
      {"moe-aux-topk-squared", {1, 1, 1, 1, false}, 0.15, true, true},
      {"moe-aux-tp-sum", {2, 1, 1, 1, true}, 0.15, true, false},
      {"moe-aux-tp-sum", {2, 1, 1, 1, false}, 0.15, false, false},
      {"moe-aux-cp-missing", {1, 2, 1, 1, false}, 0.15, true, false},
      {"moe-aux-cp-missing", {2, 1, 2, 1, true}, 0.15, false, false},
      {"moe-aux-padding-counted", {1, 1, 1, 1, false}, 0.15, true, true},   // padded positions in the batch
      {"moe-aux-padding-counted", {1, 1, 2, 1, false}, 0.0, false, false},  // none (even lengths: no CP padding)
      {"moe-aux-no-grad", {2, 1, 1, 2, true}, 0.15, true, false},
      {"moe-aux-log-doubled", {2, 2, 1, 1, true}, 0.15, true, false},
      {"moe-aux-ga-overweight", {1, 2, 1, 2, false}, 0.15, true, false},
      {"moe-aux-ga-overweight", {1, 2, 2, 1, false}, 0.15, false, false},  // one micro-batch: x 1
  };
  for (const Expect& x : expectations) {
    const std::string bug_name = x.bug;
    CAPTURE(bug_name);
    CAPTURE(x.layout.tp);
    CAPTURE(x.layout.cp);
    CAPTURE(x.layout.sp);
    REQUIRE(find_implementation(x.bug) != nullptr);
    // Sequences of even length where nothing may be padding (the CP split pads each to a multiple of 2 CP).
    const std::vector<std::int64_t> lengths =
        x.ignore == 0.0 ? std::vector<std::int64_t>{10, 6, 8, 14, 4, 8} : std::vector<std::int64_t>{11, 6, 9, 14, 5, 7};
    const RunResult r = testing::run_with(testing::make_case(router_case(x.layout, {}, x.ignore, lengths)), x.bug);
    CHECK((r.verdict == Verdict::fail) == x.fails);
    CHECK((testing::check_named(r, "loss").verdict == Verdict::fail) == x.loss_fails);
  }
}

TEST_CASE("router: the gate sweeps tp x cp x sp and holds its golden outcomes") {
  register_router();
  nlohmann::json doc = router_case({2, 2, 1, 2, true}, {{"z_loss_coef", 0.001}});
  doc["sweep"] = {{"tp", {1, 2}}, {"cp", {1, 2}}, {"sp", {false, true}}};
  const auto [recorded, again] = testing::gate_record_and_hold(
      doc, "lossverify-kind-router",
      {"correct", "moe-aux-local-counts", "moe-aux-topk-squared", "moe-aux-tp-sum", "moe-aux-cp-missing",
       "moe-aux-padding-counted", "moe-aux-no-grad", "moe-aux-ga-overweight", "moe-aux-log-doubled"});
  CHECK(recorded.golden_updated);
  CHECK(recorded.false_alarms == 0);
  CHECK(again.passed());
  CHECK(again.mismatches == 0);
  CHECK(again.false_alarms == 0);
  CHECK(again.bugs_caught == 8);
}

}  // namespace lossverify
