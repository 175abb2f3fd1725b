#pragma once
// Plain-data interface between the host side of the CUDA backend (compiled by the C++ compiler) and the
// kernels (compiled by nvcc). Nothing here includes CUDA or Eigen headers.
#include <cstdint>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

// Cross-entropy constants shared by every row.
struct CrossEntropyConstants {
  float q_on_forward, q_off_forward;    // target distribution in the forward
  float q_on_backward, q_off_backward;  // and in the backward (they differ under catalogued bugs)
  float z_loss_weight;
  float softcap;                   // 0: off
  int no_max_shift;                // catalogued: exp(x) without the max
  int zloss_grad_after_smoothing;  // catalogued: (p - q)(1 + 2 w_z lse)
  int grad_rounded_early;          // catalogued: rounded to the output dtype before the row weight
};

// Pass 1, per row: the local max M_r, S_r = sum exp(x - M_r), Z_r = sum (x - M_r) and the target logit
// x_l (when the row's target column is local). out: rows x 4 floats [M_r, S_r, Z_r, x_l].
struct StatsArgs {
  const void* logits;
  std::int64_t rows, cols;
  const std::int64_t* target_column;  // local column of the label, or -1
  const int* active;                  // rows that get a loss
};
void cross_entropy_stats(StorageType type, const StatsArgs& args, const CrossEntropyConstants& k, float* out,
                         void* stream);

// Pass 2, per row: the gradient of the local columns from the global M and log S.
struct GradArgs {
  const void* logits;
  void* grad;
  std::int64_t rows, cols;
  const std::int64_t* target_column;
  const int* active;     // inactive rows get exact zeros
  const int* valid;      // active but not valid (zloss-on-ignored): 2 w_z lse p only
  const float* row_max;  // global M
  const float* log_sum;  // global log S
  const float* weight;   // backward weight of each row
};
void cross_entropy_grad(StorageType type, const GradArgs& args, const CrossEntropyConstants& k, void* stream);

// The catalogued overwrites-input, after the loss kernels: each active row's softmax p = exp(x - M - log S)
// written over its own logits, then copied into its gradient (a pass of its own, so that the loss kernels
// carry no branch for it).
struct SoftmaxInPlaceArgs {
  void* logits;
  void* grad;
  std::int64_t rows, cols;
  const int* active;
  const float* row_max;  // global M
  const float* log_sum;  // global log S
};
void cross_entropy_softmax_in_place(StorageType type, const SoftmaxInPlaceArgs& args, float softcap, void* stream);

// Both passes in one kernel for a rank that holds whole rows (TP = 1), so DRAM sees about 4 bytes per
// bf16 logit. Writes per-row [M, log S, Z, x_l].
void cross_entropy_fused(StorageType type, const GradArgs& args, const CrossEntropyConstants& k, float* row_stats,
                         void* stream);
// Rows longer than 64 KB that fit in the registers of a cluster of up to 8 CTAs take a row-resident
// kernel (each logit read from DRAM once, whatever L2 holds); this is its cluster size, 0 where the
// two-pass kernel serves the rows.
int fused_cluster_size(StorageType type, const CrossEntropyConstants& k, const void* logits, const void* grad,
                       std::int64_t cols);

// Catalogued bug smoothing-log-after-exp, a third pass: per row sum_v log(exp(x_v - M) / S) over the
// local columns with the global M and S (-inf once exp underflows), as the CPU kernel computes it.
struct SumLogProbArgs {
  const void* logits;
  std::int64_t rows, cols;
  const int* active;
  const float* row_max;  // global M
  const float* sum_exp;  // global S
};
void cross_entropy_sum_log_p(StorageType type, const SumLogProbArgs& args, const CrossEntropyConstants& k, float* out,
                             void* stream);

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

// Loads the loss kernels a rank will launch on the current device now, instead of at their first
// launch (CUDA's lazy loading, about 1 ms per kernel): a rank calls it while its inputs are generated,
// so the compute stage times the kernels, not the loading of their code. Kernels of catalogued bugs'
// extra passes still load at their first launch.
struct KernelChoice {
  bool kd = false;
  bool whole_rows = false;  // TP = 1: cross_entropy_fused
  CrossEntropyConstants constants{};
  const void* logits = nullptr;  // the rank's logits (their alignment decides the row-resident kernel)
  std::int64_t cols = 0;
};
void preload_kernels(StorageType type, const KernelChoice& choice);

// Device properties the host needs; false (with a reason) when no usable device exists.
bool device_available(int device, char* reason, int reason_size);
int device_count();

}  // namespace lossverify::cuda
