// The float64 reference on the GPU (see reference_kernels.hpp). One block per row, 256 threads; every
// thread keeps compensated partial sums of its columns, and the block combines them with a fixed
// shuffle tree, so results are deterministic. Built with -fmad=false: no contraction changes a rounding.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>
#include <initializer_list>

#include "lossverify/impl/cuda/bulk_copy.cuh"
#include "lossverify/impl/cuda/device_types.cuh"
#include "lossverify/impl/cuda/reference_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kReferenceThreads = 256;

struct Neumaier {
  double s = 0.0, c = 0.0;
  __device__ void add(double x) {
    const double t = s + x;
    if (fabs(s) >= fabs(x)) {
      c += (s - t) + x;
    } else {
      c += (x - t) + s;
    }
    s = t;
  }
  __device__ void merge(const Neumaier& o) {
    add(o.s);
    add(o.c);
  }
};

// Max and compensated sum of exp(z - max), as merged between threads.
struct OnlineLse {
  double m = -INFINITY;
  Neumaier sum;
  __device__ void merge(const OnlineLse& o) {
    const double mm = fmax(m, o.m);
    if (mm == -INFINITY) return;
    const double f = m == -INFINITY ? 0.0 : exp(m - mm);
    const double g = o.m == -INFINITY ? 0.0 : exp(o.m - mm);
    Neumaier r;
    r.add(sum.s * f);
    r.add(sum.c * f);
    r.add(o.sum.s * g);
    r.add(o.sum.c * g);
    sum = r;
    m = mm;
  }
};

__device__ Neumaier shfl(const Neumaier& x, int offset) {
  Neumaier r;
  r.s = __shfl_down_sync(0xffffffffu, x.s, offset);
  r.c = __shfl_down_sync(0xffffffffu, x.c, offset);
  return r;
}
__device__ OnlineLse shfl(const OnlineLse& x, int offset) {
  OnlineLse r;
  r.m = __shfl_down_sync(0xffffffffu, x.m, offset);
  r.sum = shfl(x.sum, offset);
  return r;
}

// A fixed reduction tree over the block: lane pairs within each warp, then the warps' results by the same
// tree in warp 0 (no serial chain on one thread); thread 0 gets the result. The same inputs give the same
// bits whatever the scheduling. Merging with a default State changes nothing.
template <int kBlock = kReferenceThreads, class State>
__device__ State block_merge(State x) {
  constexpr int kWarps = kBlock / 32;
  static_assert(kWarps >= 1 && kWarps <= 32 && (kWarps & (kWarps - 1)) == 0, "a power-of-two number of warps");
  // Raw storage: __shared__ variables cannot have constructors.
  __shared__ alignas(State) unsigned char storage[sizeof(State) * kWarps];
  State* warps = reinterpret_cast<State*>(storage);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const State o = shfl(x, offset);
    if (lane < offset) x.merge(o);
  }
  if (lane == 0) warps[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? warps[lane] : State{};
    for (int offset = kWarps / 2; offset > 0; offset >>= 1) {
      const State o = shfl(x, offset);
      if (lane < offset) x.merge(o);
    }
  }
  __syncthreads();
  return x;
}

__device__ double capped(double x, double cap) { return cap > 0.0 ? cap * tanh(x / cap) : x; }

// 16 bytes of a row.
template <class T>
struct alignas(16) Pack {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

// Calls visit(column, x, y, g) for this thread's columns of one row, from up to three rows of the same
// shape (y and g read only when kY / kG): 16-byte loads where the rows allow them, then the tail.
template <bool kY, bool kG, class T, class Visit>
__device__ __forceinline__ void for_each_column(const T* x, const T* y, const T* g, int cols, bool vectorized,
                                                Visit&& visit) {
  constexpr int K = Pack<T>::kCount;
  int done = 0;
  if (vectorized) {
    const int packs = cols / K;
    for (int i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T> a = reinterpret_cast<const Pack<T>*>(x)[i];
      Pack<T> b{}, c{};
      if constexpr (kY) b = reinterpret_cast<const Pack<T>*>(y)[i];
      if constexpr (kG) c = reinterpret_cast<const Pack<T>*>(g)[i];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        visit(i * K + k, widen<T>(a.v[k]), kY ? widen<T>(b.v[k]) : 0.0f, kG ? widen<T>(c.v[k]) : 0.0f);
      }
    }
    done = packs * K;
  }
  for (int c = done + static_cast<int>(threadIdx.x); c < cols; c += blockDim.x) {
    visit(c, widen<T>(x[c]), kY ? widen<T>(y[c]) : 0.0f, kG ? widen<T>(g[c]) : 0.0f);
  }
}

