// The LM head stage (kinds/lm_head/, docs/spec.md §11): its settings, its float64 reference against long-double
// finite differences of the step's loss through the head, its error model against long-double sums at chunk counts
// 1, 4 and 16, and each catalogued bug's signal.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/memory_estimate.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

using LD = long double;

nlohmann::json head_case(int tp, const std::string& dtype, nlohmann::json stage = nlohmann::json::object()) {
  stage["kind"] = "lm_head";
  if (!stage.contains("hidden")) stage["hidden"] = 12;
  return {{"name", "head"},
          {"shape", {{"vocab", 40}}},
          {"batch", {{"sequence_lengths", {7, 5, 9}}}},
          {"loss", {{"label_smoothing", 0.1}}},
          {"stage", stage},
          {"inputs", {{"seed", 3}, {"dtype", dtype}, {"scale", 2.0}, {"ignore_fraction", 0.1}}},
          {"layout", {{"tp", tp}}},
          {"timeout_seconds", 60.0}};
}

// The step's loss (mean over valid tokens, PyTorch smoothing a) from h, W in long double: the definitions alone.
LD step_loss(const InputSource& inputs, const Case& c, const std::vector<LD>& h, const std::vector<LD>& w, int hidden) {
  const std::int64_t n = c.shape.tokens, v = c.shape.vocab;
  const LD a = 0.1L;
  LD total = 0.0L;
  std::int64_t valid = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    if (!inputs.is_valid(t)) continue;
    ++valid;
    std::vector<LD> u(static_cast<std::size_t>(v), 0.0L);
    for (std::int64_t j = 0; j < v; ++j) {
      for (int k = 0; k < hidden; ++k)
        u[static_cast<std::size_t>(j)] +=
            h[static_cast<std::size_t>(t * hidden + k)] * w[static_cast<std::size_t>(j * hidden + k)];
    }
    const LD m = *std::max_element(u.begin(), u.end());
    LD s = 0.0L, mean = 0.0L;
    for (const LD x : u) s += std::exp(x - m), mean += x;
    const LD lse = m + std::log(s);
    const LD label = u[static_cast<std::size_t>(inputs.label(t))];
    total += lse - (1.0L - a) * label - a * mean / static_cast<LD>(v);
  }
  return total / static_cast<LD>(valid);
}

}  // namespace

TEST_CASE("lm_head: the case's stage section carries its settings, and bad ones are refused naming the field") {
  const Case c = testing::make_case(head_case(2, "bf16", {{"hidden", 24}, {"dh_reduce", "framework"}}));
  REQUIRE(c.loss.stage != nullptr);
  const nlohmann::json resolved = c.resolved()["stage"];
  CHECK(resolved["kind"] == "lm_head");
  CHECK(resolved["hidden"] == 24);
  CHECK(resolved["dh_reduce"] == "framework");
  CHECK(resolved["bias"] == false);
  CHECK(testing::make_case(c.resolved()).resolved() == c.resolved());  // a resolved case reads back to itself
  CHECK_THROWS_WITH_AS(testing::make_case(head_case(1, "fp32", {{"hidden", 0}})), doctest::Contains("$.stage.hidden"),
                       CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(head_case(1, "fp32", {{"dh_reduce", "both"}})),
                       doctest::Contains("$.stage.dh_reduce"), CaseError);
  CHECK_THROWS_WITH_AS(testing::make_case(head_case(1, "fp32", {{"hiden", 8}})), doctest::Contains("hiden"), CaseError);
  nlohmann::json router = head_case(1, "fp32");
  router["loss"] = {{"kind", "router"}};
  router["shape"] = {{"experts", 40}};
  CHECK_THROWS_WITH_AS(testing::make_case(router), doctest::Contains("$.stage.kind"), CaseError);
  nlohmann::json same = head_case(1, "fp32");
  same["loss"] = {{"kind", "kd"}};
  same["inputs"]["teacher"] = {{"same_as_student", true}};
  CHECK_THROWS_WITH_AS(testing::make_case(same), doctest::Contains("same_as_student"), CaseError);
}

