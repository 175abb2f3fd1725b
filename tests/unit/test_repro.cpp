// Reproducer bundles (write, read, replay, tamper detection) and case shrinking.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/repro/bundle.hpp"
#include "lossverify/repro/shrink.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;
using nlohmann::json;

using lossverify::testing::run_with;

namespace {

// The shipped cp-zigzag-packed layout, small: packed sequences none a multiple of 2 CP.
Case cp_case() {
  json j = lossverify::testing::case_json(47, 60, 2);
  j.erase("shape");
  j["shape"] = {{"vocab", 60}};
  j["batch"] = {{"sequence_lengths", {13, 7, 22, 5}}};
  j["layout"]["cp"] = 2;
  j["loss"] = {{"label_smoothing", 0.1}};
  return lossverify::testing::make_case(j);
}

const CheckResult& check_named(const RunResult& r, const std::string& name) {
  for (const CheckResult& c : r.checks) {
    if (c.name == name) return c;
  }
  FAIL("no check " << name);
  return r.checks.front();
}

// The message of the CaseError that parse_bundle throws for a tampered copy, or "" when it accepts it.
std::string rejection(json bundle, const std::function<void(json&)>& tamper) {
  tamper(bundle);
  try {
    parse_bundle(bundle, "b.json");
  } catch (const CaseError& e) {
    return e.what();
  }
  return "";
}

// A small LM head case (docs/spec.md §3, the head): bf16, tp 2 under sequence parallelism, cp 2 with padding, ga 2.
json head_case_json() {
  return {{"name", "head"},
          {"shape", {{"vocab", 48}}},
          {"batch", {{"sequence_lengths", {9, 7, 11, 6}}}},
          {"loss", {{"label_smoothing", 0.1}}},
          {"stage", {{"kind", "lm_head"}, {"hidden", 24}, {"chunks", 8}, {"bias", true}}},
          {"inputs", {{"seed", 5}, {"dtype", "bf16"}, {"scale", 2.0}, {"ignore_fraction", 0.1}}},
          {"layout", {{"tp", 4}, {"cp", 2}, {"ga", 2}, {"sp", true}}},
          {"timeout_seconds", 60.0}};
}

}  // namespace

TEST_CASE("bundle_replay_reproduces_a_catalogued_bug_bit_for_bit") {
  const Case c = cp_case();
  const RunResult original = run_with(c, "cp-roll-after-split");
  REQUIRE(original.verdict == Verdict::fail);
  const json document = make_bundle(original, BundleContext{});
  CHECK(document["format"] == kBundleFormat);
  CHECK(document["implementation"] == "cp-roll-after-split");
  const Bundle bundle = parse_bundle(json::parse(document.dump()), "b.json");
  REQUIRE(!bundle.rows.empty());
  // The worst element of every failing check has its row recorded.
  for (const CheckResult& check : original.checks) {
    if (check.verdict != Verdict::fail || !check.worst || check.worst->token < 0) continue;
    CAPTURE(check.name);
    CHECK(std::any_of(bundle.rows.begin(), bundle.rows.end(),
                      [&](const RecordedRow& r) { return r.token == check.worst->token; }));
  }
  CHECK(input_drift(bundle).empty());
  // Pinning the rows inline is the identity on the inputs: every check comes out bit for bit the same.
  const RunResult replayed = run_with(bundle.the_case, bundle.implementation);
  REQUIRE(replayed.checks.size() == original.checks.size());
  for (std::size_t i = 0; i < original.checks.size(); ++i) {
    CAPTURE(original.checks[i].name);
    CHECK(replayed.checks[i].verdict == original.checks[i].verdict);
    CHECK(replayed.checks[i].margin == original.checks[i].margin);
  }
  const ReplayComparison comparison = compare_outcome(bundle, replayed);
  CHECK(comparison.reproduced);
  CHECK(comparison.differences.empty());
  CHECK(comparison.notes.empty());
}