template <class T>
bool rows_vectorizable(std::int64_t cols, std::initializer_list<const void*> bases) {
  if ((cols * static_cast<std::int64_t>(sizeof(T))) % 16 != 0) return false;
  for (const void* p : bases) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Online max and a plain float64 sum of exp(z - max) per thread (a few hundred terms: relative error
// below 1e-13); threads are combined with compensated sums.
struct ThreadLse {
  double m = -INFINITY, s = 0.0;
  __device__ __forceinline__ void add(double z) {
    if (z > m) {
      s *= exp(m - z);  // 0 when m = -inf
      m = z;
    }
    s += exp(z - m);
  }
  __device__ OnlineLse online() const {
    OnlineLse o;
    o.m = m;
    o.sum.s = s;
    return o;
  }
};

template <class T>
__global__ void __launch_bounds__(kReferenceThreads) partials_kernel(ReferencePartialArgs a, double* out, bool vectorized) {
  const T* student = static_cast<const T*>(a.student);
  const T* teacher = static_cast<const T*>(a.teacher);
  const int cols = static_cast<int>(a.cols);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    if (!a.valid[r]) continue;
    const T* x = student + r * a.cols;
    ThreadLse lse_t, teacher_t;
    double qx_t = 0.0;
    if (a.kd) {
      const T* y = teacher + r * a.cols;
      const double inverse_t = a.inverse_temperature;
      for_each_column<true, false>(x, y, x, cols, vectorized, [&](int, float xv, float yv, float) {
        lse_t.add(static_cast<double>(xv) * inverse_t);
        teacher_t.add(static_cast<double>(yv) * inverse_t);
      });
    } else {
      const std::int64_t label = a.label[r] - a.begin;  // local column of the label (may be outside)
      const double cap = a.softcap, q_on = a.q_on, q_off = a.q_off;
      for_each_column<false, false>(x, x, x, cols, vectorized, [&](int v, float xv, float, float) {
        const double z = capped(static_cast<double>(xv), cap);
        lse_t.add(z);
        qx_t += (v == label ? q_on : q_off) * z;
      });
    }
    const OnlineLse lse = block_merge(lse_t.online());
    const OnlineLse teacher_lse = block_merge(teacher_t.online());
    Neumaier qx_start;
    qx_start.s = qx_t;
    const Neumaier qx = block_merge(qx_start);
    if (threadIdx.x == 0) {
      double* o = out + 8 * r;
      o[0] = lse.m;
      o[1] = lse.sum.s;
      o[2] = lse.sum.c;
      o[3] = qx.s;
      o[4] = qx.c;
      o[5] = teacher_lse.m;
      o[6] = teacher_lse.sum.s;
      o[7] = teacher_lse.sum.c;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kReferenceThreads) kl_kernel(ReferenceKlArgs a, double* out) {
  const T* student = static_cast<const T*>(a.student);
  const T* teacher = static_cast<const T*>(a.teacher);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    if (!a.valid[r]) continue;
    const T* x = student + r * a.cols;
    const T* y = teacher + r * a.cols;
    Neumaier kl;
    for (std::int64_t v = threadIdx.x; v < a.cols; v += blockDim.x) {
      const double log_p = static_cast<double>(widen<T>(y[v])) * a.inverse_temperature - a.teacher_lse[r];
      const double p = exp(log_p);
      if (p > 0.0) kl.add(p * (log_p - (static_cast<double>(widen<T>(x[v])) * a.inverse_temperature - a.lse[r])));
    }
    kl = block_merge(kl);
    if (threadIdx.x == 0) {
      out[2 * r] = kl.s;
      out[2 * r + 1] = kl.c;
    }
  }
}

// checks.cpp's GradJudge, element by element.
__device__ double margin_of(double error, double tolerance) {
  if (isnan(error)) return INFINITY;
  if (error == 0.0) return 0.0;
  if (tolerance <= 0.0) return INFINITY;
  return error / tolerance;
}
// The binary exponent of the dtype's spacing at value (core/dtype.cpp's ulp_size, on the device).
__device__ int spacing_exponent(double value, int dtype) {
  int mantissa_bits = 23, min_exponent = -126;
  if (dtype == static_cast<int>(StorageType::bf16)) mantissa_bits = 7;
  if (dtype == static_cast<int>(StorageType::fp16)) {
    mantissa_bits = 10;
    min_exponent = -14;
  }
  const auto bits = static_cast<unsigned long long>(__double_as_longlong(value));
  const int exponent = static_cast<int>((bits >> 52) & 0x7ff) - 1023;
  return max(exponent, min_exponent) - mantissa_bits;
}
__device__ double ulp_size(double value, int dtype) {
  return __longlong_as_double(static_cast<long long>(spacing_exponent(value, dtype) + 1023) << 52);
}
// 1 / ulp_size(value): a power of two, so multiplying by it is the exact division.
__device__ double ulp_size_inverse(double value, int dtype) {
  return __longlong_as_double(static_cast<long long>(1023 - spacing_exponent(value, dtype)) << 52);
}
__device__ std::int64_t ordered_bits(double value, int dtype, double& rounded) {
  const float f = __double2float_rn(value);
  unsigned int magnitude = 0;
  if (dtype == static_cast<int>(StorageType::bf16)) {
    const __nv_bfloat16 b = __float2bfloat16_rn(f);
    rounded = __bfloat162float(b);
    magnitude = __bfloat16_as_ushort(b) & 0x7fffu;
  } else if (dtype == static_cast<int>(StorageType::fp16)) {
    const __half h = __float2half_rn(f);
    rounded = __half2float(h);
    magnitude = __half_as_ushort(h) & 0x7fffu;
  } else {
    rounded = f;
    magnitude = __float_as_uint(f) & 0x7fffffffu;
  }
  return signbit(value) ? -static_cast<std::int64_t>(magnitude) : static_cast<std::int64_t>(magnitude);
}
__device__ std::int64_t ulp_distance(double a, double b, int dtype) {
  double ra = 0.0, rb = 0.0;
  const std::int64_t ba = ordered_bits(a, dtype, ra), bb = ordered_bits(b, dtype, rb);
  if (isnan(ra) || isnan(rb) || isinf(ra) || isinf(rb)) return ra == rb ? 0 : LLONG_MAX;
  const std::int64_t d = ba - bb;
  return d < 0 ? -d : d;
}

struct CompareState {
  std::int64_t compared = 0, mismatches = 0, max_ulp = 0, worst_column = -1, first_bad_column = -1;
  std::int64_t nan = 0, pos_inf = 0, neg_inf = 0, subnormal = 0;
  double max_abs = 0.0, max_rel = 0.0, margin = 0.0, worst_expected = 0.0, worst_got = 0.0, worst_tolerance = 0.0;
  double first_bad_value = 0.0;
  Neumaier sum, magnitude;

  // ErrorStats::add_with_margin's extrema. A tie of margins keeps the lower column, whatever the order in
  // which a thread visits its columns (merge() breaks ties between threads the same way).
  __device__ __forceinline__ void extrema(double expected, double error) {
    if (isnan(error)) {
      max_abs = INFINITY;
      return;
    }
    if (error > max_abs) max_abs = error;
    // The division only where it can raise the maximum (the factor covers the product's rounding).
    if (expected != 0.0 && error > max_rel * fabs(expected) * (1.0 - 1e-12)) max_rel = fmax(max_rel, error / fabs(expected));
  }
  __device__ __forceinline__ void worst(int column, double m, double expected, double got, double tolerance) {
    if (worst_column < 0 || m > margin || (m == margin && column < worst_column)) {
      margin = m;
      worst_column = column;
      worst_expected = expected;
      worst_got = got;
      worst_tolerance = tolerance;
    }
  }
  __device__ void census(int column, double value, double smallest_normal) {
    if (isnan(value)) {
      ++nan;
    } else if (isinf(value)) {
      ++(value > 0 ? pos_inf : neg_inf);
    } else if (value != 0.0 && fabs(value) < smallest_normal) {
      ++subnormal;
    }
    if (!isfinite(value) && (first_bad_column < 0 || column < first_bad_column)) {
      first_bad_column = column;
      first_bad_value = value;
    }
  }
  __device__ void merge(const CompareState& o) {
    compared += o.compared;
    mismatches += o.mismatches;
    max_ulp = max(max_ulp, o.max_ulp);
    nan += o.nan;
    pos_inf += o.pos_inf;
    neg_inf += o.neg_inf;
    subnormal += o.subnormal;
    max_abs = fmax(max_abs, o.max_abs);
    max_rel = fmax(max_rel, o.max_rel);
    if (o.worst_column >= 0 &&
        (worst_column < 0 || o.margin > margin || (o.margin == margin && o.worst_column < worst_column))) {
      margin = o.margin;
      worst_column = o.worst_column;
      worst_expected = o.worst_expected;
      worst_got = o.worst_got;
      worst_tolerance = o.worst_tolerance;
    }
    if (o.first_bad_column >= 0 && (first_bad_column < 0 || o.first_bad_column < first_bad_column)) {
      first_bad_column = o.first_bad_column;
      first_bad_value = o.first_bad_value;
    }
    sum.merge(o.sum);
    magnitude.merge(o.magnitude);
  }
};

__device__ CompareState shfl(const CompareState& x, int offset) {
  CompareState r;
  r.compared = __shfl_down_sync(0xffffffffu, x.compared, offset);
  r.mismatches = __shfl_down_sync(0xffffffffu, x.mismatches, offset);
  r.max_ulp = __shfl_down_sync(0xffffffffu, x.max_ulp, offset);
  r.worst_column = __shfl_down_sync(0xffffffffu, x.worst_column, offset);
  r.first_bad_column = __shfl_down_sync(0xffffffffu, x.first_bad_column, offset);
  r.nan = __shfl_down_sync(0xffffffffu, x.nan, offset);
  r.pos_inf = __shfl_down_sync(0xffffffffu, x.pos_inf, offset);
  r.neg_inf = __shfl_down_sync(0xffffffffu, x.neg_inf, offset);
  r.subnormal = __shfl_down_sync(0xffffffffu, x.subnormal, offset);
  r.max_abs = __shfl_down_sync(0xffffffffu, x.max_abs, offset);
  r.max_rel = __shfl_down_sync(0xffffffffu, x.max_rel, offset);
  r.margin = __shfl_down_sync(0xffffffffu, x.margin, offset);
  r.worst_expected = __shfl_down_sync(0xffffffffu, x.worst_expected, offset);
  r.worst_got = __shfl_down_sync(0xffffffffu, x.worst_got, offset);
  r.worst_tolerance = __shfl_down_sync(0xffffffffu, x.worst_tolerance, offset);
  r.first_bad_value = __shfl_down_sync(0xffffffffu, x.first_bad_value, offset);
  r.sum = shfl(x.sum, offset);
  r.magnitude = shfl(x.magnitude, offset);
  return r;
}

__device__ void store_comparison(const CompareState& st, RowComparison& o) {
  o.compared = st.compared;
  o.mismatches = st.mismatches;
  o.max_ulp = st.max_ulp;
  o.worst_column = st.worst_column;
  o.first_bad_column = st.first_bad_column;
  o.nan = st.nan;
  o.pos_inf = st.pos_inf;
  o.neg_inf = st.neg_inf;
  o.subnormal = st.subnormal;
  o.max_abs = st.max_abs;
  o.max_rel = st.max_rel;
  o.margin = st.margin;
  o.worst_expected = st.worst_expected;
  o.worst_got = st.worst_got;
  o.worst_tolerance = st.worst_tolerance;
  o.sum = st.sum.s;
  o.sum_error = st.sum.c;
  o.magnitude = st.magnitude.s + st.magnitude.c;
  o.first_bad_value = st.first_bad_value;
}

// checks.cpp's GradJudge on one element of a valid or masked row (kinds 0 and 1), everything but the
// count and the row sums, which the callers keep. `floor` is the row's absolute floor.
__device__ void judge_element(CompareState& st, const ReferenceCompareArgs& a, double floor, int v, double got_local,
                              double expected) {
  const double fs = a.framework_scale;
  const double got = got_local * fs;
  const double magnitude_local = fabs(got_local);
  if (!(magnitude_local >= a.smallest_normal && magnitude_local <= DBL_MAX)) st.census(v, got_local, a.smallest_normal);
  const double error = got == expected ? 0.0 : fabs(got - expected);
  st.extrema(expected, error);
  if (a.max_ulp > 0) {
    const double local_expected = fs == 1.0 ? expected : expected / fs;
    const double local_error = got_local == local_expected ? 0.0 : fabs(got_local - local_expected);
    const double inverse_spacing = ulp_size_inverse(local_expected, a.dtype);
    const double in_spacings = local_error * inverse_spacing;  // exact: a power of two
    if (!(in_spacings < 0.5)) {
      st.max_ulp = max(st.max_ulp, ulp_distance(got_local, local_expected, a.dtype));
    }
    const double by_ulp = a.max_ulp == 1 ? in_spacings : local_error / (a.max_ulp * ulp_size(local_expected, a.dtype));
    // m = min(by_ulp, by_floor) <= by_ulp: when by_ulp is within 1 and below the worst so far, the
    // element neither mismatches nor becomes (or ties) the worst, and by_floor is not needed.
    if (st.worst_column < 0 || !(by_ulp <= 1.0 && by_ulp < st.margin)) {
      const double by_floor = margin_of(error, floor);
      double m = by_floor < by_ulp ? by_floor : by_ulp;  // std::min
      const bool mismatch = !(m <= 1.0);
      if (isnan(error)) m = INFINITY;
      st.mismatches += mismatch;
      st.worst(v, m, expected, got, floor + a.rtol * fabs(expected));
    }
  } else {
    const double tol = floor + a.rtol * fabs(expected);
    const bool mismatch = !(error <= tol);
    st.mismatches += mismatch;
    if (st.worst_column < 0 || mismatch || !(error <= st.margin * tol * (1.0 - 1e-12))) {
      st.worst(v, margin_of(error, tol), expected, got, tol);
    }
  }
}

// A CP padding row's element (kind 2): masked, so the gradient must be exactly zero.
__device__ void judge_padding(CompareState& st, const ReferenceCompareArgs& a, int v, double got_local) {
  const double got = got_local * a.framework_scale;
  const double magnitude_local = fabs(got_local);
  if (!(magnitude_local >= a.smallest_normal && magnitude_local <= DBL_MAX)) st.census(v, got_local, a.smallest_normal);
  const bool mismatch = got != 0.0;
  st.mismatches += mismatch;
  st.extrema(0.0, got == 0.0 ? 0.0 : fabs(got));
  st.worst(v, mismatch ? INFINITY : 0.0, 0.0, got, 0.0);
}

// Every element of a row against the reference gradient, judged as checks.cpp's GradJudge judges it.
// Divisions are taken only where their quotient can matter: a new worst element, a mismatch, a new
// maximum relative error; elsewhere a comparison decides.
template <class T>
__global__ void __launch_bounds__(kReferenceThreads, 4) compare_kernel(ReferenceCompareArgs a, RowComparison* out,
                                                                         bool vectorized) {
  const T* student = static_cast<const T*>(a.student);
  const T* teacher = static_cast<const T*>(a.teacher);
  const T* grad = static_cast<const T*>(a.grad);
  const int cols = static_cast<int>(a.cols);
  const double fs = a.framework_scale;
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int kind = a.kind[r];
    const T* x = student + r * a.cols;
    const T* y = a.kd ? teacher + r * a.cols : x;
    const T* g = grad + r * a.cols;
    const double weight = kind == 0 ? a.weight[r] : 0.0;
    const double floor = a.atol * (fabs(weight) * a.grad_scale) + a.quantum * fs;  // GradJudge: atol * token_scale + quantum * fs
    const double lse = kind == 0 ? a.lse[r] : 0.0;
    const double teacher_lse = kind == 0 && a.kd ? a.teacher_lse[r] : 0.0;
    const double z_factor = 1.0 + 2.0 * a.z_loss_weight * lse;
    const double kd_scale = weight * a.kd_grad_scale;
    const std::int64_t label = a.kd ? -1 : a.label[r] - a.begin;
    CompareState st;
    double row_sum = 0.0, row_magnitude = 0.0;
    auto visit = [&](int v, float xf, float yf, float gf) {
      const double got_local = gf;
      ++st.compared;
      if (kind == 2) {  // CP padding: masked, exactly zero
        judge_padding(st, a, v, got_local);
        return;
      }
      double expected = 0.0;
      if (kind == 0) {
        const double xv = xf;
        if (a.kd) {
          const double t = a.temperature;
          expected = kd_scale * (exp(xv / t - lse) - exp(static_cast<double>(yf) / t - teacher_lse));
        } else {
          const double p = exp(capped(xv, a.softcap) - lse);
          double d = p * z_factor - (v == label ? a.q_on : a.q_off);
          if (a.softcap > 0.0) {
            const double th = tanh(xv / a.softcap);
            d *= 1.0 - th * th;
          }
          expected = weight * d;
        }
      }
      const double got = got_local * fs;
      row_sum += got;
      row_magnitude += fabs(got);
      judge_element(st, a, floor, v, got_local, expected);
    };
    if (a.kd) {
      for_each_column<true, true>(x, y, g, cols, vectorized, visit);
    } else {
      for_each_column<false, true>(x, y, g, cols, vectorized, visit);
    }
    st.sum.s = row_sum;
    st.magnitude.s = row_magnitude;
    st = block_merge(st);
    if (threadIdx.x == 0) store_comparison(st, out[r]);
  }
}

// ---- Partials, lse and comparison in one pass over a row held in shared memory (reference_fused) ----
//
// For rows whole on one shard (cross-entropy without softcap, 16-bit storage): a cluster of up to 8 CTAs
// holds one row; the copy engine brings each CTA's slice of the logits and of the gradient into shared
// memory, the next row's while this one is computed. Pass A computes e_v = exp(x_v - m_t) in float64 once
// per element (m_t the thread's max) into shared memory with the thread's sums; the CTAs merge their
// partials through distributed shared memory in rank order, so every CTA gets the row's lse; pass B judges
// every element from e_v, expected_v = w z (e_v exp(m_t - lse)) - w q_v, without a second exp.

constexpr int kFusedChunk = 2048;                           // vectors per CTA (16384 16-bit elements)
constexpr int kFusedMaxCluster = 8;
constexpr int kFusedElements = 8;                           // 16-bit elements per vector
constexpr std::size_t kFusedSmem = static_cast<std::size_t>(kFusedChunk) * (16 + 16 + kFusedElements * sizeof(double));

// 2^(j/32), j = 0..31, correctly rounded.
__constant__ double kExp2Fractions[32] = {
    0x1.0000000000000p+0, 0x1.059b0d3158574p+0, 0x1.0b5586cf9890fp+0, 0x1.11301d0125b51p+0, 0x1.172b83c7d517bp+0,
    0x1.1d4873168b9aap+0, 0x1.2387a6e756238p+0, 0x1.29e9df51fdee1p+0, 0x1.306fe0a31b715p+0, 0x1.371a7373aa9cbp+0,
    0x1.3dea64c123422p+0, 0x1.44e086061892dp+0, 0x1.4bfdad5362a27p+0, 0x1.5342b569d4f82p+0, 0x1.5ab07dd485429p+0,
    0x1.6247eb03a5585p+0, 0x1.6a09e667f3bcdp+0, 0x1.71f75e8ec5f74p+0, 0x1.7a11473eb0187p+0, 0x1.82589994cce13p+0,
    0x1.8ace5422aa0dbp+0, 0x1.93737b0cdc5e5p+0, 0x1.9c49182a3f090p+0, 0x1.a5503b23e255dp+0, 0x1.ae89f995ad3adp+0,
    0x1.b7f76f2fb5e47p+0, 0x1.c199bdd85529cp+0, 0x1.cb720dcef9069p+0, 0x1.d5818dcfba487p+0, 0x1.dfc97337b9b5fp+0,
    0x1.ea4afa2a490dap+0, 0x1.f50765b6e4540p+0};

// exp(d) for -707 <= d <= 0 in float64 (table method): d = (32 k + j) ln2/32 + r with |r| <= ln2/64, so
// exp(d) = 2^k 2^(j/32) e^r, e^r - 1 by its degree-6 Taylor polynomial (truncation below 4e-18). About 2 ulp,
// against 1 for the CPU's std::exp; the reference's tolerances sit ten orders of magnitude above.
__device__ __forceinline__ double exp_nonpositive(double d, const double* table) {
  constexpr double kMagic = 0x1.8p52;  // adding it rounds to an integer, left in the low word
  const double t = fma(d, 0x1.71547652b82fep+5, kMagic);  // 32 / ln 2
  const int n = __double2loint(t);
  const double nd = t - kMagic;
  double r = fma(nd, -0x1.62e42fefa39efp-6, d);  // ln2 / 32, split in two
  r = fma(nd, -0x1.abc9e3b39803fp-61, r);
  double q = fma(r, 1.0 / 720.0, 1.0 / 120.0);
  q = fma(q, r, 1.0 / 24.0);
  q = fma(q, r, 1.0 / 6.0);
  q = fma(q, r, 0.5);
  const double p = fma(r * r, q, r);  // e^r - 1
  const double tj = table[n & 31];
  const double y = fma(tj, p, tj);  // in [0.98, 2): scaling by 2^k on the exponent field stays normal
  return __hiloint2double(__double2hiint(y) + ((n >> 5) * (1 << 20)), __double2loint(y));
}
__device__ __noinline__ double exp_far(double d) { return exp(d); }  // below -707, -inf and NaN

template <class T>
__device__ __forceinline__ float widen_bits(std::uint32_t bits) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  } else {
    return __uint_as_float(bits << 16);
  }
}

