// The policy kind's CUDA kernels: one block per row (a grid-stride loop over rows), 16-byte vector loads
// where the rows allow them. Statistics in one pass over the row: the online maximum m of x / T (and its
// first column) with S = sum e^u and E = sum e^u u rescaled as m grows (u = x / T - m); gradient in a second
// pass: scale [a ([v = target] - p_v) + [v = argmax] bonus + c p_v (log p_v + shift)], and zeros on a masked
// row (the gradient buffer may hold an earlier run's data). Six bytes per bf16 logit in all: read, read, write.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lossverify/cuda/device_types.cuh"
#include "lossverify/kinds/policy/policy_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kThreads = 512;
constexpr float kLog2e = 1.4426950408889634f;

// exp through the hardware ex2: relative error ~2^-22 plus the rounding of the scaled argument, inside
// every tolerance where p matters (as the cross-entropy kernels' fast_exp).
__device__ __forceinline__ float fast_exp(float x) { return exp2f(x * kLog2e); }

int grid_for(std::int64_t rows) { return static_cast<int>(rows < 65535 ? rows : 65535); }

// Threads per row: about 16 vectors each, between 64 and 512 (a TP shard's narrow rows take small blocks,
// several resident per SM, rather than blocks that idle on one short row).
template <class T>
int threads_for(std::int64_t cols) {
  const std::int64_t vectors = cols / (16 / static_cast<std::int64_t>(sizeof(T)));
  const std::int64_t warps = (vectors / 16 + 31) / 32;
  return static_cast<int>(std::min<std::int64_t>(kThreads, std::max<std::int64_t>(64, 32 * warps)));
}

// Online statistics of one thread: maximum, its column, S and E relative to the maximum.
struct Online {
  float m = -INFINITY, s = 0.0f, e = 0.0f;
  int arg = 0;
  // Rescale to a new maximum m2 >= m.
  __device__ void raise(float m2, int arg2) {
    if (m == -INFINITY) {
      m = m2, arg = arg2;
      return;
    }
    const float d = m - m2;
    const float f = fast_exp(d);
    e = f * (e + d * s);
    s *= f;
    m = m2, arg = arg2;
  }
  __device__ void add(float u_raw) {  // u_raw = x / T, m already >= u_raw
    const float u = u_raw - m;
    const float p = fast_exp(u);
    s += p;
    e += p * u;
  }
  __device__ void merge(const Online& o) {
    if (o.m == -INFINITY) return;
    if (m == -INFINITY) {
      *this = o;
      return;
    }
    Online b = o;
    if (b.m > m || (b.m == m && b.arg < arg)) {
      Online a = *this;
      *this = b;
      b = a;
    }
    // *this holds the larger maximum (the first column on ties); b's sums rescale to it.
    const float d = b.m - m;
    const float f = fast_exp(d);
    s += f * b.s;
    e += f * (b.e + d * b.s);
  }
};

template <class T>
__device__ __forceinline__ void widen_vector(const int4& v, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = __int_as_float(v.x), out[1] = __int_as_float(v.y), out[2] = __int_as_float(v.z),
    out[3] = __int_as_float(v.w);
  } else {
    const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = widen<T>(h[k]);
  }
}

template <class T>
__device__ __forceinline__ int4 narrow_vector(const float* in) {
  int4 v;
  if constexpr (std::is_same_v<T, float>) {
    v.x = __float_as_int(in[0]), v.y = __float_as_int(in[1]), v.z = __float_as_int(in[2]), v.w = __float_as_int(in[3]);
  } else {
    T* h = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = narrow<T>(in[k]);
  }
  return v;
}

__device__ Online block_merge(Online o) {
  __shared__ float sm[32], ss[32], se[32];
  __shared__ int sa[32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    Online other;
    other.m = __shfl_xor_sync(0xffffffffu, o.m, offset);
    other.s = __shfl_xor_sync(0xffffffffu, o.s, offset);
    other.e = __shfl_xor_sync(0xffffffffu, o.e, offset);
    other.arg = __shfl_xor_sync(0xffffffffu, o.arg, offset);
    o.merge(other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) sm[warp] = o.m, ss[warp] = o.s, se[warp] = o.e, sa[warp] = o.arg;
  __syncthreads();
  Online total;
  for (int w = 0; w < warps; ++w) {
    Online part;
    part.m = sm[w], part.s = ss[w], part.e = se[w], part.arg = sa[w];
    total.merge(part);
  }
  __syncthreads();
  return total;
}

// x / T, rounded to the storage type under rl-logprob-16bit (as logits.div_(T) on 16-bit logits).
template <class T>
__device__ __forceinline__ float scaled(float x, const PolicyKernelArgs& a) {
  const float u = x * a.inverse_temperature;
  if constexpr (std::is_same_v<T, float>) {
    return u;
  } else {
    return a.round_scaled ? widen<T>(narrow<T>(u)) : u;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) stats_kernel(PolicyKernelArgs a, float* out, bool vectorized) {
  const T* xs = static_cast<const T*>(a.logits);
  constexpr int kCount = 16 / sizeof(T);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float* o = out + 5 * r;
    if (!a.active[r]) {
      if (threadIdx.x < 5) o[threadIdx.x] = 0.0f;
      continue;
    }
    const T* x = xs + r * a.cols;
    Online mine;
    if (vectorized) {
      const int4* xv = reinterpret_cast<const int4*>(x);
      const std::int64_t vectors = a.cols / kCount;
      for (std::int64_t j = threadIdx.x; j < vectors; j += blockDim.x) {
        float u[kCount];
        widen_vector<T>(xv[j], u);
        float vm = -INFINITY;
        int at = 0;
#pragma unroll
        for (int k = 0; k < kCount; ++k) {
          u[k] = scaled<T>(u[k], a);
          if (u[k] > vm) vm = u[k], at = k;
        }
        if (vm > mine.m) mine.raise(vm, static_cast<int>(j * kCount + at));
#pragma unroll
        for (int k = 0; k < kCount; ++k) mine.add(u[k]);
      }
    } else {
      for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
        const float u = scaled<T>(widen<T>(x[c]), a);
        if (u > mine.m) mine.raise(u, static_cast<int>(c));
        mine.add(u);
      }
    }
    const Online total = block_merge(mine);
    if (threadIdx.x == 0) {
      const std::int64_t y = a.target[r];
      o[0] = total.m;
      o[1] = total.s;
      o[2] = total.e;
      o[3] = y >= 0 ? scaled<T>(widen<T>(x[y]), a) - total.m : 0.0f;
      o[4] = static_cast<float>(total.arg);
    }
  }
}

