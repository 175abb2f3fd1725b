#pragma once
// Plain-data interface between KD's CUDA rank (kd_cuda.cpp) and its kernels (kd_kernels.cu, compiled by nvcc).
// Nothing here includes CUDA or Eigen headers.
#include <cstdint>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

// KD pass 1, per row over the local columns with a = x/T, b = y/T: out rows x 8 floats
// [M_a, S_a = sum exp(a - M_a), M_b, S_b, W = sum exp(b - M_b)(b - a), U = sum exp(b - M_b)(a - M_a),
//  local argmax of a (as a float), 0].
struct KdStatsArgs {
  const void* student;
  const void* teacher;
  std::int64_t rows, cols;
  const int* active;
  float inverse_temperature;
};
void kd_stats(StorageType type, const KdStatsArgs& args, float* out, void* stream);

// KD pass 2: grad = weight * scale * (Q - P), Q = exp(a - lse_a), P = exp(b - lse_b); under the
// kd-untracked-allreduce bug g_j = P_r Q_j - P_j + [j = local argmax] P_r (1 - Q_r) with the shard's masses.
struct KdGradArgs {
  const void* student;
  const void* teacher;
  void* grad;
  std::int64_t rows, cols;
  const int* active;
  const float* lse_student;
  const float* lse_teacher;
  const float* weight;  // backward weight times T^(s-1)
  const float* argmax;  // local argmax of a (untracked bug)
  float inverse_temperature;
  int untracked_allreduce;
};
void kd_grad(StorageType type, const KdGradArgs& args, void* stream);

// Loads both KD kernels on the current device now, instead of at their first launch (as
// preload_cross_entropy_kernels does for cross-entropy's).
void preload_kd_kernels(StorageType type);

}  // namespace lossverify::cuda