// Elements the fused pass judged in full (LOSSVERIFY_TRACE reports it: the screen's efficiency).
__device__ unsigned long long fused_judged = 0;

// One CTA's float64 partials of a row, exchanged through distributed shared memory.
struct FusedSlot {
  double m, s, c, qx_s, qx_c;
};

// Screening in pass B (ULP mode, no framework scale). The row's final CompareState is an order-free function
// of its elements: maxima (max_abs, max_rel, the worst margin with the lowest column on ties), counts
// (mismatches, ulp distances, census) and the first non-finite column. An element that provably changes none
// of them is left out of the full judgement; every other element is judged by judge_element with the
// two-pass kernel's own expected value, w (exp(x - lse) z - q), from x and the row's lse, so equal logits give
// equal expected values and ties fall to the lower column as on the CPU.
// The screen uses the cheap estimate expected' = (w z exp(m_t - lse)) e + b, within
// delta = 1e-13 (|expected'| + 2 |b_off|) of the judged value (the label's element, with b_on, is always judged) (a few float64 roundings of terms of those sizes), so
// the judged error lies within error' +- delta. With error_up = error' + delta and s_up = error_up / spacing:
//   - error_up < B_abs, a lower bound of the row's max_abs: not the maximum;
//   - s_up < 0.5: no ulp distance to count;
//   - min(error_up / floor, s_up / max_ulp) < min(1, B_worst), B_worst a lower bound of the row's worst
//     margin: neither a mismatch nor the worst, nor tied with it;
//   - s_up <= 2^mantissa B_rel (m - 2^-20), m = |expected'| 2^-e truncated to 20 fraction bits, so that
//     |expected| > 2^e (m - 2^-21) and error / |expected| <= B_rel, the row's max_rel bound;
//   - the stored value is normal or zero (no census); expected' of the dtype's normal range, at least 2^-20 of
//     itself from a power of two and delta below 2^-21 of it, so the judged value has the same spacing.
// A masked row's expected is exactly 0 (delta = 0); an element there with error 0 changes nothing but the
// worst of an all-zero row, which column 0, always judged, takes. The bounds are the values of judged
// elements, or seeds below one element's lower estimates, published in shared memory: they only rise, and
// a stale read is a lower bound still.
__device__ __forceinline__ void publish_max(unsigned long long* bound, double value) {
  if (value > 0.0) atomicMax(bound, static_cast<unsigned long long>(__double_as_longlong(value)));  // bits order as values
}
__device__ __forceinline__ double read_bound(const unsigned long long* bound) {
  return __longlong_as_double(static_cast<long long>(*const_cast<const volatile unsigned long long*>(bound)));
}
__device__ __forceinline__ double warp_max(double x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// What the full judgement of a fused row's elements needs.
struct FusedRow {
  const ReferenceCompareArgs* a;
  const void* x_row;  // the row's logits in global memory (the staged copy already holds the next row)
  std::int64_t label;
  double lse, weight, z_factor, floor;
  int kind;
  bool screen;
};

// The elements of one 16-byte gradient vector flagged in `judge`, judged in full with the two-pass kernel's
// expected value (the order of visits does not matter: CompareState breaks ties by column). Returns the row
// sums' increments where the screen did not already add them.
template <class T>
__device__ __forceinline__ double2 judge_vector(const FusedRow& row, CompareState* st, int column0, unsigned judge,
                                             int4 raw) {
  const ReferenceCompareArgs& a = *row.a;
  const std::uint32_t w[4] = {static_cast<std::uint32_t>(raw.x), static_cast<std::uint32_t>(raw.y),
                              static_cast<std::uint32_t>(raw.z), static_cast<std::uint32_t>(raw.w)};
  double sum = 0.0, magnitude = 0.0;
  for (int k = 0; k < kFusedElements; ++k) {
    if (!((judge >> k) & 1u)) continue;
    const double got = widen_bits<T>((w[k / 2] >> (16 * (k % 2))) & 0xffffu);
    const int column = column0 + k;
    if (row.kind == 2) {
      judge_padding(*st, a, column, got);
      continue;
    }
    if (!row.screen) {
      sum += got * a.framework_scale;
      magnitude += fabs(got * a.framework_scale);
    }
    double expected = 0.0;
    if (row.kind == 0) {  // compare_kernel's expected value (no softcap here)
      const double p = exp(static_cast<double>(widen<T>(static_cast<const T*>(row.x_row)[column])) - row.lse);
      expected = row.weight * (p * row.z_factor - (column == row.label ? a.q_on : a.q_off));
    }
    judge_element(*st, a, row.floor, column, got, expected);
  }
  atomicAdd(&fused_judged, static_cast<unsigned long long>(__popc(judge)));
  return make_double2(sum, magnitude);
}

template <class T, int kFusedBlock>
__global__ void __launch_bounds__(kFusedBlock, 1)
    fused_kernel(ReferenceCompareArgs a, double* partials, double* lse_out, RowComparison* out) {
  static_assert(sizeof(T) == 2, "the fused reference holds 16-bit rows");
  constexpr int kFusedPerThread = kFusedChunk / kFusedBlock;  // 16-byte vectors per thread
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const unsigned size = cluster.num_blocks();
  const std::int64_t clusters = gridDim.x / size;
  constexpr int K = kFusedElements;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr int kMantissa = kHalf ? 10 : 7;
  constexpr unsigned kExponentMask = kHalf ? 0x7c00u : 0x7f80u;
  constexpr int kMinExponent = kHalf ? -14 : -126;
  const int vectors = static_cast<int>(a.cols / K);
  const int first_vector = static_cast<int>(rank) * kFusedChunk;
  const int chunk = max(0, min(vectors - first_vector, kFusedChunk));
  const int limit = chunk - static_cast<int>(threadIdx.x);
  extern __shared__ int4 fused_smem[];
  int4* xs = fused_smem;                                     // this CTA's slice of the logits
  int4* gs = fused_smem + kFusedChunk;                       // and of the gradient
  double* es = reinterpret_cast<double*>(gs + kFusedChunk);  // es[k kFusedChunk + vector]: e of element k
  __shared__ double table[32];
  __shared__ std::uint64_t x_loaded, g_loaded;
  __shared__ FusedSlot lse_slot[2];
  __shared__ alignas(CompareState) unsigned char compare_storage[2 * sizeof(CompareState)];
  CompareState* compare_slot = reinterpret_cast<CompareState*>(compare_storage);
  __shared__ double row_lse;
  __shared__ unsigned long long bounds[3];  // pass B's lower bounds: the row's worst margin, max_rel, max_abs
  __shared__ unsigned char flags[kFusedChunk];  // per vector: its elements to judge in full
  __shared__ short flagged[kFusedChunk];        // the vectors with flags, compacted
  __shared__ int warp_counts[kFusedBlock / 32];
  if (threadIdx.x < 32) table[threadIdx.x] = kExp2Fractions[threadIdx.x];
  if (threadIdx.x == 0) {
    barrier_init(&x_loaded);
    barrier_init(&g_loaded);
  }
  __syncthreads();
  auto prefetch = [&](const void* base, std::int64_t r, int4* destination, std::uint64_t* barrier) {
    const int4* row = reinterpret_cast<const int4*>(static_cast<const T*>(base) + r * a.cols);
    bulk_load(destination, row + first_vector, static_cast<std::uint32_t>(chunk) * 16u, barrier);
  };
  std::int64_t r = blockIdx.x / size;
  if (threadIdx.x == 0 && r < a.rows) {
    prefetch(a.student, r, xs, &x_loaded);
    prefetch(a.grad, r, gs, &g_loaded);
  }
  const double fs = a.framework_scale;
  const bool screen = a.max_ulp > 0 && fs == 1.0;
  std::uint32_t phase = 0;
  int parity = 0;
  for (; r < a.rows; r += clusters) {
    const int kind = a.kind[r];  // the same for every CTA of the cluster: no barrier is skipped by some only
    const std::int64_t label = kind == 0 ? a.label[r] - a.begin : -1;
    const std::int64_t label_local = label - static_cast<std::int64_t>(first_vector) * K;  // in this CTA's slice
    const bool holds_label = label_local >= 0 && label_local < static_cast<std::int64_t>(chunk) * K &&
                             (label_local / K) % kFusedBlock == threadIdx.x;
    barrier_wait(&x_loaded, phase);
    int4 data[kFusedPerThread];
#pragma unroll
    for (int j = 0; j < kFusedPerThread; ++j) {
      data[j] = j * kFusedBlock < limit ? xs[threadIdx.x + j * kFusedBlock] : make_int4(0, 0, 0, 0);
    }
    const double x_label = holds_label ? static_cast<double>(widen<T>(reinterpret_cast<const T*>(xs)[label_local])) : 0.0;
    __syncthreads();  // every thread has its logits: the buffer takes the next row's
    if (threadIdx.x == 0 && r + clusters < a.rows) {
      async_proxy_fence();
      prefetch(a.student, r + clusters, xs, &x_loaded);
    }
    // Pass A: the thread's max (exact), then e = exp(x - m_t) per element and the thread's sums.
    double m_t = -INFINITY, s_t = 0.0, sx_t = 0.0;
    if (kind == 0) {
      float top = -INFINITY;
#pragma unroll
      for (int j = 0; j < kFusedPerThread; ++j) {
        if (j * kFusedBlock >= limit) continue;
        const Pack<T>& v = *reinterpret_cast<const Pack<T>*>(&data[j]);
#pragma unroll
        for (int k = 0; k < K; ++k) top = fmaxf(top, widen<T>(v.v[k]));
      }
      m_t = top;
#pragma unroll
      for (int j = 0; j < kFusedPerThread; ++j) {
        if (j * kFusedBlock >= limit) continue;
        const int v = static_cast<int>(threadIdx.x) + j * kFusedBlock;
        const Pack<T>& pack = *reinterpret_cast<const Pack<T>*>(&data[j]);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const double x = widen<T>(pack.v[k]);
          sx_t += x;
          double e = 0.0;
          if (m_t > -INFINITY) {  // a thread whose logits are all -inf contributes no mass
            const double d = x - m_t;
            e = d >= -707.0 ? exp_nonpositive(d, table) : exp_far(d);
          }
          es[k * kFusedChunk + v] = e;
          s_t += e;
        }
      }
    } else if (kind == 1) {  // a masked row: e = 0, so the screen's estimate is exactly 0
#pragma unroll
      for (int j = 0; j < kFusedPerThread; ++j) {
        if (j * kFusedBlock >= limit) continue;
#pragma unroll
        for (int k = 0; k < K; ++k) es[k * kFusedChunk + threadIdx.x + j * kFusedBlock] = 0.0;
      }
    }
    // The row's partials: threads by a fixed tree, then the CTAs in rank order, in every CTA alike.
    OnlineLse lse_t;
    lse_t.m = m_t;
    lse_t.sum.s = s_t;
    Neumaier qx_t;
    qx_t.s = a.q_off * sx_t + (holds_label ? (a.q_on - a.q_off) * x_label : 0.0);
    const OnlineLse lse_cta = block_merge<kFusedBlock>(lse_t);
    const Neumaier qx_cta = block_merge<kFusedBlock>(qx_t);
    if (threadIdx.x == 0) lse_slot[parity] = FusedSlot{lse_cta.m, lse_cta.sum.s, lse_cta.sum.c, qx_cta.s, qx_cta.c};
    cluster.sync();
    OnlineLse row;
    Neumaier qx;
    if (threadIdx.x < 32) {
      // Warp 0 of every CTA: lane c reads CTA c's slot, then a fixed tree over the lanes.
      const int lane = static_cast<int>(threadIdx.x);
      if (lane < static_cast<int>(size)) {
        const FusedSlot p = *cluster.map_shared_rank(&lse_slot[parity], static_cast<unsigned>(lane));
        row.m = p.m;
        row.sum.s = p.s;
        row.sum.c = p.c;
        qx.s = p.qx_s;
        qx.c = p.qx_c;
      }
      for (int offset = kFusedMaxCluster / 2; offset > 0; offset >>= 1) {
        const OnlineLse o = shfl(row, offset);
        const Neumaier q = shfl(qx, offset);
        if (lane < offset) {
          row.merge(o);
          qx.merge(q);
        }
      }
    }
    if (threadIdx.x == 0) {
      const double lse = row.m + log(row.sum.s + row.sum.c);
      row_lse = kind == 0 ? lse : 0.0;
      bounds[0] = bounds[1] = bounds[2] = 0ull;
      if (rank == 0 && kind == 0) {
        double* o = partials + 8 * r;
        o[0] = row.m;
        o[1] = row.sum.s;
        o[2] = row.sum.c;
        o[3] = qx.s;
        o[4] = qx.c;
        o[5] = -INFINITY;
        o[6] = 0.0;
        o[7] = 0.0;
        lse_out[r] = lse;
      }
    }
    __syncthreads();
    // Pass B: every element of the rank's gradient, screened with expected' = scale e + b_v.
    const double lse = row_lse;
    const double weight = kind == 0 ? a.weight[r] : 0.0;
    const double floor = a.atol * (fabs(weight) * a.grad_scale) + a.quantum * fs;
    const double z_factor = 1.0 + 2.0 * a.z_loss_weight * lse;
    const double scale = kind == 0 && m_t > -INFINITY ? weight * z_factor * exp(m_t - lse) : 0.0;
    const double b_off = -(weight * a.q_off), b_on = -(weight * a.q_on);
    const double slack_b = 2e-13 * fabs(b_off);  // the label's element, with b_on, is always judged
    const double inverse_floor = floor > 0.0 ? 1.0 / floor * (1.0 + 1e-12) : INFINITY;
    const double inverse_max_ulp = (1.0 + 1e-12) / a.max_ulp;
    const T* x_row = static_cast<const T*>(a.student) + r * a.cols;
    barrier_wait(&g_loaded, phase);
    phase ^= 1u;
    // The screen's estimate of an element's expected value off the label (exactly 0 in masked rows, where
    // scale, b_off and e are 0); the label's element is always judged.
    auto estimate = [&](int v, int k) { return fma(scale, es[k * kFusedChunk + v], b_off); };
    // error_up and s_up of an element; `usable` where its estimate is of the dtype's normal range (or 0) and
    // not within delta of a power of two.
    auto bounds_of = [&](double got, double expected, double& error_up, double& delta, bool& usable, double& mantissa) {
      const int hi = __double2hiint(expected) & 0x7fffffff;
      const int exponent = (hi >> 20) - 1023;
      const int mantissa_top = hi & 0xfffff;
      mantissa = __hiloint2double(mantissa_top | 0x3ff00000, 0);  // |expected| 2^-e truncated: <= it, > it - 2^-20
      delta = fma(fabs(expected), 1e-13, slack_b);
      error_up = fabs(got - expected) + delta;
      const int delta_exponent = (__double2hiint(delta) >> 20) - 1023;  // delta < 2^(delta_exponent + 1)
      usable = (exponent >= kMinExponent && exponent < 900 && mantissa_top != 0 && mantissa_top != 0xfffff &&
                delta_exponent < exponent - 21) ||
               (hi | __double2loint(expected)) == 0;
      return error_up * __hiloint2double((1023 + kMantissa - max(exponent, kMinExponent)) << 20, 0);
    };
    // ulp_size_inverse(expected) for this dtype.
    auto spacing_inverse = [&](double expected) {
      const int exponent = ((__double2hiint(expected) & 0x7fffffff) >> 20) - 1023;
      return __hiloint2double((1023 + kMantissa - max(exponent, kMinExponent)) << 20, 0);
    };
    if (screen && kind != 2) {
      // Seed the bounds from each thread's first vector: lower estimates of its elements' margins, ratios
      // and errors (the label's element left out: its estimate is not of this form).
      double seed_worst = 0.0, seed_rel = 0.0, seed_abs = 0.0;
      if (limit > 0) {
        const int4 raw = gs[threadIdx.x];
        const std::uint32_t w[4] = {static_cast<std::uint32_t>(raw.x), static_cast<std::uint32_t>(raw.y),
                                    static_cast<std::uint32_t>(raw.z), static_cast<std::uint32_t>(raw.w)};
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const double got = widen_bits<T>((w[k / 2] >> (16 * (k % 2))) & 0xffffu);
          const double expected = estimate(static_cast<int>(threadIdx.x), k);
          double error_up = 0.0, delta = 0.0, mantissa = 1.0;
          bool usable = false;
          const double s_up = bounds_of(got, expected, error_up, delta, usable, mantissa);
          const double error_low = fmax(error_up - 2.0 * delta, 0.0);
          const bool label_here = first_vector * K + static_cast<int>(threadIdx.x) * K + k == label;
          if (usable && !label_here && s_up < INFINITY) {
            const double s_low = error_low * spacing_inverse(expected);  // exact: a power of two
            const double floor_low = floor > 0.0 ? error_low * inverse_floor * (1.0 - 4e-12) : (error_low > 0.0 ? INFINITY : 0.0);
            const double margin_low = fmin(floor_low, s_low * inverse_max_ulp * (1.0 - 4e-12));
            // |expected| < 2^e (mantissa + 2^-20 + 2^-21): error / |expected| > s_low 2^-mantissa_bits / (mantissa + 2^-19)
            // (a tight seed: a loose one lets every warp's first steps judge most of their elements)
            if (margin_low == margin_low) seed_worst = fmax(seed_worst, margin_low);
            if (expected != 0.0) seed_rel = fmax(seed_rel, ldexp(s_low, -kMantissa) / (mantissa + 0x1p-19) * (1.0 - 1e-12));
            seed_abs = fmax(seed_abs, error_low);
          }
        }
      }
      seed_worst = warp_max(seed_worst);
      seed_rel = warp_max(seed_rel);
      seed_abs = warp_max(seed_abs);
      if ((threadIdx.x & 31) == 0) {
        publish_max(&bounds[0], seed_worst);
        publish_max(&bounds[1], seed_rel);
        publish_max(&bounds[2], seed_abs);
      }
      __syncthreads();
    }
    // The screen: every element's sums, and a flag byte per vector of the elements to judge in full.
    double row_sum = 0.0, row_magnitude = 0.0;
#pragma unroll
    for (int j = 0; j < kFusedPerThread; ++j) {
      if (j * kFusedBlock >= limit) continue;
      const int v = static_cast<int>(threadIdx.x) + j * kFusedBlock;
      const int4 raw = gs[v];
      const std::uint32_t w[4] = {static_cast<std::uint32_t>(raw.x), static_cast<std::uint32_t>(raw.y),
                                  static_cast<std::uint32_t>(raw.z), static_cast<std::uint32_t>(raw.w)};
      unsigned judge = 0xffu;
      if (screen && kind != 2) {
        const double b_worst = read_bound(&bounds[0]), b_rel = read_bound(&bounds[1]), b_abs = read_bound(&bounds[2]);
        const double rel_spacings = ldexp(b_rel, kMantissa);
        const double below_margin = fmin(1.0, b_worst);
        judge = 0u;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const std::uint32_t bits = (w[k / 2] >> (16 * (k % 2))) & 0xffffu;
          const double got = widen_bits<T>(bits);
          row_sum += got;
          row_magnitude += fabs(got);
          const double expected = estimate(v, k);
          double error_up = 0.0, delta = 0.0, mantissa = 1.0;
          bool usable = false;
          const double s_up = bounds_of(got, expected, error_up, delta, usable, mantissa);
          const bool subnormal_got = (bits & kExponentMask) == 0 && (bits & 0x7fffu) != 0;
          const double margin_up = fmin(error_up * inverse_floor, s_up * inverse_max_ulp);
          // |expected| > 2^e (mantissa - 2^-21): error / |expected| <= s_up 2^-mantissa_bits / (mantissa - 2^-20) <= B_rel
          const bool quiet = (error_up < b_abs && s_up < 0.5 && margin_up < below_margin &&
                              s_up <= rel_spacings * (mantissa - 0x1p-20)) ||
                             (kind == 1 && got == 0.0);
          judge |= usable && !subnormal_got && quiet ? 0u : 1u << k;
        }
        if (j == 0 && rank == 0 && threadIdx.x == 0) judge |= 1u;  // column 0
        if (label >= 0 && label / K == first_vector + v) judge |= 1u << (label % K);  // the label's column
      }
      flags[v] = static_cast<unsigned char>(judge);
    }
    // The flagged vectors in a compact list (a block scan of per-thread counts), judged by consecutive
    // threads: no warp waits on a few lanes' full judgements inside the screen.
    int mine = 0;
