#include "lossverify/runner/run_case.hpp"

#include <omp.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "lossverify/comm/nccl_communicator.hpp"
#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/cpu/sharded_loss.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/impl/plugin/plugin_backend.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/oracle/cuda/device_oracle.hpp"
#include "lossverify/oracle/cuda/gpu_reference.hpp"
#include "lossverify/oracle/host_oracle.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/control_band.hpp"
#include "lossverify/runner/launcher.hpp"
#include "lossverify/runner/memory_estimate.hpp"

namespace lossverify {

FaultInjection parse_fault(const std::string& text) {
  const auto at = text.find('@');
  FaultInjection f;
  std::string kind = text.substr(0, at);
  if (kind.rfind("late-", 0) == 0) {
    f.late = true;
    kind = kind.substr(5);
  }
  if (at == std::string::npos || (kind != "throw" && kind != "hang" && kind != "exit")) {
    throw CaseError("--inject-fault " + text + ": expected [late-]throw@RANK, [late-]hang@RANK or [late-]exit@RANK");
  }
  f.kind = kind == "throw"  ? FaultInjection::Kind::throw_error
           : kind == "hang" ? FaultInjection::Kind::hang
                            : FaultInjection::Kind::exit;
  try {
    f.rank = std::stoi(text.substr(at + 1));
  } catch (const std::exception&) {
    throw CaseError("--inject-fault " + text + ": rank is not a number");
  }
  return f;
}

namespace {

using Clock = std::chrono::steady_clock;

void inject(const FaultInjection& fault, int rank, bool late) {
  if (fault.rank != rank || fault.late != late) return;
  if (fault.kind == FaultInjection::Kind::throw_error) {
    throw InternalError(late ? "injected fault: this rank threw after its groups were set up, before its kernel"
                             : "injected fault: this rank threw before its first collective");
  }
  if (fault.kind == FaultInjection::Kind::hang) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // never reaches a collective
  }
  if (fault.kind == FaultInjection::Kind::exit) std::exit(9);  // the process goes away mid-run
}

int resolved_threads(const RunOptions& options) {
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return options.threads > 0 ? options.threads : hardware;
}

}  // namespace

RankAssignment assign_rank(const Case& c, const GlobalBatch& batch, int world_rank) {
  RankAssignment a;
  a.world_rank = world_rank;
  a.coordinates = coordinates_of(world_rank, c.layout);
  const bool split_columns = tp_splits_columns(c);
  a.vocab = split_columns ? vocab_range(c.shape.vocab, c.layout.tp, a.coordinates.tp) : VocabRange{0, c.shape.vocab};
  const std::int64_t pad_multiple = 2 * static_cast<std::int64_t>(c.layout.cp);
  for (int k = 0; k < c.layout.ga; ++k) {
    a.micro_batch_begin.push_back(static_cast<std::int64_t>(a.rows.size()));
    const auto sequences = sequences_of_slot(batch, c.batch, c.layout, a.coordinates.dp, k);
    auto rows = zigzag_rows(batch, sequences, c.layout.cp, a.coordinates.cp, pad_multiple);
    if (!split_columns && c.layout.sp) rows = sequence_parallel_part(rows, c.layout.tp, a.coordinates.tp);
    a.rows.insert(a.rows.end(), rows.begin(), rows.end());
  }
  a.micro_batch_begin.push_back(static_cast<std::int64_t>(a.rows.size()));
  return a;
}

OwnedRankGroups make_rank_groups(Communicator& world, const Case& c) {
  const LayoutSpec& layout = c.layout;
  const RankCoordinates at = coordinates_of(world.rank(), layout);
  OwnedRankGroups g;
  g.tp = world.split(at.dp * layout.cp + at.cp, at.tp);
  const bool tokens_split_by_tp = !tp_splits_columns(c) && layout.sp;
  g.batch = world.split(tokens_split_by_tp ? 0 : at.tp, world.rank());
  g.dp = world.split(at.cp * layout.tp + at.tp, at.dp);
  g.cp = world.split(at.dp * layout.tp + at.tp, at.cp);
  if (!tp_splits_columns(c)) g.columns = world.split(world.rank(), 0);
  return g;
}

void check_fault_rank(const FaultInjection& fault, int world_size) {
  if (fault.kind != FaultInjection::Kind::none && (fault.rank < 0 || fault.rank >= world_size)) {
    throw CaseError("--inject-fault: rank " + std::to_string(fault.rank) + " outside [0, " +
                    std::to_string(world_size) + ")");
  }
}