TEST_CASE("lm_head: the memory estimate counts the head's float64 reference on every rank, before any work") {
  const Case c = testing::make_case(head_case(2, "fp32", {{"hidden", 16}}));
  const double n = static_cast<double>(c.shape.tokens), v = static_cast<double>(c.shape.vocab);
  const double per_rank = 8.0 * (2.0 * n * v + (n + v) * 16.0 + v + n);
  CHECK(static_cast<double>(estimate_memory(c, false).stage) == 2.0 * per_rank);
  nlohmann::json big = head_case(1, "fp32");
  big["shape"] = {{"tokens", 4000000}, {"vocab", 128256}};
  big.erase("batch");
  CHECK_THROWS_WITH_AS(require_memory(testing::make_case(big), false),
                       doctest::Contains("of the stage's float64 reference on every rank"), CaseError);
}

TEST_CASE("lm_head: dh is the finite difference of the step's loss in long double, dW and db the sums of its rows") {
  // tp = 1, float32: the oracle's dh of token t is d L / d h_t, taken here by central differences of a long-double
  // evaluation of the loss from h and W alone.
  const Case c = testing::make_case(head_case(1, "fp32"));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const StageReference& stage = *reference.stage();
  const int hidden = 12;
  const std::int64_t n = c.shape.tokens, v = c.shape.vocab;
  std::vector<double> row(static_cast<std::size_t>(hidden));
  std::vector<LD> h(static_cast<std::size_t>(n * hidden)), w(static_cast<std::size_t>(v * hidden));
  const double w_scale = c.inputs.scale / std::sqrt(static_cast<double>(hidden));
  for (std::int64_t t = 0; t < n; ++t) {
    inputs.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(t), 0, hidden, 1.0, row.data());
    std::copy(row.begin(), row.end(), h.begin() + t * hidden);
  }
  for (std::int64_t j = 0; j < v; ++j) {
    inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(j), 0, hidden, w_scale, row.data());
    std::copy(row.begin(), row.end(), w.begin() + j * hidden);
  }
  // the stage's logits are h W^T
  std::vector<double> u(static_cast<std::size_t>(v));
  stage.logits(4, 0, v, u.data());
  LD direct = 0.0L;
  for (int k = 0; k < hidden; ++k)
    direct += h[static_cast<std::size_t>(4 * hidden + k)] * w[static_cast<std::size_t>(7 * hidden + k)];
  CHECK(std::fabs(static_cast<double>(direct) - u[7]) <= 1e-13 * std::fabs(u[7]) + 1e-15);
  for (const std::int64_t t : {0, 6, 13}) {
    if (!inputs.is_valid(t)) continue;
    CAPTURE(t);
    // the kind's reference gradient of the whole row, then the stage's dh
    std::vector<double> logits(static_cast<std::size_t>(v)), grad(static_cast<std::size_t>(v));
    stage.logits(t, 0, v, logits.data());
    ReferenceToken r = reference.evaluate(t, logits, {}, grad);
    std::vector<double> error(static_cast<std::size_t>(v), 0.0), dh(static_cast<std::size_t>(hidden)),
        bound(static_cast<std::size_t>(hidden), 0.0);
    stage.input_gradient(0, t, VocabRange{0, v}, grad, error, dh, bound);
    for (int k = 0; k < hidden; k += 5) {
      const LD step = 1e-6L;
      std::vector<LD> up = h, down = h;
      up[static_cast<std::size_t>(t * hidden + k)] += step;
      down[static_cast<std::size_t>(t * hidden + k)] -= step;
      const LD fd = (step_loss(inputs, c, up, w, hidden) - step_loss(inputs, c, down, w, hidden)) / (2.0L * step);
      CHECK(std::fabs(static_cast<double>(fd) - dh[static_cast<std::size_t>(k)]) <=
            1e-7 * std::fabs(dh[static_cast<std::size_t>(k)]) + 1e-9);
    }
    (void)r;
  }
}

