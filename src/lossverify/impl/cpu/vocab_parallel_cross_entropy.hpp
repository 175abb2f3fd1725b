#pragma once
#include "lossverify/case/case.hpp"
#include "lossverify/comm/communicator.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_output.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify {

struct CpuKernelOptions {
  int threads = 1;  // OpenMP threads inside this rank
};

// SPEC 5 vocab-parallel cross-entropy on one rank, computing in float32 from the input dtype:
//   1. M = allreduce_max(max_local x)                    (tp_group)
//   2. one packed allreduce_sum of [S, x_l - M, Z]       (tp_group; Z only when smoothing is on)
//   3. per-token loss from the sums; valid-token count and reduced loss over token_group
//   4. gradient of the local columns from p = exp(x - lse), no communication
// The rank generates exactly its own shard. `bugs` selects a catalogued deviation.
RankOutput run_vocab_parallel_cross_entropy(const Case& c, const InputSource& inputs, RankAssignment assignment,
                                            Communicator& tp_group, Communicator& token_group,
                                            const BugSwitches& bugs, const CpuKernelOptions& options);

}  // namespace lossverify
