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
#include <cstdlib>
#include <type_traits>

#include "lossverify/cuda/device_types.cuh"
#include "lossverify/cuda/vector_elements.cuh"
#include "lossverify/kinds/policy/policy_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kThreads = 512;

// exp through the hardware ex2: relative error ~2^-22 plus the rounding of the scaled argument, inside
// every tolerance where p matters (as the cross-entropy kernels' fast_exp).
__device__ __forceinline__ float fast_exp(float x) { return exp2f(x * kLog2e); }

int grid_for(std::int64_t rows) { return static_cast<int>(rows < 65535 ? rows : 65535); }

// Threads per row: about 64 vectors each, between 64 and 512 (a TP shard's narrow rows take small blocks,
// several resident per SM, rather than blocks that idle on one short row). Measured on an H200, N = 16384,
// V = 128256 bf16, TP 1 / 2 / 4 / 8: 64 vectors per thread 92.8 / 94.3 / 89.4 / 87.5% of the floor, 16
// vectors 89.7 / 82.5 / 85.2 / 85.7%. Tuning aid: LOSSVERIFY_POLICY_VECTORS (1 to 256).
int vectors_per_thread() {
  static const int vectors = [] {
    const char* e = std::getenv("LOSSVERIFY_POLICY_VECTORS");
    const int v = e != nullptr ? std::atoi(e) : 0;
    return v >= 1 && v <= 256 ? v : 64;
  }();
  return vectors;
}
template <class T>
int threads_for(std::int64_t cols) {
  const std::int64_t vectors = cols / (16 / static_cast<std::int64_t>(sizeof(T)));
  const std::int64_t warps = (vectors / vectors_per_thread() + 31) / 32;
  return static_cast<int>(std::min<std::int64_t>(kThreads, std::max<std::int64_t>(64, 32 * warps)));
}

// 16-byte loads each thread has in flight before the first use (1, 2 and 8 measured no better).
constexpr int kLoads = 4;