TEST_CASE("lm_head: the error model bounds float32 chunked sums of 16-bit products at chunk counts 1, 4 and 16") {
  // dW_vk = sum_t g_tv h_tk over 384 tokens: bf16 g and h, products accumulated in float32 chunk by chunk as the head
  // does, against the long-double sum. The model's bound, gamma_N sum |g h|, holds at every chunk count (a worst case:
  // the largest error on random data is about a thousandth of it). Accumulating in bf16 across chunks exceeds it.
  std::mt19937_64 random(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int tokens = 384, elements = 64;
  const DType d = DType::bf16;
  const double gamma = tokens * 0x1p-24 / (1.0 - tokens * 0x1p-24);
  for (const int chunks : {1, 4, 16}) {
    CAPTURE(chunks);
    double worst = 0.0, worst_narrow = 0.0;
    for (int e = 0; e < elements; ++e) {
      std::vector<double> g(tokens), h(tokens);
      for (int t = 0; t < tokens; ++t) {
        g[static_cast<std::size_t>(t)] = round_to_dtype(1e-3 * normal(random), d);
        h[static_cast<std::size_t>(t)] = round_to_dtype(normal(random), d);
      }
      LD exact = 0.0L, magnitude = 0.0L;
      float accumulator = 0.0f, narrow = 0.0f;
      for (int c = 0; c < chunks; ++c) {
        float part = 0.0f;
        for (int t = tokens * c / chunks; t < tokens * (c + 1) / chunks; ++t) {
          part +=
              static_cast<float>(g[static_cast<std::size_t>(t)]) * static_cast<float>(h[static_cast<std::size_t>(t)]);
          exact += static_cast<LD>(g[static_cast<std::size_t>(t)]) * h[static_cast<std::size_t>(t)];
          magnitude += std::fabs(static_cast<LD>(g[static_cast<std::size_t>(t)]) * h[static_cast<std::size_t>(t)]);
        }
        accumulator += part;
        narrow = static_cast<float>(round_to_dtype(static_cast<double>(narrow + part), d));
      }
      const double bound = gamma * static_cast<double>(magnitude);
      const double error = std::fabs(static_cast<double>(static_cast<LD>(accumulator) - exact));
      CHECK(error <= bound);
      worst = std::max(worst, error / bound);
      worst_narrow = std::max(worst_narrow, std::fabs(static_cast<double>(static_cast<LD>(narrow) - exact)) / bound);
    }
    MESSAGE("chunks " << chunks << ": largest float32 error / bound " << worst << ", bf16 accumulator "
                      << worst_narrow);
    // A worst-case bound: random data reach about a thousandth of it (0.5e-3 to 1.5e-3 here), not less by further
    // orders of magnitude; a bf16 accumulator exceeds it 20 to 60 times.
    CHECK(worst > 1e-4);
    if (chunks > 1) CHECK(worst_narrow > 1.0);
  }
}

TEST_CASE("lm_head: the correct head passes at chunk counts 1, 4 and 16, its logits' gradient internal") {
  for (const int chunks : {1, 4, 16}) {
    for (const std::string dtype : {"fp32", "bf16"}) {
      CAPTURE(chunks);
      CAPTURE(dtype);
      const RunResult r = testing::run_with(testing::make_case(head_case(2, dtype, {{"chunks", chunks}})), "correct");
      CHECK(r.verdict == Verdict::pass);
      for (const char* check : {"loss", "dh", "dW"}) CHECK(testing::check_named(r, check).verdict == Verdict::pass);
      CHECK(testing::check_named(r, "grad").verdict == Verdict::not_applicable);
      CHECK(testing::check_named(r, "grad").summary.find("internal") != std::string::npos);
      CHECK(testing::check_named(r, "db").verdict == Verdict::not_applicable);  // no bias
    }
  }
}

TEST_CASE("lm_head: KD behind the head passes at every layout, and its own bugs show through dh and dW") {
  nlohmann::json kd = head_case(2, "bf16", {{"chunks", 4}});
  kd["loss"] = {{"kind", "kd"}, {"temperature", 2.0}};
  for (const auto& [tp, cp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 2}}) {
    CAPTURE(tp);
    kd["layout"] = {{"tp", tp}, {"cp", cp}};
    const Case c = testing::make_case(kd);
    CHECK(testing::run_with(c, "correct").verdict == Verdict::pass);
    const RunResult no_t2 = testing::run_with(c, "kd-no-t2");
    CHECK(testing::check_named(no_t2, "dh").verdict == Verdict::fail);
    CHECK(testing::check_named(no_t2, "dW").verdict == Verdict::fail);
  }
}

