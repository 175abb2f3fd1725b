// The router kind (kinds/router/) through the case reader, thread ranks at every TP / SP / CP / DP / GA layout, the
// host oracle and the checks: its reference held to an independent long-double evaluation of the step's loss and its
// finite differences (several layers, both scaling modes), and each catalogued bug's signal held to the factor
// MOE.md section 4 predicts, where it shows and where it cannot.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/repro/bundle.hpp"
#include "lossverify/repro/shrink.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

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
          {"batch", {{"sequence_lengths", lengths}}},
          {"layout", {{"tp", l.tp}, {"cp", l.cp}, {"dp", l.dp}, {"ga", l.ga}, {"sp", l.sp}}},
          {"timeout_seconds", 60.0}};
}

using LD = long double;

// The step's loss from the definition in long double, summed over layers: per micro-batch scope B,
//   alpha E / (k T^2) sum_e c_e sum_t p_te + alpha_z / T sum_t lse_t^2
//   + the mean over its sequences s holding a valid token of alpha_s E / (k T_s^2) sum_e c_se sum_{t in s} p_te
//   + alpha_g E / (k T^G T) sum_e c^G_e sum_t p_te,
// weighted 1 / (DP GA), or T / N per token; every count computed here (top-k of the softmax) at the unmoved logits
// and held constant; token `bumped`'s row column `column` moved by h.
struct Coefficients {
  LD aux, seq_aux, z, global = 0.0L;
  bool running = false;
  bool per_token = false;
  int counted = 0;      // the experts a token counts for (0: k)
  LD divisor = 0.0L;    // f_e's divisor (0: k)
  bool pooled = false;  // one aux loss over every layer's counts, scores and tokens (transformers)
};
LD step_loss(const Case& c, const InputSource& inputs, const Coefficients& a, int k, std::int64_t bumped,
             std::int64_t column, LD h) {
  const auto width = static_cast<std::size_t>(c.shape.vocab);
  const auto layers = static_cast<std::size_t>(c.resolved()["loss"]["layers"].get<int>());
  const std::size_t experts = width / layers;
  const int counted = a.counted > 0 ? a.counted : k;
  const LD divisor = a.divisor > 0.0L ? a.divisor : static_cast<LD>(k);
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
  auto softmax = [&](const std::vector<LD>& x) {
    LD s = 0.0L;
    for (LD v : x) s += std::exp(v);
    std::vector<LD> p(experts);
    for (std::size_t e = 0; e < experts; ++e) p[e] = std::exp(x[e]) / s;
    return std::make_pair(p, std::log(s));
  };
  struct Slot {
    Sums batch;
    std::vector<Sums> sequences;
    LD z_sum = 0.0L;
  };
  LD total = 0.0L, step_tokens = 0.0L;
  std::vector<std::vector<Slot>> per_layer(layers);  // dp-major slots of each layer
  for (std::size_t l = 0; l < layers; ++l) {
    for (int dp = 0; dp < c.layout.dp; ++dp) {
      for (int m = 0; m < c.layout.ga; ++m) {
        Slot slot{fresh(), {}, 0.0L};
        for (const std::int64_t q : sequences_of_slot(inputs.batch(), c.batch, c.layout, dp, m)) {
          const Sequence& seq = inputs.batch().sequences()[static_cast<std::size_t>(q)];
          Sums own = fresh();
          for (std::int64_t t = seq.begin; t < seq.begin + seq.length; ++t) {
            if (!inputs.is_valid(t)) continue;
            std::vector<float> raw(width);
            inputs.logits(t, 0, c.shape.vocab, raw.data());
            std::vector<LD> z(raw.begin() + static_cast<std::ptrdiff_t>(l * experts),
                              raw.begin() + static_cast<std::ptrdiff_t>((l + 1) * experts));
            const std::vector<LD> routed = softmax(z).first;  // the counts: at the unmoved logits
            std::vector<std::size_t> order(experts);
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(),
                             [&](std::size_t x, std::size_t y) { return routed[x] > routed[y]; });
            if (t == bumped && static_cast<std::size_t>(column) / experts == l) {
              z[static_cast<std::size_t>(column) % experts] += h;
            }
            const auto [p, lse] = softmax(z);
            for (Sums* x : {&slot.batch, &own}) {
              for (int j = 0; j < counted; ++j) x->counts[order[static_cast<std::size_t>(j)]] += 1.0L;
              for (std::size_t e = 0; e < experts; ++e) x->p[e] += p[e];
              x->tokens += 1.0L;
            }
            slot.z_sum += lse * lse;
          }
          if (own.tokens > 0.0L) slot.sequences.push_back(own);
        }
        if (l == 0) step_tokens += slot.batch.tokens;
        per_layer[l].push_back(slot);
      }
    }
  }
  const auto ga = static_cast<std::size_t>(c.layout.ga);
  if (a.pooled) {  // f_e = C_e / (k L T), P_e = S_e / (L T) with C and S summed over the layers
    for (std::size_t b = 0; b < per_layer.front().size(); ++b) {
      const LD t_b = per_layer.front()[b].batch.tokens;
      if (t_b == 0.0L) continue;
      Sums pooled = fresh();
      LD z = 0.0L;
      for (const std::vector<Slot>& slots : per_layer) {
        for (std::size_t e = 0; e < experts; ++e) {
          pooled.counts[e] += slots[b].batch.counts[e];
          pooled.p[e] += slots[b].batch.p[e];
        }
        z += a.z / t_b * slots[b].z_sum;
      }
      const LD lt = static_cast<LD>(layers) * t_b;
      const LD loss = a.aux * static_cast<LD>(experts) / (divisor * lt * lt) * dot(pooled.counts, pooled.p) + z;
      total += loss * (a.per_token ? t_b / step_tokens : 1.0L / (c.layout.dp * c.layout.ga));
    }
    return total;
  }
  for (const std::vector<Slot>& slots : per_layer) {
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
      const LD t_b = slot.batch.tokens;
      LD loss = a.aux * e_count / (divisor * t_b * t_b) * dot(slot.batch.counts, slot.batch.p);
      for (const Sums& x : slot.sequences) {
        loss += a.seq_aux * e_count / (divisor * x.tokens * x.tokens) * dot(x.counts, x.p) /
                static_cast<LD>(slot.sequences.size());
      }
      loss += a.global * e_count / (divisor * global.tokens * t_b) * dot(global.counts, slot.batch.p);
      loss += a.z / t_b * slot.z_sum;
      total += loss * (a.per_token ? t_b / step_tokens : 1.0L / (c.layout.dp * c.layout.ga));
    }
  }
  return total;
}

