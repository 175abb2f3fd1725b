// The policy kind's CUDA kernels: one block per row (a grid-stride loop over rows). Statistics: the row's
// maximum of x / T (and its first column), then S = sum e^u and E = sum e^u u relative to it; gradient:
// scale [a ([v = target] - p_v) + [v = argmax] bonus + c p_v (log p_v + shift)] per column.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "lossverify/cuda/device_types.cuh"
#include "lossverify/kinds/policy/policy_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kThreads = 256;

int grid_for(std::int64_t rows) { return static_cast<int>(rows < 65535 ? rows : 65535); }

template <class T>
__global__ void __launch_bounds__(kThreads) stats_kernel(PolicyKernelArgs a, float* out) {
  const T* xs = static_cast<const T*>(a.logits);
  __shared__ float shared_max[kThreads / 32];
  __shared__ int shared_arg[kThreads / 32];
  __shared__ float shared_sum[2][kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float* o = out + 5 * r;
    if (!a.active[r]) {
      if (threadIdx.x < 5) o[threadIdx.x] = 0.0f;
      continue;
    }
    const T* x = xs + r * a.cols;
    float m = -INFINITY;
    int arg = 0;
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float u = widen<T>(x[c]) * a.inverse_temperature;
      if (u > m) m = u, arg = static_cast<int>(c);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
      const int arg2 = __shfl_xor_sync(0xffffffffu, arg, offset);
      if (m2 > m || (m2 == m && arg2 < arg)) m = m2, arg = arg2;
    }
    if (lane == 0) shared_max[warp] = m, shared_arg[warp] = arg;
    __syncthreads();
    m = -INFINITY;
    arg = 0;
    for (int w = 0; w < warps; ++w) {
      if (shared_max[w] > m || (shared_max[w] == m && shared_arg[w] < arg)) m = shared_max[w], arg = shared_arg[w];
    }
    float s = 0.0f, e = 0.0f;
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float u = widen<T>(x[c]) * a.inverse_temperature - m;
      const float p = expf(u);
      s += p;
      e += p * u;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      s += __shfl_xor_sync(0xffffffffu, s, offset);
      e += __shfl_xor_sync(0xffffffffu, e, offset);
    }
    if (lane == 0) shared_sum[0][warp] = s, shared_sum[1][warp] = e;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total_s = 0.0f, total_e = 0.0f;
      for (int w = 0; w < warps; ++w) total_s += shared_sum[0][w], total_e += shared_sum[1][w];
      const std::int64_t y = a.target[r];
      o[0] = m;
      o[1] = total_s;
      o[2] = total_e;
      o[3] = y >= 0 ? widen<T>(x[y]) * a.inverse_temperature - m : 0.0f;
      o[4] = static_cast<float>(arg);
    }
    __syncthreads();
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) grad_kernel(PolicyKernelArgs a, const float* rows) {
  const T* xs = static_cast<const T*>(a.logits);
  T* gs = static_cast<T*>(a.grad);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    if (!a.active[r]) continue;
    const float* g = rows + 9 * r;
    const float max = g[0], log_sum = g[1], coef_a = g[2], bonus = g[3], coef_c = g[4], shift = g[5], scale = g[6];
    const auto target = static_cast<std::int64_t>(g[7]);
    const auto argmax = static_cast<std::int64_t>(g[8]);
    const T* x = xs + r * a.cols;
    T* out = gs + r * a.cols;
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float log_p = (widen<T>(x[c]) * a.inverse_temperature - max) - log_sum;
      const float p = expf(log_p);
      float value = coef_a * ((c == target ? 1.0f : 0.0f) - p) + coef_c * p * (log_p + shift);
      if (c == argmax) value += bonus;
      out[c] = narrow<T>(scale * value);
    }
  }
}

}  // namespace

void policy_local_stats(StorageType type, const PolicyKernelArgs& args, float* stats, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    stats_kernel<T><<<grid_for(args.rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, stats);
  });
}

void policy_gradient(StorageType type, const PolicyKernelArgs& args, const float* rows, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    grad_kernel<T><<<grid_for(args.rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, rows);
  });
}

}  // namespace lossverify::cuda