void require_supported(const Implementation& impl, const Case& c) {
  if (applies_to(impl, c.loss)) return;
  if (impl.plugin != nullptr && applies_to(impl, c.loss.kind)) {
    throw CaseError(c.source + ": the plugin " + impl.name + " does not implement " +
                    missing_plugin_capability(*impl.plugin, c.loss));
  }
  if (impl.plugin != nullptr) {
    throw CaseError(c.source + ": the plugin " + impl.name + " does not compute " +
                    std::string(to_string(c.loss.kind)) +
                    " losses (its lv_plugin.losses, or the kinds its " LV_PLUGIN_NAMES_ENTRY_POINT "() names)");
  }
  throw CaseError(c.source + ": --impl " + impl.name + " is a bug of " + applies_in_words(impl.applies) +
                  " losses, and this case is " + std::string(to_string(c.loss.kind)) +
                  ": not applicable (the gate records such pairs as not run)");
}

// A kind without a CUDA implementation, or one the GPU oracle cannot evaluate, is refused before any work.
// Whether the GPU oracle can evaluate the case's kind: through a row model, or the kind's own GPU oracle.
bool has_gpu_oracle(const Case& c) {
  const LossKind& kind = kind_of(c.loss);
  if (c.loss.stage != nullptr) return cuda::cuda_stage_oracle_factory(c) != nullptr;  // the stage's own, if any
  return kind.device_row_model(c).has_value() || cuda::cuda_oracle_factory(kind.name()) != nullptr;
}

void require_kind_support(const Case& c, const RunOptions& options) {
  const LossKind& kind = kind_of(c.loss);
  if (c.loss.stage != nullptr && options.device == RunOptions::Device::cuda && cuda::built_with_cuda() &&
      !cuda::runs_stage(c.loss.stage->name())) {
    throw CaseError(c.source + ": --backend cuda: the stage " + std::string(c.loss.stage->name()) +
                    " has no CUDA implementation (use the CPU backend)");
  }
  if (options.device != RunOptions::Device::cuda) return;
  if (cuda::built_with_cuda() && !cuda::runs_kind(kind.name())) {
    throw CaseError(c.source + ": --backend cuda: loss kind " + std::string(kind.name()) +
                    " has no CUDA implementation (use the CPU backend)");
  }
  if (options.reference == RunOptions::Reference::gpu && !has_gpu_oracle(c)) {
    const std::string behind =
        c.loss.stage != nullptr ? " behind the stage " + std::string(c.loss.stage->name()) : std::string();
    throw CaseError(c.source + ": --reference gpu: the GPU oracle cannot evaluate loss kind " +
                    std::string(kind.name()) + behind + " (use --reference cpu)");
  }
}

RunOptions options_for(const Implementation& impl, const RunOptions& options) {
  if (impl.plugin == nullptr) return options;
  RunOptions effective = options;
  if (!impl.plugin->device_memory()) {
    if (options.device == RunOptions::Device::cuda) {
      throw CaseError("--backend cuda: the plugin " + impl.name +
                      " computes in host memory (a plugin declares where it runs)");
    }
    return effective;
  }
  if (options.reference == RunOptions::Reference::gpu) {
    throw CaseError("--reference gpu: a plugin's outputs are judged by the CPU reference");
  }
  effective.device = RunOptions::Device::cuda;
  effective.reference = RunOptions::Reference::cpu;
  return effective;
}

ExecutionInfo resolve_execution(const RunOptions& options, int world_size) {
  ExecutionInfo info;
  if (options.device != RunOptions::Device::cuda) {
    if (options.collectives == RunOptions::Collectives::nccl) {
      throw CaseError("--collectives nccl needs --backend cuda");
    }
    if (options.reference == RunOptions::Reference::gpu) throw CaseError("--reference gpu needs --backend cuda");
    return info;
  }
  info.device = "cuda";
  if (options.reference != RunOptions::Reference::cpu) info.reference = "gpu";
  const int visible = cuda::visible_devices();
  if (options.gpus > visible) {
    throw InternalError("--gpus " + std::to_string(options.gpus) + ": only " + std::to_string(visible) +
                        " CUDA GPU(s) visible");
  }
  info.gpus = std::max(1, std::min(options.gpus, world_size));
  const bool own_gpu = options.gpus >= world_size && world_size > 1;
  switch (options.collectives) {
    case RunOptions::Collectives::host:
      break;
    case RunOptions::Collectives::nccl:
      if (!cuda::built_with_nccl()) {
        throw InternalError("--collectives nccl: this build has no NCCL (not found at configure time)");
      }
      if (!own_gpu) {
        throw CaseError("--collectives nccl: NCCL needs one GPU per rank: " + std::to_string(world_size) + " ranks, " +
                        std::to_string(options.gpus) + " GPU(s) (use --gpus)");
      }
      info.collectives = "nccl";
      break;
    case RunOptions::Collectives::automatic:
      if (own_gpu && cuda::built_with_nccl()) info.collectives = "nccl";
      break;
  }
  return info;
}

