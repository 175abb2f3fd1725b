#pragma once
// The case a kind's kernels run under, on every backend.
#include "lossverify/case/case.hpp"

namespace lossverify {

struct BugSwitches;

// The case itself, or with the kind's settings a catalogued bug of its stage changes (Stage::kind_settings_under: a
// fused head that never passes label smoothing on).
Case kind_case_of(const Case& c, const BugSwitches& bugs);

}  // namespace lossverify
