#pragma once
// The plugin backend: one rank's sharded loss computed by a native plugin, in a plugin host process
// (plugin_host.hpp). The rank's inputs are generated exactly as for the built-in kernels (make_rank_inputs)
// into a region shared with the host; the host hands them to the plugin (in host memory, or copied to the
// GPU, as it declares) with collectives that lossverify carries out over the rank's groups; the outputs come
// back through the same region, are checked for sizes and for writes outside them, and become a RankOutput
// judged by the same verification as every backend. The float64 reference regenerates its own inputs and
// never reads the region. A host that ends in any way but by reporting run_rank's return (exit(0) included)
// fails the rank, naming the plugin, the rank and what ended it.
#include <cstdint>
#include <memory>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/cpu/sharded_loss.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

class PluginHostProcess;

struct PluginRankOptions {
  int device = 0;                // CUDA device of a device-memory plugin
  int threads = 1;               // for generating the rank's inputs
  double timeout_seconds = 120;  // the longest the host may be silent (no collective, no result)
};

// A rank's plugin host after its outputs were taken: kept until the rank's checks are done, then asked whether
// the plugin called a collective after run_rank returned, and whether its process is still whole.
class PluginSession {
 public:
  PluginSession();
  ~PluginSession();
  PluginSession(const PluginSession&) = delete;
  PluginSession& operator=(const PluginSession&) = delete;
  // Throws InternalError naming the plugin and the rank for a late collective or a host that ended its process
  // (an exit, a crash on a thread it started) after run_rank returned. Nothing to do when no plugin ran.
  void finish();

 private:
  friend class PluginRank;
  std::unique_ptr<PluginHostProcess> host_;
  std::string spec_;
  int rank_ = 0;
  std::uint64_t token_ = 0;
  double timeout_seconds_ = 120;
};

// Throws InternalError naming the plugin and the rank when the plugin returns an error, writes outputs that do
// not fit or outside its buffers, misuses a collective, or ends its host; TimeoutError when the host is silent
// past the timeout; a failure of the world seen inside a collective (another rank failed, the deadlock guard)
// is rethrown as it was raised.
RankOutput run_plugin_rank(const PluginLibrary& plugin, const Case& c, const InputSource& inputs,
                           RankAssignment assignment, RankGroups groups, const PluginRankOptions& options,
                           PluginSession& session);

}  // namespace lossverify
