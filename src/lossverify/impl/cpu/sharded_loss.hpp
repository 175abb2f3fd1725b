#pragma once
#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

struct CpuKernelOptions {
  int threads = 1;  // OpenMP threads inside this rank
};

// One rank of the sharded loss (docs/spec.md §5), computing in float32 from the input dtype. The rank generates
// exactly its own shard, counts valid tokens over the batch group, then for every micro-batch:
//   cross-entropy: M = allreduce_max(local max); one packed allreduce_sum of [S, x_l - M, sum(x - M)];
//                  loss from the sums without log(p); gradient of the local columns from p = exp(x - lse)
//   KD:            max of student and teacher in one all-reduce; one packed allreduce_sum of
//                  [S_student, S_teacher, sum exp(b - M_b)(b - a)]; KL without log(P); gradient T^(s-1)(Q - P)
// Each token's gradient is scaled so that the framework model (grad_reduce, ga_reduce) makes it the
// gradient of the global objective; the logged loss and valid-token count are reduced over the batch group.
// `bugs` selects a catalogued deviation.
RankOutput run_sharded_loss(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                            const BugSwitches& bugs, const CpuKernelOptions& options);

}  // namespace lossverify
