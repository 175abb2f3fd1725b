#pragma once
// Host side of the GPU float64 reference (reference_kernels.hpp): verification calls these when a
// rank's shard stayed on its GPU (RankOutput::device_shard). No CUDA headers here.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/cuda/reference_kernels.hpp"
#include "lossverify/impl/rank_output.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify::cuda {

struct DeviceShard;
struct ReferenceWorkspace;

// The GPU reference's buffers for a shard of `rows` rows on `device`: a stream, the per-row inputs and
// outputs on the device, and page-locked host copies of both (a download into pageable memory is staged
// by the driver at about 1.3 GB/s: 2 ms for the comparisons of 16384 rows). The backend makes it while
// the GPU generates the inputs and hands it over with the shard (DeviceShard::workspace); the calls
// below make one where it is missing.
std::shared_ptr<ReferenceWorkspace> make_reference_workspace(int device, std::int64_t rows);

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
    if (c.loss.kind != LossKind::kd) labels[i] = inputs.label(t);
  }
}

// RowPartial's 8 doubles per row (rows whose valid flag is 0 get the empty partial): the launch enqueues
// the work on the workspace's stream and returns; the wait puts the results in `out`. A launch whose
// inputs match partials already in flight (gpu_reference_partials_start) does nothing.
void gpu_reference_partials_launch(const DeviceShard& shard, const Case& c, std::span<const std::int64_t> labels,
                                   std::span<const int> valid);
// The CUDA backend starts the partials as soon as its last loss kernel is enqueued, on the workspace's
// stream after the work `after` holds so far: they read only the inputs, and the host finishes the
// rank's compute stage meanwhile. `student` and `teacher` must stay allocated until the wait.
struct ShardView {
  int device = 0;
  StorageType type = StorageType::fp32;
  const void* student = nullptr;
  const void* teacher = nullptr;
  std::int64_t rows = 0, cols = 0, begin = 0;
};
void gpu_reference_partials_start(ReferenceWorkspace& workspace, const ShardView& shard, const Case& c,
                                  std::vector<std::int64_t> labels, std::vector<int> valid, void* after);
void gpu_reference_partials_wait(const DeviceShard& shard, std::span<double> out);
// KD: [value, error] per row of sum_v P_v (log P_v - log Q_v) over the shard.
std::vector<double> gpu_reference_kl(const DeviceShard& shard, const Case& c, const std::vector<double>& lse,
                                     const std::vector<double>& teacher_lse, const std::vector<int>& valid);

struct GpuCompareInputs {
  std::vector<int> kind;  // 0 valid token, 1 masked token, 2 CP padding
  std::vector<std::int64_t> labels;
  std::vector<double> lse, teacher_lse, weight;
  double atol = 0.0, rtol = 0.0;
  int max_ulp = 0;
  double framework_scale = 1.0, quantum = 0.0, grad_scale = 1.0, smallest_normal = 0.0;
};
// One RowComparison per row: the launch enqueues the comparison and returns; the wait returns the rows,
// in the shard's workspace (valid until its next comparison).
// lse_from_partials (whole rows, cross-entropy): each row's lse is taken on the device from the partials
// launched before, m + log(s + c), so the comparison can be queued before they are on the host; `in.lse`
// is then unused.
void gpu_reference_compare_launch(const DeviceShard& shard, const Case& c, const GpuCompareInputs& in,
                                  bool lse_from_partials);
std::span<const RowComparison> gpu_reference_compare_wait(const DeviceShard& shard);

}  // namespace lossverify::cuda
