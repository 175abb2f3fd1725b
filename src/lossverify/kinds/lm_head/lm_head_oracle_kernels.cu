// The LM head's GPU oracle kernels (lm_head_oracle_kernels.hpp): the kind's row model on float64 logits, written from
// the host's definitions (cross_entropy_reference.cpp, kd_reference.cpp) and their bounds under a logit error, and the
// head's error model (lm_head_reference.cpp). Row reductions take one block per row, every thread a compensated sum of
// its columns, combined in a fixed tree: deterministic. Compiled with -fmad=false, like the other reference kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_types.cuh"
#include "lossverify/kinds/lm_head/lm_head_oracle_kernels.hpp"
#include "lossverify/oracle/cuda/compensated.cuh"

namespace lossverify::cuda {

namespace {

constexpr int kThreads = 256;

unsigned grid_for(std::int64_t count) {
  return static_cast<unsigned>(std::min<std::int64_t>((count + kThreads - 1) / kThreads, 65535 * 8));
}
unsigned rows_grid(std::int64_t rows) { return static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)); }

#define LV_GRID_STRIDE(k, count)                                                                       \
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < (count); \
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

// A block's values combined in a fixed tree over shared memory (thread 0 gets the result; every thread calls it).
template <class T, class Merge>
__device__ T block_reduce(T x, Merge merge) {
  // Raw storage: __shared__ variables cannot have constructors.
  __shared__ alignas(T) unsigned char storage[sizeof(T) * kThreads];
  T* shared = reinterpret_cast<T*>(storage);
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half)
      shared[threadIdx.x] = merge(shared[threadIdx.x], shared[threadIdx.x + half]);
    __syncthreads();
  }
  const T result = shared[0];
  __syncthreads();
  return result;
}

__device__ double capped(double x, double cap) { return cap > 0.0 ? cap * tanh(x / cap) : x; }

// A channel of a row's partial: the max of z over the columns, then the compensated sum of exp(z - max).
template <class Z>
__device__ void softmax_channel(Z z, std::int64_t cols, double& max_out, Neumaier& sum_out) {
  double m = -INFINITY;
  for (std::int64_t v = threadIdx.x; v < cols; v += blockDim.x) m = fmax(m, z(v));
  m = block_reduce(m, [](double a, double b) { return fmax(a, b); });
  Neumaier s;
  if (m != -INFINITY) {
    for (std::int64_t v = threadIdx.x; v < cols; v += blockDim.x) s.add(exp(z(v) - m));
  }
  sum_out = block_reduce(s, [](Neumaier a, const Neumaier& b) {
    a.merge(b);
    return a;
  });
  max_out = m;
}

