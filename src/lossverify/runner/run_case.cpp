#include "lossverify/runner/run_case.hpp"

#include <omp.h>

#include <chrono>
#include <thread>

#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/cpu/vocab_parallel_cross_entropy.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify {

FaultInjection parse_fault(const std::string& text) {
  const auto at = text.find('@');
  FaultInjection f;
  const std::string kind = text.substr(0, at);
  if (at == std::string::npos || (kind != "throw" && kind != "hang")) {
    throw CaseError("--inject-fault " + text + ": expected throw@RANK or hang@RANK");
  }
  f.kind = kind == "throw" ? FaultInjection::Kind::throw_error : FaultInjection::Kind::hang;
  try {
    f.rank = std::stoi(text.substr(at + 1));
  } catch (const std::exception&) {
    throw CaseError("--inject-fault " + text + ": rank is not a number");
  }
  return f;
}

namespace {

using Clock = std::chrono::steady_clock;

void inject(const FaultInjection& fault, int rank) {
  if (fault.rank != rank) return;
  if (fault.kind == FaultInjection::Kind::throw_error) {
    throw InternalError("injected fault: this rank threw before its first collective");
  }
  if (fault.kind == FaultInjection::Kind::hang) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // never reaches a collective
  }
}

int resolved_threads(const RunOptions& options) {
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return options.threads > 0 ? options.threads : hardware;
}

}  // namespace

RankRun execute_ranks(const Case& c, const InputSource& inputs, const Implementation& impl, const RunOptions& options) {
  const auto start = Clock::now();
  const int world_size = c.layout.world_size();
  if (options.fault.kind != FaultInjection::Kind::none &&
      (options.fault.rank < 0 || options.fault.rank >= world_size)) {
    throw CaseError("--inject-fault: rank " + std::to_string(options.fault.rank) + " outside [0, " +
                    std::to_string(world_size) + ")");
  }
  CpuKernelOptions kernel_options;
  kernel_options.threads = std::max(1, resolved_threads(options) / world_size);

  RankRun run;
  run.outputs.resize(static_cast<std::size_t>(world_size));
  ThreadWorldOptions world_options;
  world_options.ranks = world_size;
  world_options.timeout_seconds = c.timeout_seconds;
  run_thread_ranks(world_options, [&](Communicator& world) {
    const int rank = world.rank();
    // TP is the only dimension so far: the world is the TP group, and each rank is alone in the group of
    // ranks holding different tokens (DP x CP), where valid-token counts and logged losses are summed.
    auto token_group = world.split(rank, 0);
    inject(options.fault, rank);
    RankAssignment assignment;
    assignment.world_rank = rank;
    assignment.tp_rank = rank;
    assignment.vocab = vocab_range(c.shape.vocab, c.layout.tp, rank);
    assignment.tokens.resize(static_cast<std::size_t>(c.shape.tokens));
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) assignment.tokens[static_cast<std::size_t>(t)] = t;
    run.outputs[static_cast<std::size_t>(rank)] = run_vocab_parallel_cross_entropy(
        c, inputs, std::move(assignment), world, *token_group, impl.bugs, kernel_options);
  });
  run.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return run;
}

RunResult run_case(const Case& c, const RunOptions& options) {
  const Implementation* impl = find_implementation(options.implementation);
  if (impl == nullptr) {
    throw CaseError("--impl " + options.implementation + ": unknown implementation (see `lossverify list`)");
  }
  const auto start = Clock::now();
  RunResult result;
  result.the_case = c;
  result.implementation = impl;
  result.ranks = c.layout.world_size();
  const Case& rc = result.the_case;
  const InputSource inputs(rc);
  const RankRun ranks = execute_ranks(rc, inputs, *impl, options);
  const auto ranks_done = Clock::now();
  result.timings.ranks_wall = ranks.wall_seconds;
  for (const RankOutput& out : ranks.outputs) {
    result.timings.generate_max = std::max(result.timings.generate_max, out.generate_seconds);
    result.timings.compute_max = std::max(result.timings.compute_max, out.compute_seconds);
    result.timings.collectives_max = std::max(result.timings.collectives_max, out.collective_seconds);
  }
  result.checks = verify(rc, inputs, ranks.outputs, resolved_threads(options));
  result.verdict = Verdict::pass;
  for (const CheckResult& check : result.checks) {
    if (check.verdict == Verdict::fail) result.verdict = Verdict::fail;
  }
  const auto end = Clock::now();
  result.timings.reference_and_checks = std::chrono::duration<double>(end - ranks_done).count();
  result.timings.total = std::chrono::duration<double>(end - start).count();
  return result;
}

}  // namespace lossverify