// The worst gradient element's effective value over the reference's: a bug that scales every router gradient by
// a factor shows it there exactly (up to float32 rounding).
double worst_grad_ratio(const RunResult& r) {
  const CheckResult& grad = testing::check_named(r, "grad");
  REQUIRE(grad.worst.has_value());
  return grad.worst->got / grad.worst->expected;
}

}  // namespace

TEST_CASE("router: the case names experts and layers, reads its settings from the table and refuses bad ones") {
  const Case c = testing::make_case(
      router_case({2, 1, 1, 1, true}, {{"score", "sigmoid"}, {"z_loss_coef", 0.001}, {"layers", 3}}));
  CHECK(c.resolved()["shape"]["experts"] == 8);
  CHECK(c.shape.vocab == 24);  // a row holds every layer's router logits
  CHECK(c.resolved()["loss"]["score"] == "sigmoid");
  CHECK(c.resolved()["loss"]["aux_coef"] == 0.01);
  CHECK(c.resolved()["loss"]["scaling"] == "default");
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, false}, {{"top_k", 8}})),
                       doctest::Contains("$.loss.top_k: must be below the experts (8), got 8"), CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, false}, {{"top_k", 0}})),
                       doctest::Contains("$.loss.top_k"), CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, false}, {{"aux_coef", -0.01}})),
                       doctest::Contains("$.loss.aux_coef"), CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, false}, {{"score", "tanh"}})),
                       doctest::Contains("$.loss.score"), CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, false}, {{"scaling", "per_layer"}})),
                       doctest::Contains("$.loss.scaling"), CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 1, 1, true})), doctest::Contains("$.layout.sp"),
                       CaseError);
  nlohmann::json one_expert = router_case({1, 1, 1, 1, false}, {{"top_k", 1}});
  one_expert["shape"]["experts"] = 1;
  CHECK_THROWS_WITH_AS(testing::make_case(one_expert), doctest::Contains("$.shape.experts: must be >= 2"), CaseError);
  nlohmann::json half = router_case({1, 1, 1, 1, false});
  half["inputs"]["dtype"] = "bf16";
  CHECK_THROWS_WITH_AS(testing::make_case(half), doctest::Contains("$.inputs.dtype"), CaseError);
  // Six sequences over 4 DP ranks x 2 micro-batches leave slots empty: the global counts' all-reduce could not meet.
  CHECK_THROWS_WITH_AS(testing::make_case(router_case({1, 1, 4, 2, false}, {{"global_aux_coef", 0.01}})),
                       doctest::Contains("the global aux loss needs every micro-batch of every DP rank"), CaseError);
  CHECK_THROWS_WITH_AS(
      testing::make_case(router_case({1, 1, 1, 1, false}, {{"pool_layers", true}, {"seq_aux_coef", 0.01}})),
      doctest::Contains("$.loss.pool_layers: pools the layers of the aux loss only"), CaseError);
}

