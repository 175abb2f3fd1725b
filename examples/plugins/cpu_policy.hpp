// The example CPU plugin's policy loss (cpu_policy.cpp), called by its run_rank (cpu_cross_entropy.cpp).
#pragma once

#include <lossverify/plugin.h>

#include "plugin_common.hpp"

namespace lossverify_example {

// Catalogued policy bugs the example carries behind ?bug= (docs/catalogue.md).
struct PolicyBugs {
  bool kl_no_grad = false;            // rl-kl-no-grad (SkyRL #1353): the KL term without gradient
  bool temperature_one_side = false;  // rl-temperature-one-side (verl #3133): the policy's side at T = 1
  bool gspo_cp_local_ratio = false;   // rl-gspo-cp-local-ratio: GSPO's sequence ratio without the CP all-reduces
};

// One rank's policy loss over all its micro-batches, inputs and outputs in host memory.
void run_policy(const lv_rank_inputs& in, lv_rank_outputs& out, const PolicyBugs& bugs, const Collectives& comm);

}  // namespace lossverify_example
