// KD kernels of the CUDA backend: pass 1 the two online softmaxes (student and teacher) and the cross terms,
// pass 2 the gradient, one row per block of a persistent grid.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_types.cuh"
#include "lossverify/cuda/row_launch.cuh"
#include "lossverify/kinds/kd/kd_kernels.hpp"

namespace lossverify::cuda {

namespace {

// KD pass 1: two online softmaxes (student and teacher) and the cross terms, one row per block.
template <class T>
__global__ void __launch_bounds__(kThreads) kd_stats_kernel(KdStatsArgs a, float* out) {
  const T* xs = static_cast<const T*>(a.student);
  const T* ys = static_cast<const T*>(a.teacher);
  __shared__ float shared[8][32];
  __shared__ int shared_arg[32];
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float* o = out + 8 * r;
    if (!a.active[r]) {
      if (threadIdx.x == 0) {
        for (int j = 0; j < 8; ++j) o[j] = 0.0f;
      }
      continue;
    }
    const T* x = xs + r * a.cols;
    const T* y = ys + r * a.cols;
    // Pass over the row: maxima first (exact, order-free), then the sums relative to them.
    float ma = -INFINITY, mb = -INFINITY;
    int arg = 0;
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float av = widen<T>(x[c]) * a.inverse_temperature;
      if (av > ma) {
        ma = av;
        arg = static_cast<int>(c);
      }
      mb = fmaxf(mb, widen<T>(y[c]) * a.inverse_temperature);
    }
    // block max (and the first column reaching the student max)
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ma2 = __shfl_xor_sync(0xffffffffu, ma, offset);
      const int arg2 = __shfl_xor_sync(0xffffffffu, arg, offset);
      if (ma2 > ma || (ma2 == ma && arg2 < arg)) {
        ma = ma2;
        arg = arg2;
      }
      mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, offset));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) {
      shared[0][warp] = ma;
      shared[1][warp] = mb;
      shared_arg[warp] = arg;
    }
    __syncthreads();
    ma = -INFINITY;
    mb = -INFINITY;
    arg = 0;
    for (int w = 0; w < warps; ++w) {
      if (shared[0][w] > ma || (shared[0][w] == ma && shared_arg[w] < arg)) {
        ma = shared[0][w];
        arg = shared_arg[w];
      }
      mb = fmaxf(mb, shared[1][w]);
    }
    __syncthreads();
    float sa = 0.0f, sb = 0.0f, w_gap = 0.0f, u = 0.0f;
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float av = widen<T>(x[c]) * a.inverse_temperature;
      const float bv = widen<T>(y[c]) * a.inverse_temperature;
      const float eb = expf(bv - mb);
      sa += expf(av - ma);
      sb += eb;
      w_gap += eb * (bv - av);
      u += eb * (av - ma);
    }
    float vals[4] = {sa, sb, w_gap, u};
    for (int j = 0; j < 4; ++j) {
      for (int offset = 16; offset > 0; offset >>= 1) vals[j] += __shfl_xor_sync(0xffffffffu, vals[j], offset);
      if (lane == 0) shared[2 + j][warp] = vals[j];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float total[4] = {0, 0, 0, 0};
      for (int w = 0; w < warps; ++w) {
        for (int j = 0; j < 4; ++j) total[j] += shared[2 + j][w];
      }
      o[0] = ma;
      o[1] = total[0];
      o[2] = mb;
      o[3] = total[1];
      o[4] = total[2];
      o[5] = total[3];
      o[6] = static_cast<float>(arg);
      o[7] = 0.0f;
    }
    __syncthreads();
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) kd_grad_kernel(KdGradArgs a) {
  const T* xs = static_cast<const T*>(a.student);
  const T* ys = static_cast<const T*>(a.teacher);
  T* gs = static_cast<T*>(a.grad);
  __shared__ float shared[2][32];
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    T* g = gs + r * a.cols;
    if (!a.active[r]) {
      zero_row(g, a.cols);
      continue;
    }
    const T* x = xs + r * a.cols;
    const T* y = ys + r * a.cols;
    const float lse_a = a.lse_student[r], lse_b = a.lse_teacher[r];
    float shard_p = 0.0f, shard_q = 0.0f;
    if (a.untracked_allreduce) {
      float p = 0.0f, q = 0.0f;
      for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
        q += expf(widen<T>(x[c]) * a.inverse_temperature - lse_a);
        p += expf(widen<T>(y[c]) * a.inverse_temperature - lse_b);
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        p += __shfl_xor_sync(0xffffffffu, p, offset);
        q += __shfl_xor_sync(0xffffffffu, q, offset);
      }
      if ((threadIdx.x & 31) == 0) {
        shared[0][threadIdx.x >> 5] = p;
        shared[1][threadIdx.x >> 5] = q;
      }
      __syncthreads();
      for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
        shard_p += shared[0][w];
        shard_q += shared[1][w];
      }
      __syncthreads();
    }
    const float w = a.weight[r];
    const auto argmax = static_cast<std::int64_t>(a.argmax[r]);
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float q = expf(widen<T>(x[c]) * a.inverse_temperature - lse_a);
      const float p = expf(widen<T>(y[c]) * a.inverse_temperature - lse_b);
      float v = q - p;
      if (a.untracked_allreduce) {
        v = shard_p * q - p;
        if (c == argmax) v += shard_p * (1.0f - shard_q);
      }
      g[c] = narrow<T>(w * v);
    }
  }
}

}  // namespace

void kd_stats(StorageType type, const KdStatsArgs& args, float* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const LaunchShape shape = launch_shape<T>(args.rows, args.cols);
    kd_stats_kernel<T><<<shape.blocks, shape.threads, 0, static_cast<cudaStream_t>(stream)>>>(args, out);
  });
}

void kd_grad(StorageType type, const KdGradArgs& args, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const LaunchShape shape = launch_shape<T>(args.rows, args.cols);
    kd_grad_kernel<T><<<shape.blocks, shape.threads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  });
}

void preload_kd_kernels(StorageType type) {
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    load_kernel_code(reinterpret_cast<const void*>(kd_stats_kernel<T>));
    load_kernel_code(reinterpret_cast<const void*>(kd_grad_kernel<T>));
  });
}

}  // namespace lossverify::cuda
