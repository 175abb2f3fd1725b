#pragma once
// Host side of the GPU float64 reference (reference_kernels.hpp): verification calls these when a
// rank's shard stayed on its GPU (RankOutput::device_shard). No CUDA headers here.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/cuda/reference_kernels.hpp"

namespace lossverify::cuda {

struct DeviceShard;
struct ReferenceWorkspace;

// The GPU reference's buffers for a shard of `rows` rows on `device`: a stream, the per-row inputs and
// outputs on the device, and page-locked host copies of both (a download into pageable memory is staged
// by the driver at about 1.3 GB/s: 2 ms for the comparisons of 16384 rows). The backend makes it while
// the GPU generates the inputs and hands it over with the shard (DeviceShard::workspace); the calls
// below make one where it is missing.
std::shared_ptr<ReferenceWorkspace> make_reference_workspace(int device, std::int64_t rows);

// RowPartial's 8 doubles per row (rows whose valid flag is 0 get the empty partial): the launch enqueues
// the work on the workspace's stream and returns; the wait puts the results in `out`.
void gpu_reference_partials_launch(const DeviceShard& shard, const Case& c, std::span<const std::int64_t> labels,
                                   std::span<const int> valid);
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
// One RowComparison per row, in the shard's workspace (valid until its next comparison).
std::span<const RowComparison> gpu_reference_compare(const DeviceShard& shard, const Case& c, const GpuCompareInputs& in);

}  // namespace lossverify::cuda
