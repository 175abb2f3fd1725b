#pragma once
// The one sharded implementation is a set of switches; the correct implementation has none on and each
// catalogued bug (SPEC 7) is a named set of them, so CPU and CUDA kernels carry the same bugs.
#include <string>
#include <string_view>
#include <vector>

namespace lossverify {

struct BugSwitches {
  // Forward smoothing constants use the shard width V_p instead of V, and the mean log-probability is
  // taken over the local shard only.
  bool smoothing_vocab_local_forward = false;
  bool smoothing_sum_local_forward = false;
  // Backward smoothing constants use V_p.
  bool smoothing_vocab_local_backward = false;
  // The smoothing term's mean log-probability is taken as log(exp(x - M) / S): -inf once p underflows.
  bool smoothing_log_after_exp = false;

  bool any() const {
    return smoothing_vocab_local_forward || smoothing_sum_local_forward || smoothing_vocab_local_backward ||
           smoothing_log_after_exp;
  }
};

struct Implementation {
  std::string name;
  std::string summary;    // what the implementation does wrong (or "correct")
  std::string source;     // the public issue or pull request it comes from
  std::string signal;     // how the bug shows
  std::vector<std::string> caught_by;  // checks expected to fail
  BugSwitches bugs;
};

const std::vector<Implementation>& implementations();
// nullptr when no implementation has that name.
const Implementation* find_implementation(std::string_view name);

}  // namespace lossverify
