#pragma once
// Host side of the GPU float64 reference (reference_kernels.hpp): verification calls these when a
// rank's shard stayed on its GPU (RankOutput::device_shard). No CUDA headers here.
#include <cstdint>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/cuda/reference_kernels.hpp"

namespace lossverify::cuda {

struct DeviceShard;

// RowPartial's 8 doubles per row (rows whose valid flag is 0 are left at the empty partial).
std::vector<double> gpu_reference_partials(const DeviceShard& shard, const Case& c, const std::vector<std::int64_t>& labels,
                                           const std::vector<int>& valid);
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
std::vector<RowComparison> gpu_reference_compare(const DeviceShard& shard, const Case& c, const GpuCompareInputs& in);

}  // namespace lossverify::cuda
