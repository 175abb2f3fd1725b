#pragma once
// A stage that exists only for tests: the least stage in front of a loss kind. Its input h is the rank's logits
// shard itself (logits = h), and its gradient dh = dL/dlogits, reported and judged as the check "dh" beside the
// kind's own. Everything it is lives in this folder and reaches lossverify through register_stage.
namespace lossverify::testing {

inline constexpr const char* kPassThrough = "pass_through";
// Its catalogued bug: dh accumulated twice (a backward hook registered twice): 2 dL/dlogits.
inline constexpr const char* kPassThroughTwice = "pass-through-dh-accumulated-twice";

void register_pass_through();

}  // namespace lossverify::testing
