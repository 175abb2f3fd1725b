// The value ranges (docs/cases.md): inside them the correct implementation passes and every catalogued bug of the
// kind is still caught at both ends; beyond them the case is refused (exit 2) naming the field.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include <nlohmann/json.hpp>
#include "test_support.hpp"

using namespace lossverify;
using namespace lossverify::testing;

namespace {

// The bugs golden records as caught on a shipped case (at its own settings).
std::vector<std::string> caught_on(const std::string& case_name) {
  std::ifstream file("golden/" + case_name + ".json");
  const nlohmann::json outcomes = nlohmann::json::parse(file)["outcomes"];
  std::vector<std::string> names;
  for (const auto& [impl, outcome] : outcomes.items()) {
    if (outcome["verdict"] == "fail") names.push_back(impl);
  }
  return names;
}

// The correct implementation passes; every bug the case catches at its own settings still fails some check.
void expect_every_bug_caught(const Case& c, const std::string& case_name) {
  CHECK(run_with(c, "correct").verdict == Verdict::pass);
  const std::vector<std::string> bugs = caught_on(case_name);
  CHECK(bugs.size() >= 6);
  for (const std::string& bug : bugs) {
    CAPTURE(bug);
    CHECK(run_with(c, bug).verdict == Verdict::fail);
  }
}

}  // namespace

TEST_CASE("kd_temperature_is_bounded_where_the_loss_floor_would_hide_a_missing_t2") {
  // kd-tp4-temperature2's inputs: student and teacher at scale 3, Var(y - x) = 18, so the bound is
  // sqrt(0.05 * 18 / 1e-5) = 300; the low end is where the logits / T reach 200 (27.5 / 200).
  const std::string file = "cases/kd-tp4-temperature2.json";
  for (const char* temperature : {"0.1375", "300"}) {
    CAPTURE(temperature);
    expect_every_bug_caught(load_case_file(file, {std::string("loss.temperature=") + temperature}),
                            "kd-tp4-temperature2");
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
  CHECK_NOTHROW(load_case_file("cases/kd-student-equals-teacher.json", {"loss.temperature=1e6"}));
}