RankRun execute_ranks(const Case& c, const InputSource& inputs, const Implementation& impl, const RunOptions& options) {
  check_case(c);
  const auto start = Clock::now();
  const int world_size = c.layout.world_size();
  check_fault_rank(options.fault, world_size);
  CpuKernelOptions kernel_options;
  kernel_options.threads = std::max(1, resolved_threads(options) / world_size);

  RankRun run;
  run.outputs.resize(static_cast<std::size_t>(world_size));
  ThreadWorldOptions world_options;
  world_options.ranks = world_size;
  world_options.timeout_seconds = c.timeout_seconds;
  run_thread_ranks(world_options, [&](Communicator& world) {
    const int rank = world.rank();
    OwnedRankGroups groups = make_rank_groups(world, c);
    inject(options.fault, rank, false);
    inject(options.fault, rank, true);
    run.outputs[static_cast<std::size_t>(rank)] =
        run_sharded_loss(c, inputs, assign_rank(c, inputs.batch(), rank), groups.view(), impl.bugs, kernel_options);
  });
  run.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return run;
}

RankJob run_rank(const Case& c, const InputSource& inputs, const Implementation& impl, const RunOptions& requested,
                 Communicator& world, int threads, LayoutSnapshot* snapshot) {
  const auto start = Clock::now();
  const RunOptions options = options_for(impl, requested);
  const int rank = world.rank();
  OwnedRankGroups owned = make_rank_groups(world, c);
  inject(options.fault, rank, false);
  ExecutionInfo execution = resolve_execution(options, world.size());
  const int device = execution.gpus > 1 ? rank % execution.gpus : 0;
  // NCCL groups over the host groups (one GPU per rank); they outlive the verification below, whose
  // collectives travel over them too. Their endpoints are kept for the next run of the same groups. A group
  // of one keeps its host communicator: its collectives are copies, and NCCL would only cost its setup.
  std::unique_ptr<Communicator> nccl_tp, nccl_batch, nccl_dp;
  if (execution.collectives == "nccl") {
    const auto over_nccl = [&](Communicator& host, cuda::NcclRole role) -> std::unique_ptr<Communicator> {
      if (host.size() == 1) return nullptr;
      return cuda::make_nccl_group(host, device, c.timeout_seconds, role);
    };
    nccl_tp = over_nccl(*owned.tp, cuda::NcclRole::tp);
    nccl_batch = over_nccl(*owned.batch, cuda::NcclRole::batch);
    nccl_dp = over_nccl(*owned.dp, cuda::NcclRole::dp);
  }
  // The CP group carries only a policy loss's per-sequence sums (a few floats per micro-batch): host always.
  Communicator& tp = nccl_tp ? *nccl_tp : *owned.tp;
  RankGroups groups{tp, nccl_batch ? *nccl_batch : *owned.batch, nccl_dp ? *nccl_dp : *owned.dp, *owned.cp,
                    owned.columns ? *owned.columns : tp};
  inject(options.fault, rank, true);
  CpuKernelOptions kernel_options;
  kernel_options.threads = threads;
  RankOutput out;
  std::shared_ptr<cuda::OracleShard> gpu_oracle;
  std::unique_ptr<cuda::CudaKindOracle> kind_oracle;  // a kind's own GPU oracle (kind_api/cuda_kind.hpp)
  PluginSession plugin_session;                       // a plugin's host stays until the rank's checks are done
  if (impl.plugin != nullptr) {
    out = run_plugin_rank(*impl.plugin, c, inputs, assign_rank(c, inputs.batch(), rank), groups,
                          PluginRankOptions{device, threads, c.timeout_seconds}, plugin_session);
  } else if (options.device == RunOptions::Device::cuda) {
    cuda::CudaRankOptions device_options;
    device_options.device = device;
    if (execution.reference == "gpu" && snapshot != nullptr) {
      if (options.reference == RunOptions::Reference::gpu) {
        throw CaseError("--reference gpu: sweeps compare layouts' gradients on the host; use the CPU reference");
      }
      execution.reference = "cpu";
    }
    if (!has_gpu_oracle(c)) execution.reference = "cpu";  // the GPU oracle cannot evaluate it
    device_options.keep_on_device = execution.reference == "gpu";
    RankAssignment assignment = assign_rank(c, inputs.batch(), rank);
    // The GPU oracle first: its own copy of the inputs is generated on its stream while the implementation
    // generates and computes on its own. The two never share a buffer.
    if (device_options.keep_on_device) {
      const cuda::CudaOracleFactory own = c.loss.stage != nullptr ? cuda::cuda_stage_oracle_factory(c)
                                                                  : cuda::cuda_oracle_factory(kind_of(c.loss).name());
      if (own != nullptr) {
        kind_oracle = own(c, inputs, assignment, device);
      } else {
        gpu_oracle = cuda::make_oracle_shard(c, inputs, assignment, device);
      }
    }
    out = cuda::run_sharded_loss(c, inputs, std::move(assignment), groups, impl.bugs, device_options);
  } else {
    out = run_sharded_loss(c, inputs, assign_rank(c, inputs.batch(), rank), groups, impl.bugs, kernel_options);
  }
  const auto kernel_done = Clock::now();
  RankJob job;
  job.execution = execution;
  // The oracle judges the rank's outputs read-only; the GPU oracle where the gradient stayed on the GPU.
  const GradJudgement judgement = grad_judgement(c, inputs.valid_tokens(), out.dtype);
  std::unique_ptr<Oracle> oracle =
      kind_oracle  ? kind_oracle->judge(out, judgement)
      : gpu_oracle ? cuda::make_device_oracle(c, inputs, std::move(gpu_oracle), out, judgement, groups.tp.size() == 1)
                   : std::make_unique<HostOracle>(c, inputs, out, judgement, threads);
  job.checks = verify_rank(c, out, *oracle, groups, world, snapshot, &job.error_map);
  plugin_session.finish();  // a collective after run_rank returned, or a host that ended, fails the rank
  const auto end = Clock::now();
  double t[6] = {std::chrono::duration<double>(kernel_done - start).count(),
                 out.generate_seconds,
                 out.compute_seconds,
                 out.collective_seconds,
                 std::chrono::duration<double>(end - kernel_done).count(),
                 std::chrono::duration<double>(end - start).count()};
  world.allreduce_max(std::span<double>(t, 6));
  job.timings = {t[0], t[1], t[2], t[3], t[4], t[5]};
  return job;
}

