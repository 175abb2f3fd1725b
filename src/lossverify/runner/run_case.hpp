#pragma once
// case -> inputs -> ranks run an implementation -> checks against the reference -> one run's result.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/comm/communicator.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

// Test aid: make one rank fail, to prove that the others stop with a message naming it.
struct FaultInjection {
  enum class Kind { none, throw_error, hang, exit } kind = Kind::none;
  int rank = -1;
  bool late = false;  // after the rank's groups (NCCL included) are set up, just before its kernel
};
// "throw@R", "hang@R" or "exit@R" (the process exits: MPI backend), each also as "late-KIND@R";
// throws CaseError otherwise.
FaultInjection parse_fault(const std::string& text);
// CaseError when the fault names a rank outside [0, world_size).
void check_fault_rank(const FaultInjection& fault, int world_size);

struct RunOptions {
  std::string implementation = "correct";
  int threads = 0;  // OpenMP threads for the reference and checks; 0 = all hardware threads
  FaultInjection fault;
  // Inputs of this very case, already built (and perhaps materialized) by the caller: the gate and sweeps
  // run one case many times. The inputs do not depend on the implementation or the layout.
  const InputSource* shared_inputs = nullptr;
  // Where the kernels run: the CPU, or CUDA GPUs (each rank on GPU rank % visible GPUs, a stream each).
  enum class Device { cpu, cuda } device = Device::cpu;
  int gpus = 1;  // > 1: one GPU per rank (rank % gpus)
  // What carries the ranks' collectives on CUDA: automatic = NCCL when every rank has its own GPU (and
  // NCCL was built), else the host (shared memory or MPI).
  enum class Collectives { automatic, host, nccl } collectives = Collectives::automatic;
  // Where the float64 reference runs: automatic = on the GPU for the CUDA backend (the shard never
  // leaves the GPU; sweeps keep the CPU reference, which records the gradients for invariance).
  enum class Reference { automatic, cpu, gpu } reference = Reference::automatic;
  // Also run the control band's correct implementations on the same inputs (runner/control_band.hpp).
  bool control = false;
};

// Where one run executed (the report's "execution").
struct ExecutionInfo {
  std::string device = "cpu";
  int gpus = 0;
  std::string collectives = "host";
  std::string reference = "cpu";
};
// Resolves the options for a world of `world_size` ranks; throws CaseError for an impossible request
// (--collectives nccl with fewer GPUs than ranks) and InternalError when the GPUs or NCCL are missing.
ExecutionInfo resolve_execution(const RunOptions& options, int world_size);
// A plugin runs only the losses it declares: CaseError naming the case otherwise.
void require_supported(const Implementation& impl, const Case& c);
// The options an implementation runs under: a plugin declares its memory (a device-memory plugin runs on
// the GPUs, judged by the CPU reference). Throws CaseError for a request the plugin cannot meet.
RunOptions options_for(const Implementation& impl, const RunOptions& options);

struct RunTimings {
  double ranks_wall = 0.0;            // slowest rank's kernel, generation included
  double generate_max = 0.0;          // slowest rank's input generation
  double compute_max = 0.0;           // slowest rank's compute, collectives excluded
  double collectives_max = 0.0;       // slowest rank's time inside collectives
  double reference_and_checks = 0.0;  // slowest rank's verification
  double total = 0.0;
};

// A control of the control band (runner/control_band.hpp): lossverify's correct implementation on a run's
// own inputs, dtype and layout, and the margin it reaches on each check.
struct ControlRun {
  std::string name;                                     // what it computes in: float32, bf16 or fp16
  std::string implementation;                           // correct or correct-16bit
  std::vector<std::pair<std::string, double>> margins;  // by check name, checks it judged only
  double seconds = 0.0;
};

struct RunResult {
  Case the_case;
  const Implementation* implementation = nullptr;
  int ranks = 0;
  std::vector<CheckResult> checks;
  Verdict verdict = Verdict::pass;
  RunTimings timings;
  std::optional<LayoutSnapshot> snapshot;  // kept for sweeps
  ErrorMap error_map;                      // where the error sits (plots)
  ExecutionInfo execution;
  std::vector<std::string> hints;               // what probably caused a failure, when the inputs tell (check-dump)
  std::vector<std::int64_t> peak_rss_per_rank;  // one process per rank (MPI): each one's high-water mark
  std::vector<ControlRun> controls;             // the control band; empty when off
};

