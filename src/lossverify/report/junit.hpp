#pragma once
// JUnit XML of a run, sweep or check-dump report (`--junit FILE`): one testsuite per run (case, layout,
// implementation), one testcase per check, with the check's margin, tolerance and control band as properties
// and a failure element for a failing check.
#include <string>

#include <nlohmann/json.hpp>

namespace lossverify {

std::string report_junit(const nlohmann::json& report);

}  // namespace lossverify