TEST_CASE("replay_with_the_fix_does_not_reproduce_and_names_the_checks") {
  const RunResult original = run_with(cp_case(), "cp-roll-after-split");
  const Bundle bundle = parse_bundle(make_bundle(original, BundleContext{}), "b.json");
  const ReplayComparison comparison = compare_outcome(bundle, run_with(bundle.the_case, "correct"));
  CHECK(!comparison.reproduced);
  bool named_grad = false;
  for (const std::string& line : comparison.differences) {
    named_grad = named_grad || line.rfind("check grad was fail, now pass", 0) == 0;
  }
  CHECK(named_grad);
  // A different failure of the same checks moves the worst element: not a reproduction either.
  const RunResult other = run_with(bundle.the_case, "cp-pad-to-cp");
  const ReplayComparison moved = compare_outcome(bundle, other);
  CHECK(!moved.reproduced);
}

TEST_CASE("pinned_rows_keep_the_failing_rows_when_the_generator_changes") {
  const RunResult original = run_with(cp_case(), "cp-roll-after-split");
  json document = make_bundle(original, BundleContext{});
  // Simulate another generator: a different seed yields different values for every unpinned row.
  document["case"]["inputs"]["seed"] = 99;
  const Bundle bundle = parse_bundle(document, "b.json");
  const InputSource inputs(bundle.the_case);
  for (const RecordedRow& row : bundle.rows) {
    std::vector<double> now(static_cast<std::size_t>(bundle.the_case.shape.vocab));
    inputs.logits(row.token, 0, bundle.the_case.shape.vocab, now.data());
    CHECK(now == row.logits);
  }
  const auto drift = input_drift(bundle);
  CHECK(drift.size() >= bundle.rows.size());
  CHECK(drift.front().find("this build generates") != std::string::npos);
}

TEST_CASE("kd_bundles_record_teacher_rows_exactly") {
  json j = lossverify::testing::case_json(12, 24, 2, "bf16");
  j["loss"] = {{"kind", "kd"}, {"temperature", 2.0}};
  j["inputs"]["teacher"] = {{"mean", 0.5}, {"scale", 3.0}};
  const RunResult original = run_with(lossverify::testing::make_case(j), "kd-no-t2");
  REQUIRE(original.verdict == Verdict::fail);
  const Bundle bundle = parse_bundle(make_bundle(original, BundleContext{}), "b.json");
  REQUIRE(!bundle.rows.empty());
  const InputSource inputs(bundle.the_case);
  for (const RecordedRow& row : bundle.rows) {
    CHECK(!row.label);
    std::vector<double> teacher(24);
    inputs.teacher_logits(row.token, 0, 24, teacher.data());
    CHECK(teacher == row.teacher);
  }
  CHECK(compare_outcome(bundle, run_with(bundle.the_case, "kd-no-t2")).reproduced);
}

TEST_CASE("row_bits_round_trip_exactly_in_every_dtype") {
  const std::vector<double> values = {0.0, -0.0, 1.0, -2.5, 3.14159265358979, 1e-6, 240.0, -65504.0, 1.0 / 3.0};
  for (DType dtype : {DType::fp32, DType::bf16, DType::fp16}) {
    CAPTURE(to_string(dtype));
    std::vector<double> rounded;
    for (double v : values) rounded.push_back(round_to_dtype(v, dtype));
    const std::string text = encode_row_bits(values, dtype);
    const std::vector<double> back = decode_row_bits(text, dtype, static_cast<std::int64_t>(values.size()), "f", "$.x");
    REQUIRE(back.size() == rounded.size());
    for (std::size_t i = 0; i < back.size(); ++i) {
      CHECK(back[i] == rounded[i]);
      CHECK(std::signbit(back[i]) == std::signbit(rounded[i]));
    }
  }
  CHECK(encode_row_bits({1.0, -2.0}, DType::fp32) == "3f800000 c0000000");
  CHECK(encode_row_bits({1.0, -2.0}, DType::bf16) == "3f80 c000");
  CHECK(encode_row_bits({1.0}, DType::fp16) == "3c00");
}