#pragma unroll
    for (int j = 0; j < kFusedPerThread; ++j) {
      if (j * kFusedBlock < limit && flags[threadIdx.x + j * kFusedBlock] != 0) ++mine;
    }
    const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
    int before = mine;  // inclusive scan within the warp
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, before, offset);
      if (lane >= offset) before += o;
    }
    if (lane == 31) warp_counts[warp] = before;
    __syncthreads();
    int warp_base = 0, total = 0;
    for (int w = 0; w < kFusedBlock / 32; ++w) {
      if (w < warp) warp_base += warp_counts[w];
      total += warp_counts[w];
    }
    int slot = warp_base + before - mine;
#pragma unroll
    for (int j = 0; j < kFusedPerThread; ++j) {
      const int v = static_cast<int>(threadIdx.x) + j * kFusedBlock;
      if (j * kFusedBlock < limit && flags[v] != 0) flagged[slot++] = static_cast<short>(v);
    }
    __syncthreads();
    const FusedRow row_info{&a, x_row, label, lse, weight, z_factor, floor, kind, screen};
    CompareState st;
    st.compared = static_cast<std::int64_t>(max(0, min(K * kFusedPerThread, K * ((limit + kFusedBlock - 1) / kFusedBlock))));
    for (int i = static_cast<int>(threadIdx.x); i < total; i += kFusedBlock) {
      const int v = flagged[i];
      const double2 sums = judge_vector<T>(row_info, &st, (first_vector + v) * K, flags[v], gs[v]);
      row_sum += sums.x;
      row_magnitude += sums.y;
    }
    st.sum.s = row_sum;
    st.magnitude.s = row_magnitude;
    st = block_merge<kFusedBlock>(st);  // ends with a block barrier: the gradient buffer has been read
    if (threadIdx.x == 0) {
      compare_slot[parity] = st;
      if (r + clusters < a.rows) {
        async_proxy_fence();
        prefetch(a.grad, r + clusters, gs, &g_loaded);
      }
    }
    cluster.sync();
    if (rank == 0 && threadIdx.x < 32) {
      // Warp 0 of CTA 0: lane c reads CTA c's state, then a fixed tree over the lanes.
      CompareState row;
      if (lane < static_cast<int>(size)) row = *cluster.map_shared_rank(&compare_slot[parity], static_cast<unsigned>(lane));
      for (int offset = kFusedMaxCluster / 2; offset > 0; offset >>= 1) {
        const CompareState o = shfl(row, offset);
        if (lane < offset) row.merge(o);
      }
      if (lane == 0) store_comparison(row, out[r]);
    }
    parity ^= 1;
  }
  cluster.sync();  // no CTA leaves while a peer may still read its slots
}