TEST_CASE("router: the reference is the step's loss from the definition, and its gradient the finite differences") {
  struct Variant {
    std::string counts;
    int layers;
    bool per_token;
    std::string convention;  // "": top-k counts over k; "first": first choices; "no_k": not divided by k; "pooled":
                             // transformers' layers pooled into one aux loss, not divided by k (aux and z only)
  };
  for (const Variant& v : {Variant{"step", 1, false, ""}, Variant{"running", 2, false, "first"},
                           Variant{"step", 2, true, "no_k"}, Variant{"step", 3, false, "pooled"}}) {
    CAPTURE(v.counts);
    CAPTURE(v.layers);
    CAPTURE(v.per_token);
    CAPTURE(v.convention);
    const bool pooled = v.convention == "pooled";
    const Case c = testing::make_case(
        router_case({1, 1, 2, 2, false}, {{"z_loss_coef", 0.002},
                                          {"seq_aux_coef", pooled ? 0.0 : 0.003},
                                          {"global_aux_coef", pooled ? 0.0 : 0.005},
                                          {"global_counts", v.counts},
                                          {"layers", v.layers},
                                          {"counts", v.convention == "first" ? "first" : "top_k"},
                                          {"divide_by_k", v.convention.empty() || v.convention == "first"},
                                          {"pool_layers", pooled},
                                          {"scaling", v.per_token ? "per_token" : "default"}}));
    Coefficients a{0.01L, pooled ? 0.0L : 0.003L, 0.002L, pooled ? 0.0L : 0.005L, v.counts == "running", v.per_token};
    a.pooled = pooled;
    if (v.convention == "first") a.counted = 1;
    if (!v.convention.empty()) a.divisor = 1.0L;
    const InputSource inputs(c);
    const LossReference reference(c, inputs);
    const auto width = static_cast<std::size_t>(c.shape.vocab);
    LD logged = 0.0L;
    std::vector<double> logits(width), grad(width);
    int checked = 0;
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      if (!inputs.is_valid(t)) continue;
      std::vector<float> row(width);
      inputs.logits(t, 0, c.shape.vocab, row.data());
      for (std::size_t e = 0; e < width; ++e) logits[e] = row[e];
      const ReferenceToken r = reference.evaluate(t, logits, {}, grad);
      logged += static_cast<LD>(r.weight) * r.loss;
      if (t % 7 != 0) continue;
      for (std::size_t e = 0; e < width; ++e) {
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
  for (const Layout& l : std::vector<Layout>{{1, 1, 1, 1, false},
                                             {2, 1, 1, 1, false},
                                             {2, 1, 1, 1, true},
                                             {3, 2, 1, 2, true},
                                             {8, 1, 2, 1, true},
                                             {2, 2, 2, 2, false}}) {
    for (const std::string score : {"softmax", "sigmoid"}) {
      for (const std::string scaling : {"default", "per_token"}) {
        for (const bool pooled : {false, true}) {
          CAPTURE(l.tp);
          CAPTURE(l.cp);
          CAPTURE(l.dp);
          CAPTURE(l.ga);
          CAPTURE(l.sp);
          CAPTURE(score);
          CAPTURE(scaling);
          CAPTURE(pooled);
          const RunResult r =
              testing::run_with(testing::make_case(router_case(l, {{"score", score},
                                                                   {"z_loss_coef", 0.001},
                                                                   {"seq_aux_coef", pooled ? 0.0 : 0.004},
                                                                   {"layers", 2},
                                                                   {"pool_layers", pooled},
                                                                   {"counts", score == "sigmoid" ? "first" : "top_k"},
                                                                   {"divide_by_k", scaling == "default"},
                                                                   {"scaling", scaling}})),
                                "correct");
          CHECK(r.verdict == Verdict::pass);
          for (const char* check : {"loss", "grad", "counts", "stats"}) {
            CHECK(testing::check_named(r, check).verdict == Verdict::pass);
          }
        }
      }
    }
  }
}

// Each bug at a layout where MOE.md section 4 predicts it shows, and one where it cannot. `factor`: the ratio of
// every router gradient to the reference's that the bug predicts, checked at the worst element, where the bug
// scales the whole gradient (aux terms only, no z-loss); 0: not a uniform factor.
TEST_CASE("router: each catalogued bug shows the signal MOE.md predicts, where it can and nowhere else") {
  struct Expect {
    const char* bug;
    Layout layout;
    nlohmann::json loss;
    double ignore;
    bool fails, loss_fails;
    double factor;
  };
  const nlohmann::json per_token = {{"scaling", "per_token"}};
  const nlohmann::json z_only = {{"aux_coef", 0.0}, {"z_loss_coef", 0.001}};
  const nlohmann::json z_only_per_token = {{"aux_coef", 0.0}, {"z_loss_coef", 0.001}, {"scaling", "per_token"}};
  const nlohmann::json global_running = {{"global_aux_coef", 0.01}, {"global_counts", "running"}};
  const std::vector<Expect> expectations = {
      {"moe-aux-local-counts", {2, 1, 1, 1, true}, {}, 0.15, true, true, 0.0},     // the scope spans TP under SP
      {"moe-aux-local-counts", {1, 2, 1, 1, false}, {}, 0.15, true, true, 0.0},    // and CP
      {"moe-aux-local-counts", {2, 1, 2, 2, false}, {}, 0.15, false, false, 0.0},  // replicated TP: its own scope
      {"moe-aux-topk-squared", {1, 1, 1, 1, false}, {}, 0.15, true, true, 0.5},    // / k, k = 2
      {"moe-aux-tp-sum", {2, 1, 1, 1, true}, {}, 0.15, true, false, 2.0},
      {"moe-aux-tp-sum", {2, 1, 1, 1, false}, {}, 0.15, false, false, 0.0},
      {"moe-aux-cp-missing", {1, 2, 1, 1, false}, {}, 0.15, true, false, 0.5},
      {"moe-aux-cp-missing", {2, 1, 2, 1, true}, {}, 0.15, false, false, 0.0},
      {"moe-aux-padding-counted", {1, 1, 1, 1, false}, {}, 0.15, true, true, 0.0},   // padded positions
      {"moe-aux-padding-counted", {1, 1, 2, 1, false}, {}, 0.0, false, false, 0.0},  // none
      {"moe-aux-no-grad", {2, 1, 1, 2, true}, {}, 0.15, true, false, 0.0},
      {"moe-aux-log-doubled", {2, 2, 1, 1, true}, {}, 0.15, true, false, 0.0},
      {"moe-aux-ga-overweight", {1, 2, 1, 2, false}, {}, 0.15, true, false, 2.0},
      {"moe-aux-ga-overweight", {1, 2, 2, 1, false}, {}, 0.15, true, false, 2.0},              // x DP
      {"moe-aux-ga-overweight", {2, 2, 1, 1, true}, {}, 0.15, false, false, 0.0},              // dp 1, ga 1: x 1
      {"moe-aux-per-token-divided", {1, 1, 2, 1, false}, per_token, 0.15, true, false, -1.0},  // / N
      {"moe-aux-per-token-divided", {1, 1, 2, 1, false}, {}, 0.15, false, false, 0.0},
      {"moe-aux-per-token-tp-cp", {2, 2, 1, 1, true}, per_token, 0.15, true, false, 0.25},
      {"moe-aux-per-token-tp-cp", {1, 1, 2, 2, false}, per_token, 0.15, false, false, 0.0},
      {"moe-seq-aux-mbs",
       {1, 1, 1, 2, false},
       {{"scaling", "per_token"}, {"seq_aux_coef", 0.01}},
       0.15,
       true,
       false,
       0.0},
      {"moe-seq-aux-mbs", {1, 1, 1, 2, false}, {{"seq_aux_coef", 0.01}}, 0.15, false, false, 0.0},
      {"moe-aux-count-not-returned", {1, 2, 1, 1, false}, per_token, 0.15, true, false, -2.0},  // x N
      {"moe-aux-count-not-returned", {2, 1, 1, 1, true}, per_token, 0.15, false, false, 0.0},   // cp 1
      {"moe-aux-global-topk", {1, 1, 1, 1, false}, {{"top_k", 3}}, 0.15, true, true, 0.0},
      {"moe-aux-global-topk", {2, 2, 1, 1, true}, {}, 0.15, false, false, 0.0},                   // the router's k is 2
      {"moe-aux-per-token-rank-count", {1, 2, 1, 1, false}, per_token, 0.15, true, false, 0.0},   // uneven CP ranks
      {"moe-aux-per-token-rank-count", {2, 1, 1, 1, false}, per_token, 0.15, false, false, 0.0},  // one rank a scope
      // The findings of docs/frameworks.md's router section (Megatron-LM d98e8a64).
      {"moe-zloss-rank-mean", {1, 2, 1, 1, false}, z_only, 0.15, true, true, 0.0},                   // uneven CP ranks
      {"moe-zloss-rank-mean", {2, 1, 1, 1, false}, z_only, 0.15, false, false, 0.0},                 // one rank a scope
      {"moe-zloss-rank-mean", {1, 2, 1, 1, false}, z_only_per_token, 0.15, false, false, 0.0},       // right per token
      {"moe-aux-per-token-reduced-count", {1, 2, 1, 1, false}, per_token, 0.15, true, false, 2.0},   // x CP
      {"moe-aux-per-token-reduced-count", {2, 2, 1, 1, true}, per_token, 0.15, true, false, 4.0},    // x TP CP
      {"moe-aux-per-token-reduced-count", {2, 1, 2, 1, false}, per_token, 0.15, false, false, 0.0},  // one rank
      {"moe-seq-aux-mean-length", {1, 1, 1, 1, false}, {{"seq_aux_coef", 0.01}}, 0.15, true, true, 0.0},
      {"moe-seq-aux-mean-length", {1, 2, 1, 1, false}, {}, 0.15, false, false, 0.0},  // no sequence aux loss
      {"moe-global-aux-mean-counts", {1, 1, 1, 2, false}, global_running, 0.15, true, true, 0.0},
      {"moe-global-aux-mean-counts", {1, 1, 2, 1, false}, global_running, 0.15, false, false, 0.0},  // ga 1
      {"moe-global-aux-batch-tokens", {1, 1, 2, 1, false}, global_running, 0.15, true, true, 0.0},
      {"moe-global-aux-batch-tokens", {1, 2, 1, 2, false}, global_running, 0.15, false, false, 0.0},  // dp 1
      // The findings of DeepSpeed-MoE and verl (docs/frameworks.md).
      {"moe-aux-mask-ignored", {1, 1, 1, 1, false}, {}, 0.15, true, true, 0.0},   // masked rows
      {"moe-aux-mask-ignored", {1, 1, 2, 1, false}, {}, 0.0, false, false, 0.0},  // none
      {"moe-aux-mask-counts-only", {1, 1, 1, 1, false}, {}, 0.15, true, true, 0.0},
      {"moe-aux-mask-counts-only", {1, 1, 2, 1, false}, {}, 0.0, false, false, 0.0},
      {"moe-aux-ga-double-divide", {1, 2, 1, 2, false}, {}, 0.15, true, false, 0.5},   // / GA
      {"moe-aux-ga-double-divide", {1, 2, 2, 1, false}, {}, 0.15, false, false, 0.0},  // one micro-batch
      {"moe-seq-aux-packed", {1, 1, 1, 1, false}, {{"seq_aux_coef", 0.01}}, 0.15, true, true, 0.0},
      {"moe-seq-aux-packed", {1, 2, 1, 1, false}, {}, 0.15, false, false, 0.0},        // no sequence aux loss
      {"moe-aux-loss-dp-ga-summed", {1, 1, 2, 2, false}, {}, 0.15, true, true, 4.0},   // x DP GA
      {"moe-aux-loss-dp-ga-summed", {2, 2, 1, 1, true}, {}, 0.15, false, false, 0.0},  // dp 1, ga 1
  };
  for (const Expect& x : expectations) {
    const std::string bug_name = x.bug;
    CAPTURE(bug_name);
    CAPTURE(x.layout.tp);
    CAPTURE(x.layout.cp);
    CAPTURE(x.layout.sp);
    CAPTURE(x.loss.dump());
    REQUIRE(find_implementation(x.bug) != nullptr);
    // Sequences of even length where nothing may be padding (the CP split pads each to a multiple of 2 CP).
    const std::vector<std::int64_t> lengths =
        x.ignore == 0.0 ? std::vector<std::int64_t>{10, 6, 8, 14, 4, 8} : std::vector<std::int64_t>{11, 6, 9, 14, 5, 7};
    nlohmann::json loss = x.loss.is_null() ? nlohmann::json::object() : x.loss;
    const Case c = testing::make_case(router_case(x.layout, loss, x.ignore, lengths));
    const RunResult r = testing::run_with(c, x.bug);
    CHECK((r.verdict == Verdict::fail) == x.fails);
    CHECK((testing::check_named(r, "loss").verdict == Verdict::fail) == x.loss_fails);
    const auto n = static_cast<double>(InputSource(c).valid_tokens());
    const double factor = x.factor == -1.0 ? 1.0 / n : x.factor == -2.0 ? n : x.factor;
    if (factor > 0.0) CHECK(worst_grad_ratio(r) == doctest::Approx(factor).epsilon(1e-4));
  }
}

TEST_CASE("router: a failing run's bundle replays bit for bit, and shrink keeps it failing on fewer experts") {
  const Case c = testing::make_case(router_case({2, 2, 1, 2, true}, {{"scaling", "per_token"}, {"layers", 2}}));
  const RunResult original = testing::run_with(c, "moe-aux-per-token-rank-count");
  REQUIRE(original.verdict == Verdict::fail);
  const Bundle bundle = parse_bundle(nlohmann::json::parse(make_bundle(original, BundleContext{}).dump()), "b.json");
  CHECK(input_drift(bundle).empty());
  const RunResult replayed = testing::run_with(bundle.the_case, bundle.implementation);
  REQUIRE(replayed.checks.size() == original.checks.size());
  for (std::size_t i = 0; i < original.checks.size(); ++i)
    CHECK(replayed.checks[i].margin == original.checks[i].margin);

  ShrinkOptions options;
  options.implementation = "moe-aux-per-token-rank-count";
  options.threads = 2;
  const ShrinkResult shrunk = shrink_case(c, options);
  CHECK(shrunk.check == "grad");
  CHECK(shrunk.minimized["shape"].contains("experts"));
  CHECK(shrunk.after.logits() < shrunk.before.logits());
  CHECK(testing::check_named(testing::run_with(shrunk.minimized_case, options.implementation), "grad").verdict ==
        Verdict::fail);
  CHECK(testing::run_with(shrunk.minimized_case, "correct").verdict == Verdict::pass);
}

TEST_CASE("router: generated logits keep any two experts of a layer apart, so every token routes one way") {
  nlohmann::json doc = router_case({1, 1, 1, 1, false}, {{"top_k", 8}, {"layers", 2}}, 0.0, {4096});
  doc["shape"]["experts"] = 256;
  const Case c = testing::make_case(doc);
  CHECK(c.resolved()["inputs"]["distribution"] == "separated");  // the kind's default
  const InputSource inputs(c);
  const double scale = c.inputs.scale;
  std::vector<float> row(static_cast<std::size_t>(c.shape.vocab));
  double smallest = 1.0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    inputs.logits(t, 0, c.shape.vocab, row.data());
    for (std::size_t l = 0; l < 2; ++l) {
      std::vector<float> block(row.begin() + static_cast<std::ptrdiff_t>(l * 256),
                               row.begin() + static_cast<std::ptrdiff_t>((l + 1) * 256));
      std::sort(block.begin(), block.end());
      for (std::size_t e = 1; e < block.size(); ++e) {
        smallest = std::min(smallest, static_cast<double>(block[e]) - static_cast<double>(block[e - 1]));
      }
    }
  }
  // scale / 32768 before the float32 rounding of values below 16 in magnitude (at most 2^-20 each)
  CHECK(smallest >= scale / 32768.0 - 0x1p-19);
  CHECK_NOTHROW(LossReference(c, inputs));
  // A normal draw of the same size has tokens whose 8th and 9th scores tie within 1e-6: the reference says which.
  doc["inputs"]["distribution"] = "normal";
  doc["shape"]["tokens"] = 65536;
  doc["batch"]["sequence_lengths"] = {65536};
  const Case normal = testing::make_case(doc);
  const InputSource normal_inputs(normal);
  CHECK_THROWS_WITH_AS(LossReference(normal, normal_inputs), doctest::Contains("tie within float32 rounding"),
                       CaseError);
}

TEST_CASE("router: a user's tie tokens widen the scope's tolerances by MOE.md's bound, and are counted") {
  // One scope, one layer, aux only: tokens 3 and 17 are a user's rows whose 2nd and 3rd logits lie 4 float32 units
  // apart, so a float32 router may route either; tokens 5 and 9 are exact ties (the reference routes the lower index).
  nlohmann::json doc = router_case({1, 1, 1, 1, false}, nlohmann::json::object(), 0.1, {40});
  const std::vector<double> near = {2.0, 1.0, 1.0 + 4.8e-7, 0.5, -0.25, 0.125, -1.0, 0.0};
  const std::vector<double> exact = {0.5, 1.5, -0.5, 1.5, 0.25, -1.0, 0.75, 1.5 + 4e-7};
  doc["inputs"]["overrides"] = {{{"token", 3}, {"logits", near}},
                                {{"token", 17}, {"logits", near}},
                                {{"token", 5}, {"logits", exact}},
                                {{"token", 9}, {"logits", exact}}};
  doc["inputs"]["ignore_fraction"] = 0.0;
  const Case c = testing::make_case(doc);
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  CHECK(reference.row().either_way_tokens() == 4);
  CHECK(reference.row().has_gradient_slack());
  // The definitions' counts, then every way the four ties may be routed: each moves one count from its 2nd expert
  // to its 3rd. Every token's loss and gradient under each stays within the reference's bound of them.
  const auto experts = static_cast<std::size_t>(c.shape.vocab);
  std::vector<std::vector<double>> rows;
  std::vector<double> counts(experts, 0.0), s(experts);
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
    std::vector<float> raw(experts);
    inputs.logits(t, 0, c.shape.vocab, raw.data());
    rows.emplace_back(raw.begin(), raw.end());
    router::scores(router::Score::softmax, rows.back(), s);
    for (int e : router::top_k(s, 2).experts) counts[static_cast<std::size_t>(e)] += 1.0;
  }
  const double a = 0.01 * static_cast<double>(experts) / (2.0 * 40.0 * 40.0);
  const std::pair<std::int64_t, std::pair<int, int>> ties[] = {{3, {2, 1}}, {17, {2, 1}}, {5, {1, 3}}, {9, {1, 3}}};
  double widest = 0.0;
  for (int flips = 1; flips < 16; ++flips) {
    std::vector<double> moved = counts;
    for (int j = 0; j < 4; ++j) {
      if ((flips >> j & 1) == 0) continue;
      moved[static_cast<std::size_t>(ties[j].second.first)] -= 1.0;
      moved[static_cast<std::size_t>(ties[j].second.second)] += 1.0;
    }
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      CAPTURE(t);
      std::vector<double> expected(experts), slack(experts), other(experts);
      const ReferenceToken r = reference.evaluate(t, rows[static_cast<std::size_t>(t)], {}, expected);
      reference.row().gradient_slack(t, r.weight, rows[static_cast<std::size_t>(t)], slack);
      router::aux_gradient(router::Score::softmax, rows[static_cast<std::size_t>(t)], moved, a, other);
      router::scores(router::Score::softmax, rows[static_cast<std::size_t>(t)], s);
      double loss = 0.0;
      for (std::size_t e = 0; e < experts; ++e) {
        CHECK(std::fabs(r.weight * other[e] - expected[e]) <= slack[e] * (1.0 + 1e-12) + 1e-18);
        widest = std::max(widest, std::fabs(r.weight * other[e] - expected[e]) / slack[e]);
        loss += a * moved[e] * s[e];
      }
      const RowStats none;
      CHECK(std::fabs(loss - r.loss) <= reference.row().token_loss_arithmetic(t, none).either_way * (1.0 + 1e-12));
    }
  }
  CHECK(widest > 0.5);  // the bound is reached within a factor of two: not a blanket widening
  // End to end: the correct implementation passes with the ties counted; a bug is still caught around them.
  const RunResult correct = testing::run_with(c, "correct");
  CHECK(correct.verdict == Verdict::pass);
  CHECK(testing::check_named(correct, "grad").metrics["either_way_tokens"] == 4);
  CHECK(testing::run_with(c, "moe-aux-topk-squared").verdict == Verdict::fail);
}