RunResult assemble_result(const Case& c, const Implementation& impl, RankJob job) {
  RunResult result;
  result.the_case = c;
  result.implementation = &impl;
  result.ranks = c.layout.world_size();
  result.checks = std::move(job.checks);
  result.timings = job.timings;
  result.error_map = std::move(job.error_map);
  result.execution = job.execution;
  result.verdict = Verdict::pass;
  for (const CheckResult& check : result.checks) {
    if (check.verdict == Verdict::fail) result.verdict = Verdict::fail;
  }
  return result;
}

RunOptions check_run(const Case& c, const RunOptions& requested, const Launcher& launcher, bool keep_snapshot) {
  const Implementation* impl = find_implementation(requested.implementation);
  if (impl == nullptr) {
    throw CaseError("--impl " + requested.implementation + ": unknown implementation (see `lossverify list`)");
  }
  require_supported(*impl, c);
  const RunOptions options = options_for(*impl, requested);
  if (impl->bugs.compute_in_input_dtype && options.device == RunOptions::Device::cuda) {
    throw CaseError("--impl " + impl->name + ": the 16-bit control runs on the CPU backend only (--backend cpu)");
  }
  require_kind_support(c, options);
  check_case(c);
  const int world_size = c.layout.world_size();
  check_fault_rank(options.fault, world_size);
  launcher.check_world(c);
  if (options.device == RunOptions::Device::cuda) {
    try {
      cuda::require_device(0);
    } catch (const InternalError& e) {
      if (impl->plugin == nullptr) throw;
      throw CaseError("--impl " + impl->name +
                      ": the plugin computes in CUDA device memory, and this machine "
                      "cannot run it: " +
                      e.what());
    }
  } else if (launcher.processes() == 1) {
    require_memory(c, keep_snapshot);
  }
  resolve_execution(options, world_size);
  if (requested.control) check_controls(c, requested, launcher);
  return options;
}

RunOptions check_run(const Case& c, const RunOptions& requested, bool keep_snapshot) {
  return check_run(c, requested, *thread_launcher(), keep_snapshot);
}

