#pragma once
// The plugin backend: one rank's sharded loss computed by a native plugin. The rank's inputs are generated
// exactly as for the built-in kernels (make_rank_inputs) into buffers the plugin owns for the call (host or
// device memory, as it declares); the plugin gets the collectives of the rank's groups; its outputs are checked
// for size and overruns and become a RankOutput, judged by the same verification as every backend. The float64
// reference regenerates its own inputs and never reads the plugin's buffers.
#include "lossverify/case/case.hpp"
#include "lossverify/impl/cpu/sharded_loss.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

struct PluginRankOptions {
  int device = 0;   // CUDA device of a device-memory plugin
  int threads = 1;  // for generating the rank's inputs
};

// Throws InternalError naming the plugin and the rank when the plugin returns an error or writes outputs that
// do not fit; a failure of the world seen inside a collective (another rank failed, the deadlock guard) is
// rethrown as it was raised.
RankOutput run_plugin_rank(const PluginLibrary& plugin, const Case& c, const InputSource& inputs,
                           RankAssignment assignment, RankGroups groups, const PluginRankOptions& options);

}  // namespace lossverify