TEST_CASE("tampered_bundles_are_rejected_naming_file_and_field") {
  const json good = make_bundle(run_with(cp_case(), "cp-roll-after-split"), BundleContext{});
  REQUIRE(rejection(good, [](json&) {}) == "");
  struct Tamper {
    const char* expected;
    std::function<void(json&)> apply;
  };
  const std::vector<Tamper> tampers = {
      {"b.json: $.format: unsupported bundle format", [](json& b) { b["format"] = "lossverify.bundle/9"; }},
      {"b.json: $.implementation: unknown implementation \"nope\"", [](json& b) { b["implementation"] = "nope"; }},
      {"b.json: $.case.loss.label_smoothing: must be in [0, 1)",
       [](json& b) { b["case"]["loss"]["label_smoothing"] = 1.5; }},
      {"b.json: $.case: required key is missing", [](json& b) { b.erase("case"); }},
      {"b.json: $.failing_rows[0].logits_bits: word 1 \"zz\": expected 8 hex digits",
       [](json& b) {
         std::string bits = b["failing_rows"][0]["logits_bits"];
         b["failing_rows"][0]["logits_bits"] = bits.substr(0, 9) + "zz" + bits.substr(17);
       }},
      {"b.json: $.failing_rows[0].logits_bits: has 59 values, expected vocab = 60",
       [](json& b) {
         std::string bits = b["failing_rows"][0]["logits_bits"];
         b["failing_rows"][0]["logits_bits"] = bits.substr(9);
       }},
      {"b.json: $.failing_rows[0].logits_bits: word 3 (",
       [](json& b) {
         const std::int64_t token = b["failing_rows"][0]["token"];
         for (json& o : b["case"]["inputs"]["overrides"]) {
           if (o["token"] == token) o["logits"][3] = o["logits"][3].get<double>() + 0.5;
         }
       }},
      {"b.json: $.failing_rows[0].token: token 100000 outside [0, 47)",
       [](json& b) { b["failing_rows"][0]["token"] = 100000; }},
      {"b.json: $.failing_rows[0].dtype: \"bf16\"", [](json& b) { b["failing_rows"][0]["dtype"] = "bf16"; }},
      {"b.json: $.outcome.checks[0].verdict: expected one of pass|fail|not_applicable",
       [](json& b) { b["outcome"]["checks"][0]["verdict"] = "maybe"; }},
      {"b.json: $.outcome.checks[1].margin: expected a margin >= 0",
       [](json& b) { b["outcome"]["checks"][1]["margin"] = -1.0; }},
      {"b.json: $.outcome.verdict: \"pass\" contradicts the recorded checks",
       [](json& b) { b["outcome"]["verdict"] = "pass"; }},
      {"b.json: $.outcome.checks[1].worst.rank: rank 9 outside [0, 4)",
       [](json& b) { b["outcome"]["checks"][1]["worst"]["rank"] = 9; }},
      {"b.json: $.surprise: unknown key", [](json& b) { b["surprise"] = 1; }},
      {"b.json: $: expected object, got array", [](json& b) { b = json::array(); }},
  };
  for (const Tamper& t : tampers) {
    const std::string expected = t.expected;
    CAPTURE(expected);
    const std::string message = rejection(good, t.apply);
    CHECK(message.find(t.expected) != std::string::npos);
    if (message.find(t.expected) == std::string::npos) MESSAGE("got: " << message);
  }
}

TEST_CASE("shrink_reduces_a_failing_case_and_it_still_fails_the_same_check") {
  json j = lossverify::testing::case_json(96, 300, 4);
  j["loss"] = {{"label_smoothing", 0.1}, {"z_loss_weight", 1e-3}};
  j["inputs"]["ignore_fraction"] = 0.1;
  const Case c = lossverify::testing::make_case(j);
  ShrinkOptions options;
  options.implementation = "smoothing-partition-vocab";
  options.check = "rank_agreement";
  options.threads = 2;
  options.max_trials = 200;
  int progress_lines = 0;
  options.progress = [&](const std::string&) { ++progress_lines; };
  const ShrinkResult result = shrink_case(c, options);
  CHECK(result.check == "rank_agreement");
  CHECK(result.after.logits() * 100 <= result.before.logits());
  CHECK(result.after.tokens <= 2);
  // The bug needs two shards and label smoothing: those stay; z-loss and ignored tokens go.
  CHECK(result.after.layout.tp >= 2);
  CHECK(cross_entropy_options(result.minimized_case.loss).label_smoothing > 0.0);
  CHECK(cross_entropy_options(result.minimized_case.loss).z_loss_weight == 0.0);
  CHECK(result.minimized_case.inputs.ignore_fraction == 0.0);
  CHECK(progress_lines == static_cast<int>(result.steps.size()) + 1);
  CHECK(result.trials <= 200);
  // The written document is a valid case that fails the check.
  const Case reread = parse_case(json::parse(result.minimized.dump()), "shrunk.json");
  CHECK(reread.name == "unit-shrunk");
  const RunResult rerun = run_with(reread, "smoothing-partition-vocab");
  CHECK(check_named(rerun, "rank_agreement").verdict == Verdict::fail);
  CHECK(run_with(reread, "correct").verdict == Verdict::pass);
}