TEST_CASE("lm_head: each catalogued bug shows the signal its entry predicts, where it can and nowhere else") {
  // head-dh-double-reduce under the head's contract returns TP times dh; head-dh-shard-partial shows only at tp > 1
  // under the head's contract; head-grad-output-first needs unequal upstream weights; head-bias-repeated a bias.
  const Case tp2 = testing::make_case(head_case(2, "fp32"));
  const RunResult doubled = testing::run_with(tp2, "head-dh-double-reduce");
  const CheckResult& dh = testing::check_named(doubled, "dh");
  REQUIRE(dh.worst.has_value());
  CHECK(dh.worst->got == doctest::Approx(2.0 * dh.worst->expected).epsilon(1e-4));
  CHECK(testing::check_named(testing::run_with(tp2, "head-dh-shard-partial"), "dh").verdict == Verdict::fail);
  CHECK(testing::run_with(testing::make_case(head_case(1, "fp32")), "head-dh-shard-partial").verdict == Verdict::pass);
  CHECK(
      testing::run_with(testing::make_case(head_case(2, "fp32", {{"dh_reduce", "framework"}})), "head-dh-shard-partial")
          .verdict == Verdict::pass);
  CHECK(testing::run_with(tp2, "head-grad-output-first").verdict == Verdict::pass);  // mean: every weight equal
  nlohmann::json upstream = head_case(2, "fp32", {{"bias", true}});
  upstream["loss"] = {{"reduction", "none"},
                      {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.5}, {"high", 2.0}}}};
  const RunResult first = testing::run_with(testing::make_case(upstream), "head-grad-output-first");
  CHECK(testing::check_named(first, "dW").verdict == Verdict::fail);
  CHECK(testing::check_named(first, "db").verdict == Verdict::fail);
  CHECK(testing::check_named(first, "dh").verdict == Verdict::pass);
  CHECK(testing::check_named(first, "loss").verdict == Verdict::pass);
  CHECK(testing::run_with(tp2, "head-bias-repeated").verdict == Verdict::pass);  // no bias: nothing to repeat
  const RunResult repeated =
      testing::run_with(testing::make_case(head_case(2, "fp32", {{"bias", true}})), "head-bias-repeated");
  CHECK(testing::check_named(repeated, "loss").verdict == Verdict::fail);
  CHECK(testing::check_named(repeated, "dh").verdict == Verdict::fail);
  CHECK(testing::run_with(testing::make_case(head_case(2, "fp32", {{"chunks", 16}})), "head-dw-16bit-accumulate")
            .verdict == Verdict::pass);  // float32: the accumulator's dtype is float32
  // The settings a fused path drops: they show where the case has them, and nowhere else.
  const RunResult unsmoothed = testing::run_with(tp2, "head-smoothing-dropped");
  for (const char* check : {"loss", "dh", "dW"})
    CHECK(testing::check_named(unsmoothed, check).verdict == Verdict::fail);
  nlohmann::json plain = head_case(2, "fp32");
  plain["loss"] = nlohmann::json::object();
  CHECK(testing::run_with(testing::make_case(plain), "head-smoothing-dropped").verdict == Verdict::pass);
  CHECK(testing::run_with(tp2, "head-softcap-dropped").verdict == Verdict::pass);
  nlohmann::json capped = head_case(2, "fp32");
  capped["loss"]["softcap"] = 5.0;
  const RunResult uncapped = testing::run_with(testing::make_case(capped), "head-softcap-dropped");
  for (const char* check : {"loss", "dh", "dW"}) CHECK(testing::check_named(uncapped, check).verdict == Verdict::fail);
}

