#pragma once
// Host side of the GPU float64 reference (reference_kernels.hpp), the GPU oracle: verification calls these
// when a rank's gradient stayed on its GPU (RankOutput::device_shard). The oracle generates and owns its
// inputs; it reads nothing of the rank but its gradient. No CUDA headers here.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/oracle/cuda/reference_kernels.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::cuda {

struct DeviceShard;
struct OracleShard;

// The GPU oracle's own copy of a rank's inputs: the rank's columns of every row, generated on `device` from
// the case's Philox streams into buffers that no implementation ever sees, and its workspace (a stream, the
// per-row buffers, page-locked host copies). The generation is enqueued on the workspace's stream and runs
// while the caller goes on (the runner makes the oracle before it runs the implementation); the calls
// below queue behind it.
std::shared_ptr<OracleShard> make_oracle_shard(const Case& c, const InputSource& inputs,
                                               const RankAssignment& assignment, int device);

// The reference's per-row inputs, from the case's inputs and never from the rank plan: each row's valid
// flag and label (-1 where the row is no valid token, and for KD).
inline void reference_rows(const Case& c, const InputSource& inputs, const RankAssignment& assignment,
                           std::vector<std::int64_t>& labels, std::vector<int>& valid) {
  const std::size_t rows = assignment.rows.size();
  labels.assign(rows, -1);
  valid.assign(rows, 0);
  for (std::size_t i = 0; i < rows; ++i) {
    const std::int64_t t = assignment.rows[i].token;
    if (t < 0 || !inputs.is_valid(t)) continue;
    valid[i] = 1;
    if (kind_of(c.loss).inputs().labels) labels[i] = inputs.label(t);
  }
}

// RowPartial's 8 doubles per row (rows whose valid flag is 0 get the empty partial), from the oracle's own
// inputs: the launch enqueues the work and returns; the wait puts the results in `out`.
void gpu_reference_partials_launch(OracleShard& oracle, const Case& c, std::span<const std::int64_t> labels,
                                   std::span<const int> valid);
void gpu_reference_partials_wait(OracleShard& oracle, std::span<double> out);
// A kind with a value pass: [value, error] per row of sum_v P_v (log P_v - log Q_v) over the shard (KD), or of
// sum_v p_v log p_v (the row-coefficient model; teacher_lse unused).
std::vector<double> gpu_reference_kl(OracleShard& oracle, const Case& c, const std::vector<double>& lse,
                                     const std::vector<double>& teacher_lse, const std::vector<int>& valid);

struct GpuCompareInputs {
  std::vector<int> kind;  // 0 valid token, 1 masked token, 2 CP padding
  std::vector<std::int64_t> labels;
  std::vector<double> lse, teacher_lse, weight;
  std::vector<double> coef_a, coef_b, row_scale;  // the row-coefficient model's (DeviceRowModel), else empty
  double atol = 0.0, rtol = 0.0;
  int max_ulp = 0;
  double framework_scale = 1.0, quantum = 0.0, grad_scale = 1.0, smallest_normal = 0.0;
  // A kind's own GPU oracle: the expected gradient (and its slack) of the shard's rows on the device, rows x cols
  // float64 (ReferenceCompareArgs::expected); the row model is then not read.
  const double* expected = nullptr;
  const double* slack = nullptr;
};
// The oracle shard's own copy of the rank's logits on its device, and its stream (a kind's own GPU oracle launches
// its kernels there, behind the generation).
const void* oracle_shard_logits(const OracleShard& oracle);
void* oracle_shard_stream(OracleShard& oracle);
// One RowComparison per row of the rank's gradient `output` (read only) against the reference computed from
// the oracle's inputs: the launch enqueues the comparison and returns; the wait returns the rows, in the
// oracle's workspace (valid until its next comparison).
// lse_from_partials (whole rows, cross-entropy): each row's lse is taken on the device from the partials
// launched before, m + log(s + c), so the comparison can be queued before they are on the host; `in.lse`
// is then unused.
void gpu_reference_compare_launch(OracleShard& oracle, const DeviceShard& output, const Case& c,
                                  const GpuCompareInputs& in, bool lse_from_partials);
std::span<const RowComparison> gpu_reference_compare_wait(OracleShard& oracle);

}  // namespace lossverify::cuda