// The row's 16-byte vectors, each thread with kLoads in flight (vector_elements.cuh's for_each_vector).
template <class F>
__device__ __forceinline__ void for_each_vector(const int4* row, int vectors, F&& f) {
  cuda::for_each_vector<kLoads>(
      row, vectors, [](const int4* p) { return __ldg(p); }, f);
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

// The plain path's statistics of one thread (x / T not rounded): the maximum m of u = x / T, the vector that
// holds its first occurrence, S = sum 2^l and E2 = sum 2^l l in base 2, l = (u - m) log2 e: u - m = x / T - m
// in one FFMA (one rounding, exact near the max however large the logits; x log2 e / T - m log2 e lost
// |m| 2^-24), then an FMUL, a MUFU, an FADD and an FFMA per element; E = E2 ln 2. Per vector, the exact
// maximum of the raw values (packed pairs for 16-bit types) times 1 / T is the maximum of u (rounding is
// monotonic, 1 / T > 0); a new maximum rescales the sums once and records only the vector (a search for the
// element on every raise diverged the warp on most vectors), resolve_argmax finds the element at the end.
template <class T>
struct PlainOnline {
  static constexpr int kCount = 16 / sizeof(T);
  float inverse_t;  // 1 / T
  float m = -INFINITY, s = 0.0f, e2 = 0.0f;
  int arg_vector = 0;
  __device__ explicit PlainOnline(float inverse_temperature) : inverse_t(inverse_temperature) {}
  __device__ __forceinline__ void add(const int4& raw, int j) {
    const float top = vector_max<T>(raw) * inverse_t;
    if (top > m) {
      const float d2 = (m - top) * kLog2e;  // -inf on the first vector: s and e2 are 0
      const float f = m == -INFINITY ? 0.0f : ex2_ftz(d2);
      e2 = m == -INFINITY ? 0.0f : f * (e2 + d2 * s);
      s *= f;
      m = top;
      arg_vector = j;
    }
    each_element<T>(raw, [&](float x, int) {
      const float l = fmaf(x, inverse_t, -m) * kLog2e;
      const float p = ex2_ftz(l);
      s += p;
      e2 = fmaf(p, l, e2);
    });
  }
  // Online state with the argmax as its vector's first column: the merge's ties between vectors then order
  // as columns do (a vector lies in one thread).
  __device__ Online natural() const {
    Online o;
    o.m = m, o.s = s, o.e = e2 * kLn2, o.arg = arg_vector * kCount;
    return o;
  }
};

// The first column of the row's maximum m (of u = x / T) within the vector that begins at `first`.
template <class T>
__device__ int resolve_argmax(const T* x, int first, float m, float inverse_t) {
  constexpr int kCount = 16 / sizeof(T);
  for (int e = 0; e < kCount; ++e) {
    if (widen<T>(x[first + e]) * inverse_t == m) return first + e;
  }
  return first;
}

// kPlain: x / T is not rounded (round_scaled off), so PlainOnline's per-element code applies.
template <class T, bool kPlain>
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
    if (kPlain && vectorized) {
      PlainOnline<T> plain(a.inverse_temperature);
      for_each_vector(reinterpret_cast<const int4*>(x), static_cast<int>(a.cols / kCount),
                      [&](const int4& raw, int j) { plain.add(raw, j); });
      mine = plain.natural();
    } else if (vectorized) {
      const int4* xv = reinterpret_cast<const int4*>(x);
      const std::int64_t vectors = a.cols / kCount;
      for_each_vector(xv, static_cast<int>(vectors), [&](const int4& raw, int j) {
        float u[kCount];
        widen_vector<T>(raw, u);
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
      });
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
      o[4] = static_cast<float>(kPlain && vectorized ? resolve_argmax(x, total.arg, total.m, a.inverse_temperature)
                                                     : total.arg);
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

// kPlain: no rounding of x / T or of the gradient (round_scaled off, PolicyGradRounding::none). Then
// g_v = [v = target] scale a + [v = argmax] scale bonus + p_v (S1 l_v + S2), l_v = log2 p_v = (x_v / T - max)
// log2 e - log S log2 e (two FFMAs, the first exact near the max), with S1 = scale c ln 2 and S2 = scale
// (c shift - a): two FFMAs, a MUFU, an FFMA and an FMUL per element.
// A vector holding the target or the argmax takes the generic per-element code (the target's 1 - p exactly).
template <class T, bool kPlain>
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
    const auto generic_vector = [&](const int4& raw, std::int64_t j) {
      float u[kCount];
      widen_vector<T>(raw, u);
#pragma unroll
      for (int k = 0; k < kCount; ++k) u[k] = value(u[k], j * kCount + k);
      return narrow_vector<T>(u);
    };
    if (kPlain && vectorized) {
      const float log_sum_log2e = log_sum * kLog2e;
      const float s1 = scale * coef_c * kLn2, s2 = scale * (coef_c * shift - coef_a);
      const int target_vector = target >= 0 ? static_cast<int>(target / kCount) : -1;
      const int argmax_vector = argmax >= 0 ? static_cast<int>(argmax / kCount) : -1;
      int4* ov = reinterpret_cast<int4*>(out);
      for_each_vector(reinterpret_cast<const int4*>(x), static_cast<int>(a.cols / kCount), [&](const int4& raw, int j) {
        if (j == target_vector || j == argmax_vector) {
          __stcs(ov + j, generic_vector(raw, j));
          return;
        }
        __stcs(ov + j, map_vector<T>(raw, [&](float xv) {
                 const float l = fmaf(fmaf(xv, a.inverse_temperature, -max), kLog2e, -log_sum_log2e);
                 return ex2_ftz(l) * fmaf(s1, l, s2);
               }));
      });
    } else if (vectorized) {
      const int4* xv = reinterpret_cast<const int4*>(x);
      int4* ov = reinterpret_cast<int4*>(out);
      for_each_vector(xv, static_cast<int>(a.cols / kCount),
                      [&](const int4& raw, int j) { ov[j] = generic_vector(raw, j); });
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

// Whether the plain per-element code applies (x / T not rounded; the gradient also needs
// PolicyGradRounding::none); LOSSVERIFY_POLICY_GENERIC=1 turns it off (a tuning aid: the generic code for every row).
bool plain_path(const PolicyKernelArgs& args) {
  static const bool generic_only = [] {
    const char* e = std::getenv("LOSSVERIFY_POLICY_GENERIC");
    return e != nullptr && e[0] == '1';
  }();
  return !generic_only && args.round_scaled == 0;
}

}  // namespace

void policy_local_stats(StorageType type, const PolicyKernelArgs& args, float* stats, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = can_vectorize<T>(args.logits, nullptr, args.cols);
    const auto launch = [&](auto kernel) {
      kernel<<<grid_for(args.rows), threads_for<T>(args.cols), 0, static_cast<cudaStream_t>(stream)>>>(args, stats,
                                                                                                       vectorized);
    };
    if (plain_path(args)) {
      launch(stats_kernel<T, true>);
    } else {
      launch(stats_kernel<T, false>);
    }
  });
}

void policy_gradient(StorageType type, const PolicyKernelArgs& args, const float* rows, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = can_vectorize<T>(args.logits, args.grad, args.cols);
    const auto launch = [&](auto kernel) {
      kernel<<<grid_for(args.rows), threads_for<T>(args.cols), 0, static_cast<cudaStream_t>(stream)>>>(args, rows,
                                                                                                       vectorized);
    };
    if (plain_path(args) && args.grad_rounding == 0) {
      launch(grad_kernel<T, true>);
    } else {
      launch(grad_kernel<T, false>);
    }
  });
}

}  // namespace lossverify::cuda
