// The error-map plot: well-formed SVG/HTML whose heatmap marks exactly the ranks whose errors exceed the
// tolerance, and whose per-token strip keeps each bin's largest margin.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include "lossverify/core/errors.hpp"
#include "lossverify/report/plot.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"
#include "xml_check.hpp"

using namespace lossverify;
using lossverify::testing::count_of;
using lossverify::testing::element_with_id;
using lossverify::testing::xml_problem;

using lossverify::testing::run_with;

namespace {

// dp = 3 ranks holding 2, 4 and 6 valid tokens (sequences of 3, 5, 7 with next-token labels): N_v = 12, so
// under dp-local-mean the token weight 1 / (3 N_r) equals 1 / N_v only on DP rank 1 (N_r = 4).
Case dp_unequal_case() {
  nlohmann::json j = lossverify::testing::case_json(15, 64, 2);
  j.erase("shape");
  j["shape"] = {{"vocab", 64}};
  j["batch"] = {{"sequence_lengths", {3, 5, 7}}};
  j["layout"]["dp"] = 3;
  return lossverify::testing::make_case(j);
}

}  // namespace

TEST_CASE("plot_marks_exactly_the_dp_ranks_whose_gradients_are_off") {
  const Case c = dp_unequal_case();
  const RunResult run = run_with(c, "dp-local-mean");
  REQUIRE(run.verdict == Verdict::fail);
  const std::string svg = plot_svg(run);
  CHECK(xml_problem(svg) == "");
  CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  // World rank = (dp * CP + cp) * TP + tp: ranks 2 and 3 are DP rank 1.
  for (int rank = 0; rank < 6; ++rank) {
    CAPTURE(rank);
    const auto cell = element_with_id(svg, "grad-cell-r" + std::to_string(rank));
    REQUIRE(!cell.empty());
    const bool dp1 = rank == 2 || rank == 3;
    CHECK(cell.at("class") == (dp1 ? "cell pass" : "cell fail"));
    CHECK(std::stoi(cell.at("data-dp")) == rank / 2);
    const double margin = std::stod(cell.at("data-margin"));
    CHECK((dp1 ? margin < 1.0 : margin > 1.0));
    // Failing cells are drawn in the reds of the scale (red channel high, green channel low).
    const std::string fill = cell.at("fill");
    const int red = std::stoi(fill.substr(1, 2), nullptr, 16);
    const int green = std::stoi(fill.substr(3, 2), nullptr, 16);
    CHECK((dp1 ? green > red : red > green));
  }
  // The vocabulary ranges of the two TP shards label the columns.
  CHECK(svg.find("[0, 32)") != std::string::npos);
  CHECK(svg.find("[32, 64)") != std::string::npos);
  CHECK(svg.find("FAIL (loss, grad)") != std::string::npos);
}

TEST_CASE("plot_of_the_correct_implementation_marks_no_rank") {
  const RunResult run = run_with(dp_unequal_case(), "correct");
  REQUIRE(run.verdict == Verdict::pass);
  const std::string svg = plot_svg(run);
  CHECK(xml_problem(svg) == "");
  CHECK(count_of(svg, "class=\"cell pass\"") == 12);  // 6 ranks x (gradient, loss)
  CHECK(count_of(svg, "class=\"cell fail\"") == 0);
  CHECK(count_of(svg, "class=\"bin fail\"") == 0);
}

TEST_CASE("plot_marks_every_shard_under_smoothing_partition_vocab") {
  nlohmann::json j = lossverify::testing::case_json(24, 40, 4);
  j["loss"] = {{"label_smoothing", 0.1}};
  const RunResult run = run_with(lossverify::testing::make_case(j), "smoothing-partition-vocab");
  const std::string svg = plot_svg(run);
  CHECK(xml_problem(svg) == "");
  for (int rank = 0; rank < 4; ++rank) {
    CAPTURE(rank);
    const auto cell = element_with_id(svg, "grad-cell-r" + std::to_string(rank));
    CHECK(cell.at("class") == "cell fail");
    CHECK(std::stoi(cell.at("data-vocab-begin")) == 10 * rank);
  }
  // 24 tokens, every one with an off-by-shard gradient: 24 failing bins of one token each.
  CHECK(count_of(svg, "data-quantity=\"grad\"") == 24);
  CHECK(count_of(svg, "class=\"bin fail\" data-quantity=\"grad\"") == 24);
}

TEST_CASE("token_bins_keep_the_largest_margin_of_each_bin") {
  ErrorMap map;
  map.token_grad_margin.assign(1000, 0.0);
  map.token_loss_margin.assign(1000, 0.5);
  map.token_grad_margin[537] = 5.0;
  map.token_grad_margin[12] = std::numeric_limits<double>::quiet_NaN();
  map.token_loss_margin[999] = 7.0;
  const std::vector<TokenBin> bins = bin_token_margins(map, 100);
  REQUIRE(bins.size() == 100);
  std::int64_t next = 0;
  for (const TokenBin& bin : bins) {
    CHECK(bin.first == next);  // consecutive, covering every token once
    next = bin.last + 1;
    const bool has_537 = bin.first <= 537 && 537 <= bin.last;
    const bool has_12 = bin.first <= 12 && 12 <= bin.last;
    if (has_12) {
      CHECK(std::isnan(bin.grad_margin));
    } else {
      CHECK(bin.grad_margin == (has_537 ? 5.0 : 0.0));
    }
    CHECK(bin.loss_margin == (bin.last == 999 ? 7.0 : 0.5));
  }
  CHECK(next == 1000);
  CHECK(bin_token_margins(map, 5000).size() == 1000);  // never more bins than tokens
}

TEST_CASE("html_plot_is_well_formed_with_one_svg_per_run_and_escaped_names") {
  nlohmann::json j = lossverify::testing::case_json(8, 16, 2);
  j["name"] = "a<b>&\"c\"";
  const Case c = lossverify::testing::make_case(j);
  const RunResult first = run_with(c, "correct");
  const RunResult second = run_with(dp_unequal_case(), "dp-local-mean");
  const std::string html = plot_html({&first, &second});
  CHECK(xml_problem(html) == "");
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK(count_of(html, "<svg ") == 2);
  CHECK(html.find("a&lt;b&gt;&amp;&quot;c&quot;") != std::string::npos);
  CHECK(html.find("a<b>") == std::string::npos);
}

TEST_CASE("render_plots_writes_one_svg_per_run_or_one_page_and_refuses_other_files") {
  const RunResult a = run_with(dp_unequal_case(), "correct");
  RunResult b = a;
  b.the_case.layout.tp = 1;  // same case at another layout: the name says which
  const auto single = render_plots("out/plot.svg", {&a});
  REQUIRE(single.size() == 1);
  CHECK(single[0].first == "out/plot.svg");
  const auto several = render_plots("out/plot.svg", {&a, &b});
  REQUIRE(several.size() == 2);
  CHECK(several[0].first == "out/plot-1-unit-tp2-cp1-dp3-ga1.svg");
  CHECK(several[1].first == "out/plot-2-unit-tp1-cp1-dp3-ga1.svg");
  const auto page = render_plots("out/plot.HTML", {&a, &b});
  REQUIRE(page.size() == 1);
  CHECK(count_of(page[0].second, "<svg ") == 2);
  CHECK_THROWS_AS(render_plots("out/plot.png", {&a}), CaseError);
  CHECK(is_plot_path("x.htm"));
  CHECK(!is_plot_path("x.svg.json"));
}