// The rows of one rank under the case's layout (global tokens and CP padding, micro-batch by micro-batch).
RankAssignment assign_rank(const Case& c, const GlobalBatch& batch, int world_rank);

// The communicators of a rank. TP group: same (cp, dp). Batch group (different tokens): same tp, or every rank where TP
// splits the tokens (layout.sp). DP group: same (tp, cp). CP group: same (tp, dp). Columns group (the ranks holding
// slices of the same rows): the TP group where TP splits columns, else the rank alone. Collective over the world.
struct OwnedRankGroups {
  std::unique_ptr<Communicator> tp, batch, dp, cp, columns;
  RankGroups view() { return RankGroups{*tp, *batch, *dp, *cp, columns ? *columns : *tp}; }
};
OwnedRankGroups make_rank_groups(Communicator& world, const Case& c);

// The ranks' outputs of one case on thread ranks, without checking them (tests use this directly).
struct RankRun {
  std::vector<RankOutput> outputs;
  double wall_seconds = 0.0;
};
RankRun execute_ranks(const Case& c, const InputSource& inputs, const Implementation& impl, const RunOptions& options);

// One rank's whole job, collective over `world`: its kernel, then distributed verification. Every rank
// returns the same merged checks and the timings' maxima over ranks. Backends call this from each rank
// (a thread, or an MPI process). `snapshot` is shared memory for sweeps on the thread backend.
struct RankJob {
  std::vector<CheckResult> checks;
  RunTimings timings;
  ErrorMap error_map;
  ExecutionInfo execution;
};
RankJob run_rank(const Case& c, const InputSource& inputs, const Implementation& impl, const RunOptions& options,
                 Communicator& world, int threads, LayoutSnapshot* snapshot = nullptr);

// Results of a case from the merged checks (shared by all backends).
RunResult assemble_result(const Case& c, const Implementation& impl, RankJob job);

class Launcher;  // runner/launcher.hpp

// Runs one case on the launcher's ranks (thread ranks by default). Throws CaseError for an unknown
// implementation, InternalError when a rank fails, TimeoutError when the deadlock guard fires (threads;
// under MPI a failing rank ends the job).
RunResult run_case(const Case& c, const RunOptions& options, bool keep_snapshot = false);
RunResult run_case(const Case& c, const RunOptions& options, Launcher& launcher, bool keep_snapshot = false);

// What run_case refuses before any rank starts (an unknown or inapplicable implementation, an invalid case,
// a fault rank outside the world, a world the launcher cannot hold, memory the machine does not have for
// thread ranks, an impossible execution); returns the options the implementation runs under.
RunOptions check_run(const Case& c, const RunOptions& options, bool keep_snapshot = false);
RunOptions check_run(const Case& c, const RunOptions& options, const Launcher& launcher, bool keep_snapshot = false);

// A case at several layouts and the invariance check between them.
struct SweepResult {
  std::vector<RunResult> runs;
  CheckResult invariance;
  Verdict verdict = Verdict::pass;
};
std::string layout_name(const LayoutSpec& layout);
// Largest input set the gate and sweeps keep in memory (bytes in the input dtype).
extern const std::size_t kMaterializeLimitBytes;
// Sweeps are bounded: at most kMaxSweepLayouts layouts, each of at most kMaxRanks ranks, all checked with
// check_run before the first runs. `progress` (optional) hears of each finished layout.
inline constexpr std::size_t kMaxSweepLayouts = 256;
inline constexpr std::int64_t kMaxRanks = 65536;
void check_sweep(const Case& c, const std::vector<LayoutSpec>& layouts, const RunOptions& options);
using SweepProgress = std::function<void(std::size_t done, std::size_t total, const RunResult& run)>;
SweepResult run_sweep(const Case& c, const std::vector<LayoutSpec>& layouts, const RunOptions& options,
                      const SweepProgress& progress = {});

}  // namespace lossverify