// Cluster size for rows of `cols` 16-bit elements; 0 where the fused reference does not apply.
int fused_cluster(std::int64_t cols) {
  const std::int64_t vectors = cols / kFusedElements;
  int cluster = 1;
  while (cluster * static_cast<std::int64_t>(kFusedChunk) < vectors) cluster *= 2;
  return cluster <= kFusedMaxCluster ? cluster : 0;
}

int reference_blocks(std::int64_t rows) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const std::int64_t blocks = static_cast<std::int64_t>(sms > 0 ? sms : 132) * 8;
  return static_cast<int>(rows < blocks ? rows : blocks);
}

}  // namespace

void reference_partials(StorageType type, const ReferencePartialArgs& args, double* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = rows_vectorizable<T>(args.cols, {args.student, args.teacher});
    partials_kernel<T><<<reference_blocks(args.rows), kReferenceThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        args, out, vectorized);
  });
}

void reference_kl(StorageType type, const ReferenceKlArgs& args, double* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    kl_kernel<T><<<reference_blocks(args.rows), kReferenceThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, out);
  });
}

void reference_compare(StorageType type, const ReferenceCompareArgs& args, RowComparison* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = rows_vectorizable<T>(args.cols, {args.student, args.teacher, args.grad});
    compare_kernel<T><<<reference_blocks(args.rows), kReferenceThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        args, out, vectorized);
  });
}

