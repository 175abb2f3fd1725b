#pragma once
// The float64 reference on the GPU, plain-data interface (no CUDA headers): the same definitions as
// reference/loss_reference.cpp (docs/spec.md §3), evaluated where a rank's shard lives, so a case too large for
// the CPU is still checked element by element. Sums are compensated (Neumaier) per thread and combined
// in thread order, so the results do not depend on scheduling.
#include <cstddef>
#include <cstdint>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

// Per row over the shard's columns [begin, begin + cols): RowPartial's 8 doubles
// [max, sum_exp, sum_exp_error, sum_qx, sum_qx_error, teacher_max, teacher_sum_exp, teacher_sum_exp_error].
struct ReferencePartialArgs {
  const void* student;
  const void* teacher;  // KD only
  std::int64_t rows, cols, begin;
  const int* valid;           // rows to evaluate (others get the empty partial: -inf, 0, 0, 0, 0, -inf, 0, 0)
  const std::int64_t* label;  // global label per row (cross-entropy)
  int kd;
  int row_coefficients;        // the policy loss's row model: no code tables
  double inverse_temperature;  // KD and the row-coefficient model (x / T); 1 for cross-entropy
  double softcap;              // cross-entropy: 0 = off
  double q_on, q_off;          // cross-entropy target weights: q_v = v == label ? q_on : q_off
};
void reference_partials(StorageType type, const ReferencePartialArgs& args, double* out, void* stream);

// KD, per row: sum_v P_v (log P_v - log Q_v) over the shard, compensated: [value, error]. With `entropy`
// (the row-coefficient model) sum_v p_v log p_v of the student's x / T instead (the teacher unused).
struct ReferenceKlArgs {
  const void* student;
  const void* teacher;
  std::int64_t rows, cols;
  const int* valid;
  const double* lse;          // student log-sum-exp of x/T, per row
  const double* teacher_lse;  // teacher log-sum-exp of y/T, per row
  double inverse_temperature;
  int entropy;
};
void reference_kl(StorageType type, const ReferenceKlArgs& args, double* out, void* stream);

// Element-by-element comparison of the rank's gradient with the reference gradient, judged as
// checks.cpp's GradJudge does, with per-row statistics for the host to merge.
struct ReferenceCompareArgs {
  const void* student;
  const void* teacher;
  const void* grad;  // the rank's gradient, in the storage type
  std::int64_t rows, cols, begin;
  const int* kind;            // per row: 0 valid token, 1 masked token (expected 0), 2 CP padding (must be exactly 0)
  const std::int64_t* label;  // cross-entropy
  const double* lse;          // per row
  // Whole rows (TP = 1), cross-entropy: per row the partials kernel's 8 doubles, and the row's lse taken
  // from them on the device, m + log(s + c), as the host's combine takes it; `lse` is then unused.
  const double* partials;
  const double* teacher_lse;  // KD
  const double* weight;       // per row: d L / d l_t
  int kd;
  double inverse_temperature, temperature, kd_grad_scale;  // KD: T^(s-1)
  // The row-coefficient model (the policy loss): expected = w (1/T) [a_r (delta_vy - p_v) + c p_v (log p_v + b_r)]
  // with p of x / T, and each row's tolerance scaled by row_scale_r (KindReference::row_coefficients).
  int row_coefficients;
  const double *coef_a, *coef_b, *row_scale;
  double entropy_coef;
  double softcap, z_loss_weight, q_on, q_off;
  // A kind's own GPU oracle (kind_api/cuda_kind.hpp's CudaKindOracle) evaluates its rows itself: the expected
  // gradient per element of the valid rows, rows x cols float64 (no row model then), and where not null the slack
  // each element's tolerance widens by (GradJudge's `slack`: a router's tie tokens).
  const double* expected;
  const double* slack;
  // GradJudge
  double atol, rtol;
  int max_ulp;
  int dtype;  // StorageType of the gradient
  double framework_scale, quantum, grad_scale, smallest_normal;
};
// Per-row results (a plain struct the host merges in row order).
struct RowComparison {
  std::int64_t compared, mismatches, max_ulp, worst_column, first_bad_column;
  std::int64_t lookups;  // elements judged by a code-table lookup (reference_kernels.cu)
  std::int64_t nan, pos_inf, neg_inf, subnormal;
  double max_abs, max_rel, margin;
  double worst_expected, worst_got, worst_tolerance;
  double sum, sum_error, magnitude;  // of the effective gradient (row-sum invariant)
  double first_bad_value;
};
void reference_compare(StorageType type, const ReferenceCompareArgs& args, RowComparison* out, void* stream);

// Whether the reference kernels take the code tables for a shard of this type and loss (bf16, the
// cross-entropy family without softcap; LOSSVERIFY_REFERENCE_TABLES=off turns them off): see
// reference_kernels.cu. For reports and tests.
bool reference_code_tables_apply(StorageType type, bool kd, double softcap);

// Loads the reference kernels a shard of this type will take on the current device now (see
// preload_cross_entropy_kernels).
void preload_reference_kernels(StorageType type, bool kd, double softcap, const void* logits, std::int64_t cols);

// The kernels' float64 exp on the device, one value per input (host arrays; for the accuracy test).
void reference_exp_values(const double* in, double* out, std::size_t count);

}  // namespace lossverify::cuda
