#pragma once
// Plain-data interface between the LM head's GPU oracle (lm_head_oracle.cpp) and its float64 kernels
// (lm_head_oracle_kernels.cu); the matrix products are cuBLAS's. The kernels evaluate the definitions of the host's
// reference (lm_head_reference.cpp, and the kind's row reference: cross_entropy_reference.cpp, kd_reference.cpp) on
// float64 logits u = h W^T (+ b) that the oracle computes from its own inputs. Nothing here includes CUDA headers.
#include <cstdint>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

// out64[k] = in[k] widened exactly; abs32[k] (where not null) = |in[k]| as a float (exact: every storage type's
// values are floats).
void head_oracle_widen(StorageType type, const void* in, double* out64, float* abs32, std::int64_t count, void* stream);

// u[r, v] += b[v] over rows x cols (row stride ld).
void head_oracle_add_bias(double* u, std::int64_t ld, const double* bias, std::int64_t rows, std::int64_t cols,
                          void* stream);

// Per row, the largest bound of a correct head's logit error over its columns (lm_head_parts.hpp's head_logit_error):
// `magnitude` (rows x cols, ld cols) holds sum_k |h_k W_vk| from a product whose result lies below the exact sum by
// at most the factor `inflate`, to which |b_v| adds; `accumulate` is gamma of the head's term count, `stored` the
// dtype's unit roundoff.
void head_oracle_largest_error(const double* u, std::int64_t ld, const float* magnitude, const double* bias,
                               std::int64_t rows, std::int64_t cols, double inflate, double accumulate, double stored,
                               double* largest, void* stream);

// The kind's row model (kind_api/loss_kind.hpp's DeviceRowModel) with what the kernels read of it.
struct HeadOracleModel {
  int teacher = 0;                 // KD: two softmaxes of x / T and y / T; else the cross-entropy family
  double temperature = 1.0;        // KD
  double kd_scale = 1.0;           // KD: T^(s-1), the gradient's factor
  double softcap = 0.0;            // cross-entropy: c tanh(x / c), 0 = off
  double z_loss_weight = 0.0;      // cross-entropy
  double q_on = 1.0, q_off = 0.0;  // cross-entropy target weights
};

// Per row over columns [begin, begin + cols) of u (row stride ld; `teacher` the same shape, KD): RowPartial's 8
// doubles (row_partial.hpp), compensated as the host's row_sums; rows whose valid flag is 0 get the empty partial.
// `label` is each row's global label (cross-entropy).
void head_oracle_partials(const HeadOracleModel& m, const double* u, const double* teacher, std::int64_t ld,
                          std::int64_t rows, std::int64_t begin, std::int64_t cols, const int* valid,
                          const std::int64_t* label, double* out, void* stream);

// KD's value pass over the same columns: [value, error] per row of sum_v P_v (log P_v - log Q_v).
void head_oracle_kl(const HeadOracleModel& m, const double* u, const double* teacher, std::int64_t ld,
                    std::int64_t rows, std::int64_t begin, std::int64_t cols, const int* valid, const double* lse,
                    const double* teacher_lse, double* out, void* stream);

// The kind's reference gradient g of rows x cols (every column of the row, ld = cols) and how far a correct
// implementation's may lie from it, as the host oracle's whole_row_gradient takes it: the kind's bound under the
// row's largest logit error (`delta`), its tolerance (atol, rtol, quantum, framework_scale at the token scale
// |w| grad_scale) and one rounding to the dtype (`unit`). Out: g (float64) and the two factors of the head's
// error model the products read, rounded up to float32: a_dh = (1 + gamma_dh) e + gamma_dh |g| and the same with
// gamma_dw. Rows whose valid flag is 0 get zeros.
struct HeadOracleGradientArgs {
  HeadOracleModel model;
  const double* u;
  const double* teacher;
  std::int64_t rows, cols;
  const int* valid;
  const std::int64_t* label;
  const double *lse, *teacher_lse, *weight, *delta;
  double atol, rtol, quantum, framework_scale, grad_scale, unit;
  double gamma_dh, gamma_dw;
  double* g;
  float* a_dh;
  float* a_dw;
};
void head_oracle_gradient(const HeadOracleGradientArgs& args, void* stream);

// sums[j] += sum over rows of x[r * ld + j], j < cols, in float64 (db and its bound), for x of either type.
void head_oracle_column_sums(const double* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, double* sums,
                             void* stream);
void head_oracle_column_sums(const float* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, double* sums,
                             void* stream);

// bound[k] = inflate part[k], then one rounding of the output to the dtype added: bound += unit (|want| + bound).
// `part` is float32 (a product of magnitudes) or float64 (a sum).
void head_oracle_finish_bound(const float* part, const double* want, double inflate, double unit, double* bound,
                              std::int64_t count, void* stream);
void head_oracle_finish_bound(const double* part, const double* want, double inflate, double unit, double* bound,
                              std::int64_t count, void* stream);

// to[k * width + c] = from[rows[k] * width + c]: the rows a rank reports, in its order.
void head_oracle_gather_rows(const double* from, const std::int64_t* rows, std::int64_t count, std::int64_t width,
                             double* to, void* stream);

}  // namespace lossverify::cuda
