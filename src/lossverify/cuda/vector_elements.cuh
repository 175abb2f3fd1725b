#pragma once
// Per-element pieces of the loss kinds' plain (uncatalogued) kernel paths, chosen from the instruction counts
// in the SASS: the elements of one 16-byte vector widened and packed back, packed maxima, and ex2 without
// exp2f's subnormal fix-up. Included by .cu files only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace lossverify::cuda {

// ex2 without exp2f's subnormal fix-up (three instructions per call): results below 2^-126 flush to 0,
// where a gradient element is far below every tolerance's absolute floor.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// f(x, e) for the elements e of one 16-byte vector, widened without a shift for bf16's upper halves.
template <class T, class F>
__device__ __forceinline__ void each_element(const int4& v, F&& f) {
  const std::uint32_t w[4] = {static_cast<std::uint32_t>(v.x), static_cast<std::uint32_t>(v.y),
                              static_cast<std::uint32_t>(v.z), static_cast<std::uint32_t>(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if constexpr (std::is_same_v<T, float>) {
      f(__uint_as_float(w[q]), q);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f(__uint_as_float(w[q] << 16), 2 * q);
      f(__uint_as_float(w[q] & 0xffff0000u), 2 * q + 1);
    } else {
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&w[q]));
      f(t.x, 2 * q);
      f(t.y, 2 * q + 1);
    }
  }
}

// The 16-byte vector of out[e] = g(x_e, e) for the elements of `in`, packed two at a time.
template <class T, class G>
__device__ __forceinline__ int4 map_vector_indexed(const int4& in, G&& g) {
  float y[16 / sizeof(T)];
  each_element<T>(in, [&](float x, int e) { y[e] = g(x, e); });
  std::uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if constexpr (std::is_same_v<T, float>) {
      w[q] = __float_as_uint(y[q]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(y[2 * q], y[2 * q + 1]);
      w[q] = *reinterpret_cast<const std::uint32_t*>(&h);
    } else {
      const __half2 h = __floats2half2_rn(y[2 * q], y[2 * q + 1]);
      w[q] = *reinterpret_cast<const std::uint32_t*>(&h);
    }
  }
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}
template <class T, class G>
__device__ __forceinline__ int4 map_vector(const int4& in, G&& g) {
  return map_vector_indexed<T>(in, [&](float x, int) { return g(x); });
}

// Running max of a vector's elements: packed (two per instruction, exact) for 16-bit types.
template <class T>
__device__ __forceinline__ void packed_max(const int4& v, int4& acc) {
  if constexpr (std::is_same_v<T, float>) {
    acc.x = __float_as_int(fmaxf(__int_as_float(acc.x), __int_as_float(v.x)));
    acc.y = __float_as_int(fmaxf(__int_as_float(acc.y), __int_as_float(v.y)));
    acc.z = __float_as_int(fmaxf(__int_as_float(acc.z), __int_as_float(v.z)));
    acc.w = __float_as_int(fmaxf(__int_as_float(acc.w), __int_as_float(v.w)));
  } else {
    using P = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    const P* a = reinterpret_cast<const P*>(&v);
    P* b = reinterpret_cast<P*>(&acc);
#pragma unroll
    for (int q = 0; q < 4; ++q) b[q] = __hmax2(b[q], a[q]);
  }
}
template <class T>
__device__ __forceinline__ int4 lowest_vector() {
  if constexpr (std::is_same_v<T, float>) {
    const int n = __float_as_int(-INFINITY);
    return make_int4(n, n, n, n);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const int n = 0xff80ff80;  // -inf, -inf
    return make_int4(n, n, n, n);
  } else {
    const int n = static_cast<int>(0xfc00fc00u);
    return make_int4(n, n, n, n);
  }
}

// The largest element of one vector (exact): packed pairs for 16-bit types, then the last two widened.
template <class T>
__device__ __forceinline__ float vector_max(const int4& v) {
  if constexpr (std::is_same_v<T, float>) {
    return fmaxf(fmaxf(__int_as_float(v.x), __int_as_float(v.y)), fmaxf(__int_as_float(v.z), __int_as_float(v.w)));
  } else {
    using P = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    const P* a = reinterpret_cast<const P*>(&v);
    const P pair = __hmax2(__hmax2(a[0], a[1]), __hmax2(a[2], a[3]));
    float m = -INFINITY;
    each_element<T>(make_int4(*reinterpret_cast<const int*>(&pair), 0, 0, 0), [&](float x, int e) {
      if (e < 2) m = fmaxf(m, x);
    });
    return m;
  }
}

// f(v, i) for each 16-byte vector i of `row` (`vectors` of them, v = load(row + i)), the block's threads striding over
// it with kBatch loads in flight per thread before the first use, the row's last strides too: one loop, guarded per
// vector (a second loop for the rest doubled the code and its registers, and one load per round trip there left the
// shard kernels latency-bound). Vector indices are 32-bit: a row of 2^31 vectors would be 32 GB.
template <int kBatch, class Load, class F>
__device__ __forceinline__ void for_each_vector(const int4* row, int vectors, Load&& load, F&& f) {
  const int stride = static_cast<int>(blockDim.x);
  for (int i = static_cast<int>(threadIdx.x); i < vectors; i += kBatch * stride) {
    int4 batch[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (i + b * stride < vectors) batch[b] = load(row + i + b * stride);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (i + b * stride < vectors) f(batch[b], i + b * stride);
    }
  }
}

}  // namespace lossverify::cuda