TEST_CASE("router: the routed map (groups and expert bias) is a convention the reference and the checks see") {
  const Case routed = load_case_file(std::string(LOSSVERIFY_SOURCE_DIR) + "/cases/moe-routed-groups-bias.json", {});
  nlohmann::json plain_doc = routed.resolved();
  plain_doc["loss"]["map"] = "top_k";
  const Case plain = testing::make_case(plain_doc);
  const InputSource inputs(routed);
  // The share of valid (token, layer) maps the groups and the bias move, from the definitions.
  const RouterOptions& o = router_options(routed.loss);
  const auto experts = static_cast<std::size_t>(routed.shape.vocab / o.layers);
  std::vector<float> raw(static_cast<std::size_t>(routed.shape.vocab));
  std::vector<double> z(experts), s(experts), keys(experts), magnitude(experts);
  int moved = 0, maps = 0;
  for (std::int64_t t = 0; t < routed.shape.tokens; ++t) {
    if (!inputs.is_valid(t)) continue;
    inputs.logits(t, 0, routed.shape.vocab, raw.data());
    for (std::size_t l = 0; l < static_cast<std::size_t>(o.layers); ++l) {
      for (std::size_t e = 0; e < experts; ++e) z[e] = raw[l * experts + e];
      router::scores(router::Score::sigmoid, z, s);
      router::routing_scores(router::Score::sigmoid, z, keys);
      for (std::size_t e = 0; e < experts; ++e) {
        const double b = router::expert_bias(o.expert_bias, static_cast<std::int64_t>(l), static_cast<std::int64_t>(e),
                                             static_cast<std::int64_t>(experts));
        magnitude[e] = keys[e] + std::fabs(b);
        keys[e] += b;
      }
      std::vector<int> a = router::top_k(s, o.top_k).experts;
      std::vector<int> b = router::routed_top_k(keys, magnitude, {o.top_k, o.groups, o.top_groups}, o.top_k).experts;
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      moved += a != b ? 1 : 0;
      ++maps;
    }
  }
  const double share = static_cast<double>(moved) / maps;
  MESSAGE("maps moved by the groups and the bias: " << moved << " of " << maps);
  CHECK(share > 0.2);
  CHECK(share < 0.8);
  // The two conventions' references differ in the counts, the loss and the gradient.
  const LossReference with_routed(routed, inputs);
  const InputSource plain_inputs(plain);
  const LossReference with_plain(plain, plain_inputs);
  const std::size_t width = static_cast<std::size_t>(routed.shape.vocab);
  std::vector<double> a(width), b(width), slack(width);
  with_routed.row().scope_values(0, 0, a, slack);
  with_plain.row().scope_values(0, 0, b, slack);
  CHECK(a != b);
  CHECK(std::accumulate(a.begin(), a.end(), 0.0) ==
        std::accumulate(b.begin(), b.end(), 0.0));  // k per token either way
  // Both pass their own case; a token whose group selection ties is refused, since every count may move.
  CHECK(testing::run_with(routed, "correct").verdict == Verdict::pass);
  CHECK(testing::run_with(plain, "correct").verdict == Verdict::pass);
  nlohmann::json tie_doc = routed.resolved();
  std::vector<double> row(width, -4.0);  // layer 0: groups 0 and 1 score alike, all the others far below
  row[0] = 2.0;
  row[1] = 1.0;
  row[4] = 1.0;
  row[5] = 2.0;
  tie_doc["inputs"]["overrides"] = {{{"token", 0}, {"logits", row}}};
  tie_doc["loss"]["top_groups"] = 1;
  tie_doc["loss"]["expert_bias"] = 0.0;
  tie_doc["inputs"]["ignore_fraction"] = 0.0;
  const Case tie = testing::make_case(tie_doc);
  const InputSource tie_inputs(tie);
  CHECK_THROWS_WITH_AS(LossReference(tie, tie_inputs), doctest::Contains("expert groups of layer 0"), CaseError);
}

}  // namespace lossverify
