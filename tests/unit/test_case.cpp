#include <doctest/doctest.h>

#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

std::string error_of(const nlohmann::json& j) {
  try {
    parse_case(j, "case.json");
  } catch (const CaseError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a_minimal_case_gets_every_default") {
  const Case c = parse_case({{"name", "m"}, {"shape", {{"tokens", 3}, {"vocab", 5}}}}, "m.json");
  CHECK(cross_entropy_options(c.loss).label_smoothing == 0.0);
  CHECK(c.loss.ignore_index == -100);
  CHECK(c.loss.reduction == Reduction::mean);
  CHECK(c.inputs.dtype == DType::fp32);
  CHECK(c.layout.tp == 1);
}

TEST_CASE("the_resolved_case_parses_back_to_itself") {
  auto j = testing::case_json(10, 50, 2, "bf16");
  j["loss"] = {{"label_smoothing", 0.1}, {"reduction", "none"}, {"upstream_weights", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}};
  j["inputs"]["overrides"] = {{{"token", 2}, {"label", -100}}};
  j["tolerances"] = {{"grad", {{"rtol", 0.5}}}};
  const Case c = testing::make_case(j);
  const Case again = parse_case(c.resolved(), "again");
  CHECK(again.resolved() == c.resolved());
  CHECK(again.tolerance_overrides.at("grad").rtol == 0.5);
}

TEST_CASE("errors_name_the_file_and_the_json_path") {
  auto j = testing::case_json(10, 50, 2);
  j["loss"] = {{"label_smoothing", 1.0}};
  CHECK(error_of(j) == "case.json: $.loss.label_smoothing: must be in [0, 1), got 1.0");
  j["loss"] = {{"smoothing", 0.1}};
  CHECK(error_of(j).find("case.json: $.loss.smoothing: unknown key") == 0);
  j["loss"] = nlohmann::json::object();
  j["shape"]["vocab"] = "50";
  CHECK(error_of(j) == "case.json: $.shape.vocab: expected integer, got string");
  j["shape"]["vocab"] = 50;
  j["layout"]["tp"] = 51;
  CHECK(error_of(j).find("case.json: $.layout.tp: tp = 51 exceeds the vocabulary size 50") == 0);
}

TEST_CASE("set_overrides_create_nested_keys_and_parse_json_values") {
  nlohmann::json doc = testing::case_json(10, 50, 2);
  apply_set_override(doc, "loss.label_smoothing=0.25", "x.json");
  apply_set_override(doc, "inputs.dtype=bf16", "x.json");
  apply_set_override(doc, "layout.tp=5", "x.json");
  const Case c = testing::make_case(doc);
  CHECK(cross_entropy_options(c.loss).label_smoothing == 0.25);
  CHECK(c.inputs.dtype == DType::bf16);
  CHECK(c.layout.tp == 5);
  CHECK_THROWS_AS(apply_set_override(doc, "novalue", "x.json"), CaseError);
  CHECK_THROWS_AS(apply_set_override(doc, "name.inner=1", "x.json"), CaseError);
}

TEST_CASE("a_case_changed_after_parsing_is_refused_before_a_run_not_run_out_of_bounds") {
  const Case parsed = testing::make_case(testing::case_json(64, 50, 2));
  CHECK_NOTHROW(check_case(parsed));
  Case shorter = parsed;
  shorter.shape.tokens = 24;  // the parsed batch still holds one sequence of 64 tokens
  try {
    check_case(shorter);
    FAIL("a shape that no longer matches the batch passed");
  } catch (const CaseError& e) {
    CHECK(std::string(e.what()).find("$.shape: tokens = 24 and vocab = 50 with sequences holding 64 tokens") !=
          std::string::npos);
  }
  Case wide = parsed;
  wide.layout.tp = 51;
  CHECK_THROWS_AS(check_case(wide), CaseError);
  RunOptions options;
  CHECK_THROWS_AS(run_case(shorter, options), CaseError);
}