TEST_CASE("shrink_keeps_the_inline_row_that_triggers_the_bug") {
  json j = lossverify::testing::case_json(16, 32, 2);
  j["loss"] = {{"label_smoothing", 0.1}};
  std::vector<double> gap(32, 0.0);
  gap[5] = 240.0;
  std::vector<double> plain(32, 1.0);
  j["inputs"]["overrides"] = {{{"token", 3}, {"logits", plain}}, {{"token", 9}, {"logits", gap}, {"label", 5}}};
  ShrinkOptions options;
  options.implementation = "smoothing-log-after-exp";
  options.check = "finite";
  options.threads = 2;
  const ShrinkResult result = shrink_case(lossverify::testing::make_case(j), options);
  REQUIRE(result.minimized_case.inputs.overrides.size() == 1);
  const RowOverride& row = result.minimized_case.inputs.overrides[0];
  CHECK(row.token < result.minimized_case.shape.tokens);
  CHECK(*std::max_element(row.logits.begin(), row.logits.end()) == 240.0);
  CHECK(result.after.tokens < 16);
  CHECK(check_named(run_with(result.minimized_case, "smoothing-log-after-exp"), "finite").verdict == Verdict::fail);
}

TEST_CASE("shrink_refuses_a_case_that_does_not_fail") {
  const Case c = cp_case();
  ShrinkOptions options;
  options.implementation = "correct";
  options.threads = 2;
  CHECK_THROWS_WITH_AS(shrink_case(c, options),
                       doctest::Contains("nothing to shrink: <test> passes with --impl correct"), CaseError);
  options.implementation = "cp-roll-after-split";
  options.check = "finite";
  CHECK_THROWS_WITH_AS(shrink_case(c, options), doctest::Contains("does not fail check finite"), CaseError);
  options.check = "no-such-check";
  CHECK_THROWS_AS(shrink_case(c, options), CaseError);
}

TEST_CASE("shrink_stops_at_its_trial_budget") {
  ShrinkOptions options;
  options.implementation = "cp-roll-after-split";
  options.threads = 2;
  options.max_trials = 3;
  const ShrinkResult result = shrink_case(cp_case(), options);
  CHECK(result.trials == 3);
  CHECK(result.budget_exhausted);
}

TEST_CASE("compact_case_documents_read_back_to_the_same_case") {
  std::vector<json> documents;
  documents.push_back(lossverify::testing::case_json(10, 20, 2));
  json packed = lossverify::testing::case_json(10, 20, 2, "bf16");
  packed.erase("shape");
  packed["shape"] = {{"vocab", 20}};
  packed["batch"] = {{"sequence_lengths", {4, 6}}, {"placement", "contiguous"}};
  packed["layout"] = {{"tp", 2}, {"cp", 2}, {"ga", 2}};
  packed["loss"] = {{"reduction", "none"}, {"upstream_weights", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}};
  packed["tolerances"] = {{"grad", {{"atol", 1e-5}}}};
  packed["sweep"] = {{"tp", {1, 2}}};
  documents.push_back(packed);
  json kd = lossverify::testing::case_json(6, 12, 3);
  kd["loss"] = {{"kind", "kd"}, {"temperature", 2.0}, {"t2_scaling", false}};
  kd["inputs"]["teacher"] = {{"same_as_student", true}};
  documents.push_back(kd);
  for (const json& d : documents) {
    const Case c = lossverify::testing::make_case(d);
    const json compact = compact_case_json(c);
    CAPTURE(compact.dump());
    Case without_sweep = c;
    without_sweep.sweep = SweepSpec{};
    CHECK(parse_case(compact, "<compact>").resolved() == without_sweep.resolved());
    CHECK(!compact.contains("sweep"));
    CHECK(compact.dump().size() < without_sweep.resolved().dump().size());
  }
}