namespace {

template <class T, int kBlock>
bool launch_fused(const ReferenceCompareArgs& args, double* partials, double* lse, RowComparison* out, int cluster,
                  cudaStream_t stream) {
  auto* kernel = fused_kernel<T, kBlock>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kFusedSmem)) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kBlock);
  config.gridDim = dim3(static_cast<unsigned>(cluster));
  config.dynamicSmemBytes = kFusedSmem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  int max_clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config) != cudaSuccess || max_clusters < 1) {
    cudaGetLastError();  // clear it: the caller takes the two-pass kernels
    return false;
  }
  // A persistent grid: as many clusters as fit at once, each walking the rows.
  const std::int64_t clusters = std::min<std::int64_t>(args.rows, max_clusters);
  config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
  const bool trace = std::getenv("LOSSVERIFY_TRACE") != nullptr;
  cudaEvent_t start{}, stop{};
  if (trace) {
    const unsigned long long zero = 0;
    cudaMemcpyToSymbolAsync(fused_judged, &zero, sizeof(zero), 0, cudaMemcpyHostToDevice, stream);
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaEventRecord(start, stream);
  }
  if (cudaLaunchKernelEx(&config, kernel, args, partials, lse, out) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (trace) {
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    unsigned long long judged = 0;
    cudaMemcpyFromSymbol(&judged, fused_judged, sizeof(judged));
    std::fprintf(stderr,
                 "lossverify trace: fused reference %lld x %lld, clusters of %d (%lld at once): kernel %.3f ms, "
                 "%llu elements judged in full (%.4f%%)\n",
                 static_cast<long long>(args.rows), static_cast<long long>(args.cols), cluster,
                 static_cast<long long>(clusters), ms, judged,
                 100.0 * static_cast<double>(judged) / static_cast<double>(args.rows * args.cols));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  return true;
}

}  // namespace