// To the storage type and back (a no-op for float).
template <class T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return widen<T>(narrow<T>(v));
  }
}

// One gradient element, rounded as PolicyGradRounding says (policy_protocol.hpp): with rounding, scale leaves
// 1 / T out, the element is rounded, times 1 / T, and rounded again when stored.
template <class T>
__device__ __forceinline__ float grad_element(float log_p, float p, bool is_target, float coef_a, float scaled_a,
                                              float rest, float scale, const PolicyKernelArgs& a) {
  const float delta = is_target ? 1.0f : 0.0f;
  if (a.grad_rounding == 0) return scale * (coef_a * (delta - p) + rest);
  float element = scale * (coef_a * (delta - p) + rest);
  if (a.grad_rounding == 2) element = round_to<T>(scaled_a * (delta - fast_exp(round_to<T>(log_p)))) + scale * rest;
  return round_to<T>(element) * a.inverse_temperature;
}

template <class T>
__global__ void __launch_bounds__(kThreads) grad_kernel(PolicyKernelArgs a, const float* rows, bool vectorized) {
  const T* xs = static_cast<const T*>(a.logits);
  T* gs = static_cast<T*>(a.grad);
  constexpr int kCount = 16 / sizeof(T);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    T* out = gs + r * a.cols;
    if (!a.active[r]) {  // a masked row's gradient is zero: written, never left to the buffer's old contents
      for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) out[c] = narrow<T>(0.0f);
      continue;
    }
    const float* g = rows + 9 * r;
    const float max = g[0], log_sum = g[1], coef_a = g[2], bonus = g[3], coef_c = g[4], shift = g[5], scale = g[6];
    const auto target = static_cast<std::int64_t>(g[7]);
    const auto argmax = static_cast<std::int64_t>(g[8]);
    const T* x = xs + r * a.cols;
    const float scaled_a = round_to<T>(scale * coef_a);  // a 16-bit log_softmax's upstream gradient
    auto value = [&](float xv, std::int64_t c) {
      const float log_p = (scaled<T>(xv, a) - max) - log_sum;
      const float p = fast_exp(log_p);
      float rest = coef_c * p * (log_p + shift);
      if (c == argmax) rest += bonus;
      return grad_element<T>(log_p, p, c == target, coef_a, scaled_a, rest, scale, a);
    };
    if (vectorized) {
      const int4* xv = reinterpret_cast<const int4*>(x);
      int4* ov = reinterpret_cast<int4*>(out);
      const std::int64_t vectors = a.cols / kCount;
      for (std::int64_t j = threadIdx.x; j < vectors; j += blockDim.x) {
        float u[kCount];
        widen_vector<T>(xv[j], u);
#pragma unroll
        for (int k = 0; k < kCount; ++k) u[k] = value(u[k], j * kCount + k);
        ov[j] = narrow_vector<T>(u);
      }
    } else {
      for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) out[c] = narrow<T>(value(widen<T>(x[c]), c));
    }
  }
}

template <class T>
bool can_vectorize(const void* logits, const void* grad, std::int64_t cols) {
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return aligned(logits) && (grad == nullptr || aligned(grad)) &&
         (cols * static_cast<std::int64_t>(sizeof(T))) % 16 == 0;
}

}  // namespace

void policy_local_stats(StorageType type, const PolicyKernelArgs& args, float* stats, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = can_vectorize<T>(args.logits, nullptr, args.cols);
    stats_kernel<T><<<grid_for(args.rows), threads_for<T>(args.cols), 0, static_cast<cudaStream_t>(stream)>>>(
        args, stats, vectorized);
  });
}

void policy_gradient(StorageType type, const PolicyKernelArgs& args, const float* rows, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = can_vectorize<T>(args.logits, args.grad, args.cols);
    grad_kernel<T><<<grid_for(args.rows), threads_for<T>(args.cols), 0, static_cast<cudaStream_t>(stream)>>>(
        args, rows, vectorized);
  });
}

}  // namespace lossverify::cuda
