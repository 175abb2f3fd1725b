// The value ranges (docs/cases.md): inside them the correct implementation passes and every catalogued bug of the
// kind is still caught at both ends; beyond them the case is refused (exit 2) naming the field.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include "test_support.hpp"

using namespace lossverify;
using namespace lossverify::testing;

namespace {

// A file of the source tree (the shipped cases, golden/), wherever the test runs.
std::string in_tree(const std::string& relative) { return std::string(LOSSVERIFY_SOURCE_DIR) + "/" + relative; }

// The bugs golden records as caught on a shipped case (at its own settings).
std::vector<std::string> caught_on(const std::string& case_name) {
  std::ifstream file(in_tree("golden/" + case_name + ".json"));
  const nlohmann::json outcomes = nlohmann::json::parse(file)["outcomes"];
  std::vector<std::string> names;
  for (const auto& [impl, outcome] : outcomes.items()) {
    if (outcome["verdict"] == "fail") names.push_back(impl);
  }
  return names;
}

// Of the bugs golden records as caught on a shipped case, those that no longer fail at these settings; and the
// correct implementation's verdict there.
std::vector<std::string> uncaught_at(const std::string& case_name, const std::vector<std::string>& settings,
                                     Verdict& correct) {
  const Case c = load_case_file(in_tree("cases/" + case_name + ".json"), settings);
  correct = run_with(c, "correct").verdict;
  std::vector<std::string> missed;
  for (const std::string& bug : caught_on(case_name)) {
    if (run_with(c, bug).verdict != Verdict::fail) missed.push_back(bug);
  }
  return missed;
}

}  // namespace

TEST_CASE("kd_temperature_is_bounded_where_the_loss_floor_would_hide_a_missing_t2") {
  // kd-tp4-temperature2's inputs: student and teacher at scale 3, Var(y - x) = 18, so the bound is
  // sqrt(0.05 * 18 / 1e-5) = 300; the low end is where the logits / T reach 200 (27.5 / 200).
  const std::string file = in_tree("cases/kd-tp4-temperature2.json");
  CHECK(caught_on("kd-tp4-temperature2").size() >= 6);
  for (const char* temperature : {"0.1375", "300"}) {
    CAPTURE(temperature);
    Verdict correct = Verdict::fail;
    CHECK(uncaught_at("kd-tp4-temperature2", {std::string("loss.temperature=") + temperature}, correct).empty());
    CHECK(correct == Verdict::pass);
  }
  for (const char* beyond : {"301", "1e5", "1e6"}) {
    CAPTURE(beyond);
    try {
      (void)load_case_file(file, {std::string("loss.temperature=") + beyond});
      FAIL("accepted");
    } catch (const CaseError& e) {
      CHECK(std::string(e.what()).find("$.loss.temperature") != std::string::npos);
    }
  }
  // A teacher equal to the student has KL = 0 at every temperature: nothing for the floor to hide.
  CHECK_NOTHROW(load_case_file(in_tree("cases/kd-student-equals-teacher.json"), {"loss.temperature=1e6"}));
}

TEST_CASE("policy_settings_at_both_ends_of_their_ranges_keep_the_correct_pass_and_every_bug_caught") {
  // rl-grpo-tp2-dp2-ga2 (T 0.7, clips 0.2 / 0.28, dual clip 3, k3 at 0.05, entropy 0.01), one setting at a time
  // at each end of its accepted range, the others where the case has them. The temperature's low end is where the
  // generated logits / T reach 200 (18 / 200); a coefficient's low end is a small positive value (at 0 its term's
  // bugs cannot show: rl-entropy-untracked-allreduce without an entropy bonus).
  const std::vector<std::vector<std::string>> ends = {{"loss.kl_penalty=k1", "loss.kl_coef=1000"},
                                                      {"loss.kl_penalty=k2", "loss.kl_coef=1000"},
                                                      {"loss.kl_penalty=k3", "loss.kl_coef=1000"},
                                                      {"loss.kl_penalty=k1", "loss.kl_coef=10"},
                                                      {"loss.entropy_coef=0.001"},
                                                      {"loss.entropy_coef=1000"},
                                                      {"loss.clip_low=0.001"},
                                                      {"loss.clip_low=0.999"},
                                                      {"loss.clip_high=0.001"},
                                                      {"loss.clip_high=1000"},
                                                      {"loss.dual_clip=1.001"},
                                                      {"loss.dual_clip=1000"},
                                                      {"loss.temperature=0.09"},
                                                      {"loss.temperature=1e6"}};
  for (const auto& settings : ends) {
    std::string label;
    for (const std::string& s : settings) label += s + " ";
    CAPTURE(label);
    Verdict correct = Verdict::fail;
    const std::vector<std::string> missed = uncaught_at("rl-grpo-tp2-dp2-ga2", settings, correct);
    CHECK(correct == Verdict::pass);
    std::string names;
    for (const std::string& m : missed) names += m + " ";
    CAPTURE(names);
    // At T = 0.09 the largest logit / T is about 100, and rl-fused-vocab-pad's zero-logit pad columns add
    // pad e^(-M) / S < e^-90 to each row's sums: the bug has no signal there, at any tolerance.
    const bool low_temperature = settings.front() == "loss.temperature=0.09";
    CHECK(missed == (low_temperature ? std::vector<std::string>{"rl-fused-vocab-pad"} : std::vector<std::string>{}));
  }
}