bool reference_fused(StorageType type, const ReferenceCompareArgs& args, double* partials, double* lse,
                     RowComparison* out, void* stream) {
  // LOSSVERIFY_GPU_REFERENCE=two-pass keeps the partials and compare kernels (a cross-check and tuning aid;
  // read on every call, so a test can compare the two paths in one process).
  const char* choice = std::getenv("LOSSVERIFY_GPU_REFERENCE");
  const bool enabled = choice == nullptr || std::string_view(choice) != "two-pass";
  if (!enabled || args.rows == 0 || args.kd || args.softcap > 0.0 || type == StorageType::fp32) return false;
  bool launched = false;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (sizeof(T) == 2) {
      const int cluster = fused_cluster(args.cols);
      if (cluster == 0 || !rows_vectorizable<T>(args.cols, {args.student, args.grad})) return;
      // Tuning aid: LOSSVERIFY_GPU_REFERENCE_BLOCK=256 (64 elements a thread) or 512 (32, the default).
      const char* block = std::getenv("LOSSVERIFY_GPU_REFERENCE_BLOCK");
      launched = block != nullptr && std::string_view(block) == "256"
                     ? launch_fused<T, 256>(args, partials, lse, out, cluster, static_cast<cudaStream_t>(stream))
                     : launch_fused<T, 512>(args, partials, lse, out, cluster, static_cast<cudaStream_t>(stream));
    }
  });
  return launched;
}

}  // namespace lossverify::cuda