RunResult run_case(const Case& c, const RunOptions& requested, Launcher& launcher, bool keep_snapshot) {
  const RunOptions options = check_run(c, requested, launcher, keep_snapshot);
  const Implementation* impl = find_implementation(requested.implementation);
  const auto start = Clock::now();
  const int world_size = c.layout.world_size();
  std::optional<InputSource> own_inputs;
  if (options.shared_inputs == nullptr) own_inputs.emplace(c);
  const InputSource& inputs = options.shared_inputs != nullptr ? *options.shared_inputs : *own_inputs;
  LayoutSnapshot snapshot;
  if (keep_snapshot)
    snapshot = LayoutSnapshot::sized_for(c.shape.tokens, c.shape.vocab,
                                         c.loss.stage == nullptr || !c.loss.stage->logit_gradient_internal());
  const int threads = launcher.threads_per_rank(options.threads, world_size);
  const bool rank_per_process = launcher.processes() > 1;
  RankJob kept;
  std::vector<std::int64_t> rss_per_rank;
  launcher.run(world_size, c.timeout_seconds, [&](Communicator& world) {
    RankJob job = run_rank(c, inputs, *impl, options, world, threads, keep_snapshot ? &snapshot : nullptr);
    if (rank_per_process) {
      // Every rank's high-water mark: with distributed verification it falls as 1/R with the shard.
      const std::int64_t rss = peak_resident_bytes();
      rss_per_rank.resize(static_cast<std::size_t>(world.size()));
      world.all_gather(&rss, rss_per_rank.data(), sizeof(rss));
    }
    if (launcher.keeps(world.rank())) kept = std::move(job);
  });
  RunResult result = assemble_result(c, *impl, std::move(kept));
  result.timings.total = std::chrono::duration<double>(Clock::now() - start).count();
  result.peak_rss_per_rank = std::move(rss_per_rank);
  if (keep_snapshot) result.snapshot = std::move(snapshot);
  if (options.control) result.controls = run_controls(c, options, launcher, result);
  return result;
}

RunResult run_case(const Case& c, const RunOptions& options, bool keep_snapshot) {
  return run_case(c, options, *thread_launcher(), keep_snapshot);
}

const std::size_t kMaterializeLimitBytes = std::size_t{1} << 30;

std::string layout_name(const LayoutSpec& l) {
  return "tp" + std::to_string(l.tp) + (l.sp ? "-sp" : "") + "-cp" + std::to_string(l.cp) + "-dp" +
         std::to_string(l.dp) + "-ga" + std::to_string(l.ga);
}

// Every layout is checked before the first one runs: a sweep fails at once or not for its layouts.
void check_sweep(const Case& c, const std::vector<LayoutSpec>& layouts, const RunOptions& options) {
  if (layouts.size() > kMaxSweepLayouts) {
    throw CaseError(c.source + ": the sweep has " + std::to_string(layouts.size()) + " layouts; at most " +
                    std::to_string(kMaxSweepLayouts) + " run in one command (split it)");
  }
  for (const LayoutSpec& layout : layouts) {
    if (layout.sp && !sequence_parallel_applies(c)) {
      throw CaseError(c.source + ": sweep layout " + layout_name(layout) + ": sp " + sequence_parallel_refusal(c));
    }
    if (std::int64_t{layout.tp} * layout.cp * layout.dp > kMaxRanks) {
      throw CaseError(c.source + ": sweep layout " + layout_name(layout) + ": tp * cp * dp exceeds " +
                      std::to_string(kMaxRanks) + " ranks");
    }
    Case at = c;
    at.layout = layout;
    try {
      check_run(at, options, true);
    } catch (const CaseError& e) {
      throw CaseError("sweep layout " + layout_name(layout) + ": " + e.what());
    }
  }
}

SweepResult run_sweep(const Case& c, const std::vector<LayoutSpec>& layouts, const RunOptions& options,
                      const SweepProgress& progress) {
  check_sweep(c, layouts, options);
  SweepResult sweep;
  InvarianceCheck invariance(c);
  std::optional<InputSource> own_inputs;
  RunOptions shared = options;
  if (shared.shared_inputs == nullptr) {
    own_inputs.emplace(c);
    own_inputs->materialize(resolved_threads(options), kMaterializeLimitBytes);
    shared.shared_inputs = &*own_inputs;
  }
  for (const LayoutSpec& layout : layouts) {
    Case at = c;
    at.layout = layout;
    RunResult r = run_case(at, shared, true);
    invariance.add(std::move(*r.snapshot), layout_name(layout), kind_of(c.loss).invariance_class(layout));
    r.snapshot.reset();
    if (r.verdict == Verdict::fail) sweep.verdict = Verdict::fail;
    if (progress) progress(sweep.runs.size() + 1, layouts.size(), r);
    sweep.runs.push_back(std::move(r));
  }
  sweep.invariance = invariance.result();
  if (sweep.invariance.verdict == Verdict::fail) sweep.verdict = Verdict::fail;
  return sweep;
}

}  // namespace lossverify
