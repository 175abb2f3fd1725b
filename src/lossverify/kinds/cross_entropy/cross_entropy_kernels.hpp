#pragma once
// Plain-data interface between cross-entropy's CUDA rank (cross_entropy_cuda.cpp, the benchmarks) and its kernels
// (cross_entropy_kernels.cu, compiled by nvcc). Nothing here includes CUDA or Eigen headers.
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

// Loads the kernels a rank will launch on the current device now, instead of at their first launch (CUDA's lazy
// loading, about 1 ms per kernel): a rank calls it while its inputs are generated, so the compute stage times the
// kernels, not the loading of their code. Kernels of catalogued bugs' extra passes still load at their first
// launch. whole_rows (TP = 1): cross_entropy_fused's choice, which the logits' alignment and cols decide.
void preload_cross_entropy_kernels(StorageType type, const CrossEntropyConstants& constants, bool whole_rows,
                                   const void* logits, std::int64_t cols);

}  // namespace lossverify::cuda