TEST_CASE("head_bundles_replay_to_the_same_verdict_and_record_each_rows_hidden_states") {
  const RunResult original = run_with(lossverify::testing::make_case(head_case_json()), "head-dh-shard-partial");
  REQUIRE(original.verdict == Verdict::fail);
  const json document = make_bundle(original, BundleContext{});
  const Bundle bundle = parse_bundle(json::parse(document.dump()), "b.json");
  REQUIRE(!bundle.rows.empty());
  // Each recorded row carries h of its token exactly: the head's stream, from the definition (hidden_scale 1).
  const InputSource inputs(bundle.the_case);
  for (const RecordedRow& row : bundle.rows) {
    std::vector<double> h(24);
    inputs.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(row.token), 0, 24, 1.0, h.data());
    CHECK(row.stage_input == h);
  }
  CHECK(input_drift(bundle).empty());
  CHECK(compare_outcome(bundle, run_with(bundle.the_case, bundle.implementation)).reproduced);
  CHECK(!compare_outcome(bundle, run_with(bundle.the_case, "correct")).reproduced);
  // Another generator (here: another seed) is named, the stage's rows among the drifted ones.
  json reseeded = document;
  reseeded["case"]["inputs"]["seed"] = 99;
  const auto drift = input_drift(parse_bundle(reseeded, "b.json"));
  CHECK(std::any_of(drift.begin(), drift.end(),
                    [](const std::string& line) { return line.find("generates stage inputs") != std::string::npos; }));
  CHECK(rejection(document,
                  [](json& b) {
                    std::string bits = b["failing_rows"][0]["stage_input_bits"].get<std::string>();
                    b["failing_rows"][0]["stage_input_bits"] = bits.substr(0, bits.rfind(' '));
                  })
            .find("$.failing_rows[0].stage_input_bits: has 23 values, expected the stage's input width = 24") !=
        std::string::npos);
}

TEST_CASE("shrink_reduces_a_head_case_in_tokens_vocab_hidden_chunks_and_layout_while_dh_still_fails") {
  const Case c = lossverify::testing::make_case(head_case_json());
  ShrinkOptions options;
  options.implementation = "head-dh-shard-partial";
  options.check = "dh";
  options.threads = 2;
  options.max_trials = 400;
  const ShrinkResult result = shrink_case(c, options);
  CHECK(result.check == "dh");
  CHECK(result.after.tokens < result.before.tokens);
  CHECK(result.after.vocab < result.before.vocab);
  const Case& shrunk = result.minimized_case;
  REQUIRE(shrunk.loss.stage != nullptr);
  const nlohmann::json stage = shrunk.resolved()["stage"];
  CHECK(stage["hidden"].get<int>() < 24);
  CHECK(stage["chunks"].get<int>() < 8);
  CHECK(stage["bias"] == false);  // the bug needs no bias
  // dh left partial needs two vocabulary shards, and nothing else of the layout
  CHECK(result.after.layout.tp == 2);
  CHECK(!result.after.layout.sp);
  CHECK(result.after.layout.cp == 1);
  CHECK(result.after.layout.ga == 1);
  // The written document reads back as a head case that still fails dh, and passes with the fix.
  const Case reread = parse_case(json::parse(result.minimized.dump()), "shrunk.json");
  CHECK(check_named(run_with(reread, "head-dh-shard-partial"), "dh").verdict == Verdict::fail);
  CHECK(run_with(reread, "correct").verdict == Verdict::pass);
  CHECK(!result.minimized["layout"].contains("sp"));  // compact: the defaults left out
  CHECK(!result.minimized["stage"].contains("bias"));
}