__global__ void __launch_bounds__(kThreads)
    partials_kernel(HeadOracleModel m, const double* u, const double* teacher, std::int64_t ld, std::int64_t rows,
                    std::int64_t begin, std::int64_t cols, const int* valid, const std::int64_t* label, double* out) {
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    double* o = out + 8 * r;
    if (!valid[r]) {  // RowPartial's empty values
      if (threadIdx.x < 8) o[threadIdx.x] = threadIdx.x == 0 || threadIdx.x == 5 ? -INFINITY : 0.0;
      continue;
    }
    const double* x = u + r * ld + begin;
    double max = 0.0, teacher_max = -INFINITY;
    Neumaier sum, teacher_sum, qx;
    if (m.teacher) {
      const double inverse_t = 1.0 / m.temperature;
      const double* y = teacher + r * ld + begin;
      softmax_channel([&](std::int64_t v) { return x[v] * inverse_t; }, cols, max, sum);
      softmax_channel([&](std::int64_t v) { return y[v] * inverse_t; }, cols, teacher_max, teacher_sum);
    } else {
      softmax_channel([&](std::int64_t v) { return capped(x[v], m.softcap); }, cols, max, sum);
      const std::int64_t at = label[r] - begin;
      Neumaier t;
      for (std::int64_t v = threadIdx.x; v < cols; v += blockDim.x) {
        t.add((v == at ? m.q_on : m.q_off) * capped(x[v], m.softcap));
      }
      qx = block_reduce(t, [](Neumaier a, const Neumaier& b) {
        a.merge(b);
        return a;
      });
    }
    if (threadIdx.x == 0) {
      o[0] = max;
      o[1] = sum.s;
      o[2] = sum.c;
      o[3] = qx.s;
      o[4] = qx.c;
      o[5] = teacher_max;
      o[6] = teacher_sum.s;
      o[7] = teacher_sum.c;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    kl_kernel(HeadOracleModel m, const double* u, const double* teacher, std::int64_t ld, std::int64_t rows,
              std::int64_t begin, std::int64_t cols, const int* valid, const double* lse, const double* teacher_lse,
              double* out) {
  const double inverse_t = 1.0 / m.temperature;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (!valid[r]) {
      if (threadIdx.x < 2) out[2 * r + threadIdx.x] = 0.0;
      continue;
    }
    const double* x = u + r * ld + begin;
    const double* y = teacher + r * ld + begin;
    Neumaier s;
    for (std::int64_t v = threadIdx.x; v < cols; v += blockDim.x) {
      const double log_p = y[v] * inverse_t - teacher_lse[r];
      const double p = exp(log_p);
      if (p > 0.0) s.add(p * (log_p - (x[v] * inverse_t - lse[r])));
    }
    s = block_reduce(s, [](Neumaier a, const Neumaier& b) {
      a.merge(b);
      return a;
    });
    if (threadIdx.x == 0) {
      out[2 * r] = s.s;
      out[2 * r + 1] = s.c;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    largest_error_kernel(const double* u, std::int64_t ld, const float* magnitude, const double* bias,
                         std::int64_t rows, std::int64_t cols, double inflate, double accumulate, double stored,
                         double* largest) {
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    double e = 0.0;
    for (std::int64_t v = threadIdx.x; v < cols; v += blockDim.x) {
      const double mag =
          inflate * static_cast<double>(magnitude[r * cols + v]) + (bias != nullptr ? fabs(bias[v]) : 0.0);
      const double summed = accumulate * mag;
      e = fmax(e, summed + stored * (fabs(u[r * ld + v]) + summed));
    }
    e = block_reduce(e, [](double a, double b) { return fmax(a, b); });
    if (threadIdx.x == 0) largest[r] = e;
  }
}

// The kind's gradient of one element and its bound under the row's logit error, from the host's definitions:
// cross-entropy's g = w A c' with A = p (1 + 2 w_z lse) - q and c' the softcap's sech^2 (gradient_under_logit_error in
// cross_entropy_reference.cpp), KD's g = w T^(s-1) (Q - P) (kd_reference.cpp).
struct ElementGradient {
  double g, error;
};
__device__ ElementGradient element_gradient(const HeadOracleGradientArgs& a, std::int64_t r, std::int64_t v) {
  const HeadOracleModel& m = a.model;
  const double x = a.u[r * a.cols + v];
  const double w = a.weight[r], delta = a.delta[r], lse = a.lse[r];
  if (m.teacher) {
    const double t = m.temperature;
    const double scale = w * m.kd_scale;
    const double q = exp(x / t - lse);
    const double p = exp(a.teacher[r * a.cols + v] / t - a.teacher_lse[r]);
    return {scale * (q - p), fabs(scale) * q * expm1(2.0 * delta / t)};
  }
  const double cap = m.softcap, zw = m.z_loss_weight;
  const double z_factor = 1.0 + 2.0 * zw * lse;
  const double grow = expm1(2.0 * delta);
  const double cap_move = cap > 0.0 ? 0.7699 * delta / cap : 0.0;
  const double p = exp(capped(x, cap) - lse);
  const double dp = fmin(p, 1.0 - p + 0x1p-50) * grow;
  const double target = v == a.label[r] ? m.q_on : m.q_off;
  const double am = p * z_factor - target;
  const double da = dp * fabs(z_factor) + (p + dp) * 2.0 * zw * delta;
  double factor = 1.0, g = w * am;
  if (cap > 0.0) {
    const double ch = cosh(x / cap);
    factor = 1.0 / (ch * ch);
    g = w * (am / (ch * ch));
  }
  return {g, fabs(w) * (da * (factor + cap_move) + fabs(am) * cap_move)};
}

__global__ void __launch_bounds__(kThreads) gradient_kernel(HeadOracleGradientArgs a) {
  LV_GRID_STRIDE(k, a.rows * a.cols) {
    const std::int64_t r = k / a.cols, v = k % a.cols;
    if (!a.valid[r]) {
      a.g[k] = 0.0;
      a.a_dh[k] = 0.0f;
      a.a_dw[k] = 0.0f;
      continue;
    }
    const ElementGradient eg = element_gradient(a, r, v);
    // whole_row_gradient (host_oracle.cpp): the kind's tolerance at the moved value and one rounding to the dtype.
    const double token_scale = fabs(a.weight[r]) * a.grad_scale;
    const double moved = fabs(eg.g) + eg.error;
    const double e =
        eg.error + (a.atol * token_scale + a.quantum * a.framework_scale + a.rtol * moved) + a.unit * moved;
    a.g[k] = eg.g;
    a.a_dh[k] = __double2float_ru((1.0 + a.gamma_dh) * e + a.gamma_dh * fabs(eg.g));
    a.a_dw[k] = __double2float_ru((1.0 + a.gamma_dw) * e + a.gamma_dw * fabs(eg.g));
  }
}

template <class T>
__global__ void widen_kernel(const T* in, double* out64, float* abs32, std::int64_t count) {
  LV_GRID_STRIDE(k, count) {
    const float x = widen<T>(in[k]);
    out64[k] = x;
    if (abs32 != nullptr) abs32[k] = fabsf(x);
  }
}

__global__ void add_bias_kernel(double* u, std::int64_t ld, const double* bias, std::int64_t rows, std::int64_t cols) {
  LV_GRID_STRIDE(k, rows * cols) { u[(k / cols) * ld + k % cols] += bias[k % cols]; }
}

// One thread per column, down the rows in order.
template <class T>
__global__ void column_sums_kernel(const T* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, double* sums) {
  LV_GRID_STRIDE(j, cols) {
    double s = sums[j];
    for (std::int64_t r = 0; r < rows; ++r) s += static_cast<double>(x[r * ld + j]);
    sums[j] = s;
  }
}

template <class T>
__global__ void finish_bound_kernel(const T* part, const double* want, double inflate, double unit, double* bound,
                                    std::int64_t count) {
  LV_GRID_STRIDE(k, count) {
    const double b = inflate * static_cast<double>(part[k]);
    bound[k] = b + unit * (fabs(want[k]) + b);
  }
}

__global__ void gather_rows_kernel(const double* from, const std::int64_t* rows, std::int64_t count, std::int64_t width,
                                   double* to) {
  LV_GRID_STRIDE(k, count * width) { to[k] = from[rows[k / width] * width + k % width]; }
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void head_oracle_widen(StorageType type, const void* in, double* out64, float* abs32, std::int64_t count,
                       void* stream) {
  if (count == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    widen_kernel<T>
        <<<grid_for(count), kThreads, 0, as_stream(stream)>>>(static_cast<const T*>(in), out64, abs32, count);
  });
  LV_CUDA(cudaGetLastError());
}

void head_oracle_add_bias(double* u, std::int64_t ld, const double* bias, std::int64_t rows, std::int64_t cols,
                          void* stream) {
  if (rows * cols == 0) return;
  add_bias_kernel<<<grid_for(rows * cols), kThreads, 0, as_stream(stream)>>>(u, ld, bias, rows, cols);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_largest_error(const double* u, std::int64_t ld, const float* magnitude, const double* bias,
                               std::int64_t rows, std::int64_t cols, double inflate, double accumulate, double stored,
                               double* largest, void* stream) {
  if (rows == 0) return;
  largest_error_kernel<<<rows_grid(rows), kThreads, 0, as_stream(stream)>>>(u, ld, magnitude, bias, rows, cols, inflate,
                                                                            accumulate, stored, largest);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_partials(const HeadOracleModel& m, const double* u, const double* teacher, std::int64_t ld,
                          std::int64_t rows, std::int64_t begin, std::int64_t cols, const int* valid,
                          const std::int64_t* label, double* out, void* stream) {
  if (rows == 0) return;
  partials_kernel<<<rows_grid(rows), kThreads, 0, as_stream(stream)>>>(m, u, teacher, ld, rows, begin, cols, valid,
                                                                       label, out);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_kl(const HeadOracleModel& m, const double* u, const double* teacher, std::int64_t ld,
                    std::int64_t rows, std::int64_t begin, std::int64_t cols, const int* valid, const double* lse,
                    const double* teacher_lse, double* out, void* stream) {
  if (rows == 0) return;
  kl_kernel<<<rows_grid(rows), kThreads, 0, as_stream(stream)>>>(m, u, teacher, ld, rows, begin, cols, valid, lse,
                                                                 teacher_lse, out);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_gradient(const HeadOracleGradientArgs& args, void* stream) {
  if (args.rows * args.cols == 0) return;
  gradient_kernel<<<grid_for(args.rows * args.cols), kThreads, 0, as_stream(stream)>>>(args);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_column_sums(const double* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, double* sums,
                             void* stream) {
  if (cols == 0) return;
  column_sums_kernel<<<grid_for(cols), kThreads, 0, as_stream(stream)>>>(x, ld, rows, cols, sums);
  LV_CUDA(cudaGetLastError());
}
void head_oracle_column_sums(const float* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, double* sums,
                             void* stream) {
  if (cols == 0) return;
  column_sums_kernel<<<grid_for(cols), kThreads, 0, as_stream(stream)>>>(x, ld, rows, cols, sums);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_finish_bound(const float* part, const double* want, double inflate, double unit, double* bound,
                              std::int64_t count, void* stream) {
  if (count == 0) return;
  finish_bound_kernel<<<grid_for(count), kThreads, 0, as_stream(stream)>>>(part, want, inflate, unit, bound, count);
  LV_CUDA(cudaGetLastError());
}
void head_oracle_finish_bound(const double* part, const double* want, double inflate, double unit, double* bound,
                              std::int64_t count, void* stream) {
  if (count == 0) return;
  finish_bound_kernel<<<grid_for(count), kThreads, 0, as_stream(stream)>>>(part, want, inflate, unit, bound, count);
  LV_CUDA(cudaGetLastError());
}

void head_oracle_gather_rows(const double* from, const std::int64_t* rows, std::int64_t count, std::int64_t width,
                             double* to, void* stream) {
  if (count * width == 0) return;
  gather_rows_kernel<<<grid_for(count * width), kThreads, 0, as_stream(stream)>>>(from, rows, count, width, to);
  LV_CUDA(cudaGetLastError());
}

}  // namespace lossverify::cuda