TEST_CASE("lm_head: under sequence parallelism each TP rank reports dh of its own token shard, summed over TP") {
  // The same case without sp: every TP rank reports dh of every row, so the dh check compares TP times as many
  // elements; under sp each row's dh is reported once, by the TP rank whose shard holds it.
  for (const auto& [tp, cp, ga] : std::vector<std::tuple<int, int, int>>{{2, 1, 1}, {4, 2, 2}, {3, 1, 2}}) {
    CAPTURE(tp);
    CAPTURE(cp);
    nlohmann::json j = head_case(tp, "bf16", {{"chunks", 4}});
    j["layout"] = {{"tp", tp}, {"cp", cp}, {"ga", ga}, {"sp", true}};
    const Case sp = testing::make_case(j);
    const RunResult sharded = testing::run_with(sp, "correct");
    CHECK(sharded.verdict == Verdict::pass);
    j["layout"]["sp"] = false;
    const RunResult replicated = testing::run_with(testing::make_case(j), "correct");
    CHECK(replicated.verdict == Verdict::pass);
    const auto compared = [](const RunResult& r, const char* check) {
      return testing::check_named(r, check).metrics.at("compared").get<std::int64_t>();
    };
    CHECK(compared(sharded, "dh") * tp == compared(replicated, "dh"));
    CHECK(compared(sharded, "dW") == compared(replicated, "dW"));  // dW_r covers the gathered rows either way
    // the dh reduction bugs: a shard's dh never summed (a scatter in place of the reduce-scatter), or summed twice
    const RunResult partial = testing::run_with(sp, "head-dh-shard-partial");
    CHECK(testing::check_named(partial, "dh").verdict == Verdict::fail);
    CHECK(testing::check_named(partial, "dW").verdict == Verdict::pass);
    CHECK(testing::check_named(partial, "loss").verdict == Verdict::pass);
    const CheckResult& doubled = testing::check_named(testing::run_with(sp, "head-dh-double-reduce"), "dh");
    CHECK(doubled.verdict == Verdict::fail);
    REQUIRE(doubled.worst.has_value());
    CHECK(doubled.worst->got == doctest::Approx(tp * doubled.worst->expected).epsilon(2e-2));
  }
}

TEST_CASE(
    "lm_head: under sequence parallelism with the framework's contract a rank returns every gathered row's partial") {
  nlohmann::json j = head_case(2, "fp32", {{"dh_reduce", "framework"}});
  j["layout"] = {{"tp", 2}, {"sp", true}};
  const Case c = testing::make_case(j);
  const RunResult correct = testing::run_with(c, "correct");
  CHECK(correct.verdict == Verdict::pass);
  j["layout"]["sp"] = false;
  CHECK(testing::check_named(correct, "dh").metrics.at("compared") ==
        testing::check_named(testing::run_with(testing::make_case(j), "correct"), "dh").metrics.at("compared"));
  CHECK(testing::run_with(c, "head-dh-shard-partial").verdict == Verdict::pass);  // the framework sums it
  CHECK(testing::check_named(testing::run_with(c, "head-dh-double-reduce"), "dh").verdict == Verdict::fail);
}

TEST_CASE(
    "lm_head: layout.sp is taken in front of cross-entropy, kept in the resolved case, and refused without a head") {
  nlohmann::json j = head_case(2, "fp32");
  j["layout"] = {{"tp", 2}, {"sp", true}};
  CHECK(testing::make_case(j).resolved()["layout"]["sp"] == true);
  j.erase("stage");
  CHECK_THROWS_WITH_AS(testing::make_case(j), doctest::Contains("$.layout.sp: applies to a kind whose rows are whole"),
                       CaseError);
}

}  // namespace lossverify
