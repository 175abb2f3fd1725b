// The float64 reference on the GPU (see reference_kernels.hpp). One block per row, 256 threads; every
// thread keeps compensated partial sums of its columns, and the block combines them with a fixed
// shuffle tree, so results are deterministic. Built with -fmad=false: no contraction changes a rounding.
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string_view>
#include <type_traits>

#include "lossverify/core/element_rule.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/device_types.cuh"
#include "lossverify/oracle/cuda/compensated.cuh"
#include "lossverify/oracle/cuda/reference_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kReferenceThreads = 256;

// Max and compensated sum of exp(z - max), as merged between threads.
struct OnlineLse {
  double m = -INFINITY;
  Neumaier sum;
  __device__ void merge(const OnlineLse& o) {
    const double mm = fmax(m, o.m);
    if (mm == -INFINITY) return;
    // (exp(0) = 1 exactly: the side that holds the maximum needs no exp, a third of a row's merges.)
    const double f = m == -INFINITY ? 0.0 : m == mm ? 1.0 : exp(m - mm);
    const double g = o.m == -INFINITY ? 0.0 : o.m == mm ? 1.0 : exp(o.m - mm);
    Neumaier r;
    r.add(sum.s * f);
    r.add(sum.c * f);
    r.add(o.sum.s * g);
    r.add(o.sum.c * g);
    sum = r;
    m = mm;
  }
};

__device__ OnlineLse shfl(const OnlineLse& x, int offset) {
  OnlineLse r;
  r.m = __shfl_down_sync(0xffffffffu, x.m, offset);
  r.sum = shfl(x.sum, offset);
  return r;
}

// A row's log-sum-exp and sum_v q_v x_v, merged in one tree.
struct RowSums {
  OnlineLse lse;
  Neumaier qx;
  __device__ void merge(const RowSums& o) {
    lse.merge(o.lse);
    qx.merge(o.qx);
  }
};
__device__ RowSums shfl(const RowSums& x, int offset) {
  RowSums r;
  r.lse = shfl(x.lse, offset);
  r.qx = shfl(x.qx, offset);
  return r;
}

// x merged with lane + offset's x (a shuffle down).
template <class State>
__device__ __forceinline__ void merge_down(State& x, int offset) {
  x.merge(shfl(x, offset));
}

// A fixed reduction tree over the block, so results are deterministic: lane pairs within each warp, then
// the warps' results in a second tree of the same shape, in warp 0. Thread 0 gets the result. (With thread 0
// merging the warps' results one after another, and whole CompareStates shuffled, the comparison kernel's
// merge cost about 0.9 ms of its 5.7 on the issue's shape, measured by running it twice; now about 0.2 ms.)
template <int kThreads = kReferenceThreads, class State>
__device__ State block_merge(State x) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps >= 1 && kWarps <= 32 && (kWarps & (kWarps - 1)) == 0, "a power-of-two number of warps");
  // Raw storage: __shared__ variables cannot have constructors.
  __shared__ alignas(State) unsigned char storage[sizeof(State) * kWarps];
  State* warps = reinterpret_cast<State*>(storage);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Every lane merges (branch-free); only lanes below the offset hold values that later levels read.
  for (int offset = 16; offset > 0; offset >>= 1) merge_down(x, offset);
  if (lane == 0) warps[warp] = x;
  __syncthreads();
  if (warp == 0) {
    // Lanes from kWarps on hold an empty state that no merge reads: lane < offset <= kWarps / 2.
    x = lane < kWarps ? warps[lane] : State{};
    for (int offset = kWarps / 2; offset > 0; offset >>= 1) merge_down(x, offset);
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

// exp in float64 for the per-element work (the table method): d = (32 k + j) ln2/32 + r, |r| <= ln2/64, so
// exp(d) = 2^k 2^(j/32) e^r with e^r - 1 from its degree-6 Taylor polynomial (truncation below 4e-18); about
// 2 ulp, against 1 for the library's exp, ten orders of magnitude below every tolerance. The coefficients sit
// in constant memory, which DFMA reads as an operand: the library's exp rebuilds its 64-bit constants in
// registers on every call (a third of the partials kernel's instructions, measured with Nsight Compute).
// 2^(j/32) comes from a 32-entry table each block keeps in shared memory.
__constant__ double kExp2Fractions[32] = {
    0x1.0000000000000p+0, 0x1.059b0d3158574p+0, 0x1.0b5586cf9890fp+0, 0x1.11301d0125b51p+0, 0x1.172b83c7d517bp+0,
    0x1.1d4873168b9aap+0, 0x1.2387a6e756238p+0, 0x1.29e9df51fdee1p+0, 0x1.306fe0a31b715p+0, 0x1.371a7373aa9cbp+0,
    0x1.3dea64c123422p+0, 0x1.44e086061892dp+0, 0x1.4bfdad5362a27p+0, 0x1.5342b569d4f82p+0, 0x1.5ab07dd485429p+0,
    0x1.6247eb03a5585p+0, 0x1.6a09e667f3bcdp+0, 0x1.71f75e8ec5f74p+0, 0x1.7a11473eb0187p+0, 0x1.82589994cce13p+0,
    0x1.8ace5422aa0dbp+0, 0x1.93737b0cdc5e5p+0, 0x1.9c49182a3f090p+0, 0x1.a5503b23e255dp+0, 0x1.ae89f995ad3adp+0,
    0x1.b7f76f2fb5e47p+0, 0x1.c199bdd85529cp+0, 0x1.cb720dcef9069p+0, 0x1.d5818dcfba487p+0, 0x1.dfc97337b9b5fp+0,
    0x1.ea4afa2a490dap+0, 0x1.f50765b6e4540p+0};
// 32 / ln 2; ln 2 / 32 in two parts; 1/6!, 1/5!, 1/4!, 1/3!
__constant__ double kExpConstants[7] = {
    0x1.71547652b82fep+5, 0x1.62e42fefa39efp-6, 0x1.abc9e3b39803fp-61, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0};

// Every thread of the block calls it before the first exp_reference (it synchronizes the block).
__device__ __forceinline__ void load_exp_table(double* table) {
  if (threadIdx.x < 32) table[threadIdx.x] = kExp2Fractions[threadIdx.x];
  __syncthreads();
}
__device__ __noinline__ double exp_far(double d) { return exp(d); }

__device__ __forceinline__ double exp_reference(double d, const double* table) {
  if (!(d >= -707.0 && d <= 0.0)) return exp_far(d);  // positive, far below, -inf or NaN: the library's exp
  constexpr double kMagic = 0x1.8p52;                 // adding it rounds to an integer, left in the low word
  const double t = fma(d, kExpConstants[0], kMagic);
  const int n = __double2loint(t);
  const double nd = t - kMagic;
  double r = fma(nd, -kExpConstants[1], d);
  r = fma(nd, -kExpConstants[2], r);
  double q = fma(r, kExpConstants[3], kExpConstants[4]);
  q = fma(q, r, kExpConstants[5]);
  q = fma(q, r, kExpConstants[6]);
  q = fma(q, r, 0.5);
  const double p = fma(r * r, q, r);  // e^r - 1
  const double tj = table[n & 31];
  const double y = fma(tj, p, tj);  // in [0.98, 2): scaling by 2^k (k >= -1021) on the exponent field stays normal
  return __hiloint2double(__double2hiint(y) + ((n >> 5) * (1 << 20)), __double2loint(y));
}

// Online max and a plain float64 sum of exp(z - max) per thread (a few hundred terms: relative error
// below 1e-13); threads are combined with compensated sums.
struct ThreadLse {
  double m = -INFINITY, s = 0.0;
  __device__ __forceinline__ void add(double z, const double* table) {
    if (z > m) {
      if (m != -INFINITY) s *= exp_reference(m - z, table);  // (s is 0 while m = -inf)
      m = z;
    }
    s += exp_reference(z - m, table);
  }
  __device__ OnlineLse online() const {
    OnlineLse o;
    o.m = m;
    o.sum.s = s;
    return o;
  }
};

// Code tables (bf16 rows of the cross-entropy family without softcap). A bf16 logit is one of 65536
// codes, so exp(x) needs computing once per code, not once per element: each block keeps exp(x) of every
// code with 2^-8 <= |x| < 2^6 (3584 codes, 28 KB), and elements outside that range take the plain path.
struct Bf16Codes {
  static constexpr unsigned kLowExponent = 8;  // |x| >= 2^-8
  static constexpr unsigned kBinades = 14;     // |x| < 2^6
  static constexpr unsigned kLow = (127u - kLowExponent) << 7;
  static constexpr unsigned kSpan = kBinades << 7;  // codes of one sign
  static constexpr int kEntries = 2 * kSpan;
  // Per-code arrays have one more slot, kEntries, for every code outside the table: a lookup needs no
  // branch (exp_of_code holds 0 there, the compare kernel's gradient code a value no bf16 code equals).
  static constexpr int kSlots = kEntries + 1;
  // A code's slot is 2 (|code| - kLow) + sign, kEntries outside the table. From a 32-bit word holding the
  // code twice, (word >> 15) & 0xffff is |code| * 2 + sign: with the byte permutation that duplicates a
  // 16-bit half and an unsigned minimum, a slot costs 5 instructions, extraction included.
  __device__ static unsigned slot_of_pair(unsigned twice) {
    return min(((twice >> 15) & 0xffffu) - 2u * kLow, static_cast<unsigned>(kEntries));
  }
  __device__ static unsigned slot(unsigned code) { return slot_of_pair(__byte_perm(code, 0u, 0x1010u)); }
  __device__ static unsigned code_of(unsigned slot) { return (kLow + (slot >> 1)) | ((slot & 1u) << 15); }
  __device__ static float value(unsigned code) { return __uint_as_float(code << 16); }
  // The 32-bit word of 16 bytes that holds the k-th of their eight bf16 codes, and that code twice.
  __device__ static unsigned word_at(const uint4& w, int k) {
    return k < 4 ? (k < 2 ? w.x : w.y) : (k < 6 ? w.z : w.w);
  }
  __device__ static unsigned twice_at(const uint4& w, int k) {
    return __byte_perm(word_at(w, k), 0u, (k & 1) ? 0x3232u : 0x1010u);
  }
  // The k-th code, its slot, and its value as a float (exact: a bf16 is a float's upper half).
  __device__ static unsigned code_at(const uint4& w, int k) { return (word_at(w, k) >> ((k & 1) * 16)) & 0xffffu; }
  __device__ static unsigned slot_at(const uint4& w, int k) { return slot_of_pair(twice_at(w, k)); }
  __device__ static float value_at(const uint4& w, int k) {
    const unsigned word = word_at(w, k);
    return __uint_as_float((k & 1) ? (word & 0xffff0000u) : (word << 16));
  }
  // The slot times 8, the byte offset of a double's entry, from the same shift and mask: (word >> 12) &
  // 0x7fff8 is 8 times (word >> 15) & 0xffff, so no multiplication is left for the lookup.
  __device__ static unsigned double_offset_at(const uint4& w, int k) {
    return min(((twice_at(w, k) >> 12) & 0x7fff8u) - 16u * kLow, static_cast<unsigned>(kEntries) * 8u);
  }
  // Every thread of the block calls it (it synchronizes the block).
  __device__ static void fill_exp(double* exp_of_code, const double* table) {
    for (int i = threadIdx.x; i < kEntries; i += blockDim.x) {
      exp_of_code[i] = exp_reference(static_cast<double>(value(code_of(static_cast<unsigned>(i)))), table);
    }
    if (threadIdx.x == 0) exp_of_code[kEntries] = 0.0;
    __syncthreads();
  }
};

template <class T, bool kTables>
__global__ void __launch_bounds__(kReferenceThreads)
    partials_kernel(ReferencePartialArgs a, double* out, bool vectorized) {
  __shared__ double table[32];
  __shared__ double exp_of_code[kTables ? Bf16Codes::kSlots : 1];
  load_exp_table(table);
  if constexpr (kTables) Bf16Codes::fill_exp(exp_of_code, table);
  const T* student = static_cast<const T*>(a.student);
  const T* teacher = static_cast<const T*>(a.teacher);
  const int cols = static_cast<int>(a.cols);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    if (!a.valid[r]) {  // RowPartial's empty values
      if (threadIdx.x < 8) out[8 * r + threadIdx.x] = threadIdx.x == 0 || threadIdx.x == 5 ? -INFINITY : 0.0;
      continue;
    }
    const T* x = student + r * a.cols;
    ThreadLse lse_t, teacher_t;
    double qx_t = 0.0;
    if (a.kd) {
      const T* y = teacher + r * a.cols;
      const double inverse_t = a.inverse_temperature;
      for_each_column<true, false>(x, y, x, cols, vectorized, [&](int, float xv, float yv, float) {
        lse_t.add(static_cast<double>(xv) * inverse_t, table);
        teacher_t.add(static_cast<double>(yv) * inverse_t, table);
      });
    } else if (kTables && vectorized) {
      // sum exp(x) over the table's codes (a maximum of 0: exp(x) <= e^64), the rest as before; and
      // sum_v q_v x_v as q_off sum_v x_v + (q_on - q_off) x_label.
      const std::int64_t label = a.label[r] - a.begin;
      const int packs = cols / 8;
      const std::int64_t label_pack = label >= 0 && label < cols ? label / 8 : -1;
      double sum_exp = 0.0, sum_x = 0.0;
      const auto* exp_bytes = reinterpret_cast<const unsigned char*>(exp_of_code);
      constexpr unsigned kOutside = Bf16Codes::kEntries * sizeof(double);
      for (int i = threadIdx.x; i < packs; i += blockDim.x) {
        const uint4 w = reinterpret_cast<const uint4*>(x)[i];
        // The pack's eight x summed in float: exact when all are in the table, since each is then a
        // multiple of 2^-15 below 2^6 in magnitude, so every partial sum of eight is a multiple of 2^-15
        // below 2^9 (24 bits). A pack with an x outside the table is summed again below.
        float pack_x = 0.0f;
        bool outside = false;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const unsigned at = Bf16Codes::double_offset_at(w, k);
          sum_exp += *reinterpret_cast<const double*>(exp_bytes + at);  // 0 outside the table
          pack_x += Bf16Codes::value_at(w, k);
          outside |= at == kOutside;
        }
        if (!outside) {
          sum_x += static_cast<double>(pack_x);
        } else {
          float in_table = 0.0f;
          unsigned bits = 0;
          for (int k = 0; k < 8; ++k) {
            if (Bf16Codes::double_offset_at(w, k) != kOutside) {
              in_table += Bf16Codes::value_at(w, k);
            } else {
              bits |= 1u << k;
            }
          }
          sum_x += static_cast<double>(in_table);
          for (; bits != 0; bits &= bits - 1) {
            const double z = Bf16Codes::value_at(w, __ffs(bits) - 1);
            lse_t.add(z, table);
            sum_x += z;
          }
        }
        if (i == label_pack) {
          const double z = Bf16Codes::value(Bf16Codes::code_at(w, static_cast<int>(label & 7)));
          qx_t += (a.q_on - a.q_off) * z;
        }
      }
      qx_t += a.q_off * sum_x;
      OnlineLse fast;
      if (sum_exp > 0.0) {
        fast.m = 0.0;
        fast.sum.s = sum_exp;
      }
      OnlineLse rest = lse_t.online();
      rest.merge(fast);
      lse_t.m = rest.m;
      lse_t.s = rest.sum.s + rest.sum.c;
    } else {
      const std::int64_t label = a.label[r] - a.begin;  // local column of the label (may be outside)
      const double cap = a.softcap, q_on = a.q_on, q_off = a.q_off, scale = a.inverse_temperature;
      for_each_column<false, false>(x, x, x, cols, vectorized, [&](int v, float xv, float, float) {
        const double z = capped(static_cast<double>(xv) * scale, cap);  // scale 1 but for the row coefficients
        lse_t.add(z, table);
        qx_t += (v == label ? q_on : q_off) * z;
      });
    }
    // The student's lse and sum q x in one tree (the same merges as two trees, one set of barriers); the
    // teacher's only for KD.
    RowSums sums;
    sums.lse = lse_t.online();
    sums.qx.s = qx_t;
    sums = block_merge(sums);
    const OnlineLse& lse = sums.lse;
    const Neumaier& qx = sums.qx;
    const OnlineLse teacher_lse = a.kd ? block_merge(teacher_t.online()) : OnlineLse{};
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
  __shared__ double table[32];
  load_exp_table(table);
  const T* student = static_cast<const T*>(a.student);
  const T* teacher = static_cast<const T*>(a.teacher);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    if (!a.valid[r]) continue;
    const T* x = student + r * a.cols;
    const T* y = teacher + r * a.cols;
    Neumaier kl;
    for (std::int64_t v = threadIdx.x; v < a.cols; v += blockDim.x) {
      const double log_q = static_cast<double>(widen<T>(x[v])) * a.inverse_temperature - a.lse[r];
      if (a.entropy) {  // sum p log p of the student alone
        const double q = exp_reference(log_q, table);
        if (q > 0.0) kl.add(q * log_q);
        continue;
      }
      const double log_p = static_cast<double>(widen<T>(y[v])) * a.inverse_temperature - a.teacher_lse[r];
      const double p = exp_reference(log_p, table);
      if (p > 0.0) kl.add(p * (log_p - log_q));
    }
    kl = block_merge(kl);
    if (threadIdx.x == 0) {
      out[2 * r] = kl.s;
      out[2 * r + 1] = kl.c;
    }
  }
}

// checks/element_judge.hpp's GradJudge, element by element, on core/element_rule.hpp's arithmetic.
__device__ __forceinline__ double margin_of(double error, double tolerance) {
  return element_rule::margin(error, tolerance);
}
__device__ __forceinline__ element_rule::Format format_of(int dtype) {
  if (dtype == static_cast<int>(StorageType::bf16)) return element_rule::bf16_format();
  if (dtype == static_cast<int>(StorageType::fp16)) return element_rule::fp16_format();
  return element_rule::fp32_format();
}
__device__ __forceinline__ double ulp_size(double value, int dtype) {
  return element_rule::spacing(value, format_of(dtype));
}
__device__ __forceinline__ double ulp_size_inverse(double value, int dtype) {
  return element_rule::inverse_spacing(value, format_of(dtype));
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
  std::int64_t lookups = 0;  // elements judged by a code-table lookup
  std::int64_t nan = 0, pos_inf = 0, neg_inf = 0, subnormal = 0;
  double max_abs = 0.0, max_rel = 0.0, margin = 0.0, worst_expected = 0.0, worst_got = 0.0, worst_tolerance = 0.0;
  double first_bad_value = 0.0;
  Neumaier sum, magnitude;

  // ErrorStats::add_with_margin's extrema. A tie keeps the earlier column, whatever the order of visits
  // (the code-table path visits an element that misses the table after the pack's hits); merge_down()
  // breaks ties between threads the same way.
  __device__ __forceinline__ void extrema(double expected, double error) {
    if (isnan(error)) {
      max_abs = INFINITY;
      return;
    }
    if (error > max_abs) max_abs = error;
    // The division only where it can raise the maximum (the factor covers the product's rounding).
    if (expected != 0.0 && error > max_rel * fabs(expected) * (1.0 - 1e-12))
      max_rel = fmax(max_rel, error / fabs(expected));
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
};

// block_merge's step for the large state, field by field: each field is shuffled and merged at once, so no
// second CompareState is live (as a copy, it spilled: the kernel runs at 64 registers). Per-row counts and
// columns are below 2^31 (a row has at most INT_MAX columns), so they travel as 32-bit values.
__device__ __forceinline__ void merge_down(CompareState& x, int offset) {
  constexpr unsigned kAll = 0xffffffffu;
  const auto down32 = [&](std::int64_t v) {
    return static_cast<std::int64_t>(__shfl_down_sync(kAll, static_cast<int>(v), offset));
  };
  const auto down = [&](auto v) { return __shfl_down_sync(kAll, v, offset); };
  x.compared += down32(x.compared);
  x.lookups += down32(x.lookups);
  x.mismatches += down32(x.mismatches);
  x.nan += down32(x.nan);
  x.pos_inf += down32(x.pos_inf);
  x.neg_inf += down32(x.neg_inf);
  x.subnormal += down32(x.subnormal);
  x.max_ulp = max(x.max_ulp, static_cast<std::int64_t>(down(static_cast<long long>(x.max_ulp))));
  x.max_abs = fmax(x.max_abs, down(x.max_abs));
  x.max_rel = fmax(x.max_rel, down(x.max_rel));
  {
    const std::int64_t column = down32(x.worst_column);
    const double margin = down(x.margin);
    const double expected = down(x.worst_expected), got = down(x.worst_got), tolerance = down(x.worst_tolerance);
    if (column >= 0 && (x.worst_column < 0 || margin > x.margin || (margin == x.margin && column < x.worst_column))) {
      x.margin = margin;
      x.worst_column = column;
      x.worst_expected = expected;
      x.worst_got = got;
      x.worst_tolerance = tolerance;
    }
  }
  {
    const std::int64_t column = down32(x.first_bad_column);
    const double value = down(x.first_bad_value);
    if (column >= 0 && (x.first_bad_column < 0 || column < x.first_bad_column)) {
      x.first_bad_column = column;
      x.first_bad_value = value;
    }
  }
  x.sum.merge(shfl(x.sum, offset));
  x.magnitude.merge(shfl(x.magnitude, offset));
}

// Every element of a row against the reference gradient, judged as checks.cpp's GradJudge judges it.
// Divisions are taken only where their quotient can matter: a new worst element, a mismatch, a new
// maximum relative error; elsewhere a comparison decides.
//
// kTables (bf16, the cross-entropy family without softcap): within a row, an element's expected value and
// its judgement depend only on the codes (x, g) and on whether it is the label. Each block first judges,
// for every code x of the table, the gradient a correct kernel most likely wrote (the bf16 value nearest
// the expected one) with the same visit() as every other element, and keeps its margin when that
// judgement is inert (no mismatch, no ULP count, nothing for the census). An element whose (x, g) is such
// a pair then costs a table lookup: it increments its code's count of hits, and each thread keeps the pack
// where it first met its largest table entry (entries order by the judgement's margin, quantized). After
// the pass every code that was hit enters the row's maximum errors once, and its count times its value the
// row sums; the worst hit is the first hit of the code with the largest margin, found from those packs (or,
// where quantization or the label leaves a doubt, by a search of the row). Every other element (the label,
// codes outside the table, any other g) is judged in full.
// Table rows take the softmax as exp(x) exp(-lse), exp(x) from the block's table (|lse| <= 600: both
// factors normal) and, for codes outside it, exp(x - lse) directly where |x| > 700.
constexpr int kTableThreads = 512;   // two blocks per SM (the tables take 106 KB); 64 registers
constexpr int kMissCapacity = 2048;  // a row with more misses is judged again, in full
// A code's gradient entry: bit 31 set where the judgement of its likeliest gradient is inert (0 otherwise,
// and for the slot outside the table), bits 16-30 that judgement's margin in [0, 1] quantized (monotone:
// a larger margin never has a smaller key), bits 0-15 the likeliest gradient's code. An element hits when
// its entry is inert and holds its gradient's code; the largest entry among a thread's hits marks its
// likely worst hit.
constexpr unsigned kInert = 1u << 31;
__device__ __forceinline__ unsigned table_entry(bool inert, double margin, unsigned likeliest) {
  if (!inert) return 0u;
  const unsigned key = margin >= 1.0 ? 0x7fffu : static_cast<unsigned>(margin * 32768.0);
  return kInert | (key << 16) | likeliest;
}
__device__ __forceinline__ bool table_hit(unsigned entry, unsigned g_code) {
  return (entry & 0x8000ffffu) == (g_code | kInert);
}
__device__ __forceinline__ unsigned table_gradient(unsigned entry) { return entry & 0xffffu; }
constexpr std::int64_t kPrefetchBytes = 32 * 1024;  // per block and array: 264 blocks x 64 KB stay within L2
constexpr std::size_t kTableSharedBytes =
    static_cast<std::size_t>(Bf16Codes::kSlots) * (2 * sizeof(double) + 2 * sizeof(unsigned)) +
    kMissCapacity * sizeof(int);

template <class T, bool kTables, int kThreads>
__global__ void __launch_bounds__(kThreads, kTables ? 2 : 4)
    compare_kernel(ReferenceCompareArgs a, RowComparison* out, bool vectorized) {
  __shared__ double table[32];
  extern __shared__ double code_tables[];        // kTables: per code exp(x), then per row margin, g code, hits
  __shared__ int miss_count;                     // kTables: the row's elements that missed the table
  __shared__ unsigned long long worst_hit_bits;  // kTables: the largest margin of a hit code (its bits)
  __shared__ int worst_hit_codes, worst_hit_slot, worst_hit_column;
  __shared__ unsigned top_entry;               // kTables: the largest entry among the pass's hits
  __shared__ int top_entry_codes, top_column;  // kTables: the hit codes with that entry; its first hit's column
  double* const exp_of_code = code_tables;
  double* const code_margin = exp_of_code + Bf16Codes::kSlots;
  unsigned* const code_g = reinterpret_cast<unsigned*>(code_margin + Bf16Codes::kSlots);
  int* const missed_columns = reinterpret_cast<int*>(code_g + Bf16Codes::kSlots);
  unsigned* const code_hits = reinterpret_cast<unsigned*>(missed_columns + kMissCapacity);
  load_exp_table(table);
  if constexpr (kTables) Bf16Codes::fill_exp(exp_of_code, table);
  const T* student = static_cast<const T*>(a.student);
  const T* teacher = static_cast<const T*>(a.teacher);
  const T* grad = static_cast<const T*>(a.grad);
  const int cols = static_cast<int>(a.cols);
  const double fs = a.framework_scale;
  // Rows where most elements miss the table (a gradient far from the reference) do better judged in
  // full: after such a row the block judges its next 7 rows in full, then tries the table again.
  int rows_without_tables = 0;
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int kind = a.kind[r];
    const T* x = student + r * a.cols;
    const T* y = a.kd ? teacher + r * a.cols : x;
    const T* g = grad + r * a.cols;
    const double weight = kind == 0 ? a.weight[r] : 0.0;
    const double row_scale = kind == 0 && a.row_scale != nullptr ? a.row_scale[r] : 1.0;
    const double token_scale = fabs(weight) * a.grad_scale * row_scale;
    const double floor = a.atol * token_scale + a.quantum * fs;
    const double lse = kind != 0               ? 0.0
                       : a.partials != nullptr ? a.partials[8 * r] + log(a.partials[8 * r + 1] + a.partials[8 * r + 2])
                                               : a.lse[r];
    const double teacher_lse = kind == 0 && a.kd ? a.teacher_lse[r] : 0.0;
    const double z_factor = 1.0 + 2.0 * a.z_loss_weight * lse;
    const double kd_scale = weight * a.kd_grad_scale;
    const std::int64_t label = a.kd ? -1 : a.label[r] - a.begin;
    const bool tabled = kTables && vectorized && kind == 0 && fabs(lse) <= 600.0 && rows_without_tables == 0;
    if (rows_without_tables > 0) --rows_without_tables;
    const double exp_minus_lse = tabled ? exp_reference(-lse, table) : 0.0;
    // p_v = softmax of the student row at x.
    auto student_p = [&](float xf) -> double {
      if (tabled) {
        const unsigned code = __float_as_uint(xf) >> 16;
        const unsigned slot = Bf16Codes::slot(code);
        if (slot < static_cast<unsigned>(Bf16Codes::kEntries)) return exp_of_code[slot] * exp_minus_lse;
        if (fabsf(xf) <= 700.0f) return exp_reference(static_cast<double>(xf), table) * exp_minus_lse;
      }
      return exp_reference(capped(static_cast<double>(xf), a.softcap) - lse, table);
    };
    auto expected_at = [&](int v, float xf, float yf) -> double {
      if (kind != 0) return 0.0;
      if (a.expected != nullptr) return a.expected[r * a.cols + v];
      const double xv = xf;
      if (a.row_coefficients) {
        const double log_p = xv * a.inverse_temperature - lse;
        const double p = exp_reference(log_p, table);
        const double entropy_term = p > 0.0 ? a.entropy_coef * p * (log_p + a.coef_b[r]) : 0.0;
        return weight * a.inverse_temperature * (a.coef_a[r] * ((v == label ? 1.0 : 0.0) - p) + entropy_term);
      }
      if (a.kd) {
        const double t = a.temperature;
        return kd_scale *
               (exp_reference(xv / t - lse, table) - exp_reference(static_cast<double>(yf) / t - teacher_lse, table));
      }
      const double p = student_p(xf);
      double d = p * z_factor - (v == label ? a.q_on : a.q_off);
      if (a.softcap > 0.0) {
        const double th = tanh(xv / a.softcap);
        d *= 1.0 - th * th;
      }
      return weight * d;
    };
    CompareState st;
    double row_sum = 0.0, row_magnitude = 0.0;
    auto visit_into = [&](CompareState& s, int v, float xf, float yf, float gf, double& sum, double& magnitude) {
      const double got_local = gf;
      const double got = got_local * fs;
      const double magnitude_local = fabs(got_local);
      if (!(magnitude_local >= a.smallest_normal && magnitude_local <= DBL_MAX))
        s.census(v, got_local, a.smallest_normal);
      ++s.compared;
      if (kind == 2) {  // CP padding: masked, exactly zero
        const bool mismatch = got != 0.0;
        s.mismatches += mismatch;
        s.extrema(0.0, got == 0.0 ? 0.0 : fabs(got));
        s.worst(v, mismatch ? INFINITY : 0.0, 0.0, got, 0.0);
        return;
      }
      const double expected = expected_at(v, xf, yf);
      const double error = got == expected ? 0.0 : fabs(got - expected);
      const double fl = a.slack != nullptr && kind == 0 ? floor + a.slack[r * a.cols + v] : floor;
      s.extrema(expected, error);
      sum += got;
      magnitude += fabs(got);
      if (a.max_ulp > 0) {
        const double local_expected = fs == 1.0 ? expected : expected / fs;
        const double local_error = got_local == local_expected ? 0.0 : fabs(got_local - local_expected);
        const double inverse_spacing = ulp_size_inverse(local_expected, a.dtype);
        const double in_spacings = local_error * inverse_spacing;  // exact: a power of two
        if (!(in_spacings < 0.5)) {
          s.max_ulp = max(s.max_ulp, ulp_distance(got_local, local_expected, a.dtype));
        }
        const double by_ulp = a.max_ulp == 1
                                  ? in_spacings
                                  : element_rule::by_ulp(local_error, ulp_size(local_expected, a.dtype), a.max_ulp);
        // m = min(by_ulp, by_floor) <= by_ulp: when by_ulp is within 1 and below the worst so far, the
        // element neither mismatches nor becomes the worst, and by_floor is not needed.
        if (s.worst_column < 0 || !(by_ulp <= 1.0 && by_ulp < s.margin)) {
          const double m = element_rule::ulp_margin(by_ulp, margin_of(error, fl), error, expected);
          const bool mismatch = !(m <= 1.0);
          s.mismatches += mismatch;
          s.worst(v, m, expected, got, fl + a.rtol * fabs(expected));
        }
      } else {
        const double tol = fl + a.rtol * fabs(expected);
        const double m = element_rule::tolerance_margin(error, fl, a.rtol, expected);
        const bool mismatch = !(m <= 1.0);
        s.mismatches += mismatch;
        if (s.worst_column < 0 || mismatch || !(error <= s.margin * tol * (1.0 - 1e-12)))
          s.worst(v, m, expected, got, tol);
      }
    };
    auto visit = [&](int v, float xf, float yf, float gf) { visit_into(st, v, xf, yf, gf, row_sum, row_magnitude); };
    if (tabled) {
      // The row's table: for every code, the likeliest gradient and, where its judgement is inert, its margin.
      constexpr int kNotLabel = INT_MIN;
      if (threadIdx.x == 0) {
        miss_count = 0;
        // The row's first bytes into L2 while the table is built (which reads no memory): the copy
        // engine's bulk prefetch, kPrefetchBytes of the logits and of the gradient per block in flight.
        const std::int64_t row_bytes = (static_cast<std::int64_t>(cols) * 2) & ~static_cast<std::int64_t>(15);
        const auto bytes = static_cast<unsigned>(row_bytes < kPrefetchBytes ? row_bytes : kPrefetchBytes);
        if (bytes > 0) {
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x), "r"(bytes) : "memory");
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(g), "r"(bytes) : "memory");
        }
      }
      for (int i = threadIdx.x; i < Bf16Codes::kEntries; i += kThreads) {
        const float xf = Bf16Codes::value(Bf16Codes::code_of(static_cast<unsigned>(i)));
        const double expected = expected_at(kNotLabel, xf, 0.0f);
        const double local_expected = fs == 1.0 ? expected : expected / fs;
        const unsigned likeliest = __bfloat16_as_ushort(__double2bfloat16(local_expected));
        CompareState probe;
        double probe_sum = 0.0, probe_magnitude = 0.0;
        visit_into(probe, kNotLabel, xf, 0.0f, Bf16Codes::value(likeliest), probe_sum, probe_magnitude);
        const bool inert = probe.mismatches == 0 && probe.max_ulp == 0 && probe.nan == 0 && probe.pos_inf == 0 &&
                           probe.neg_inf == 0 && probe.subnormal == 0;
        code_g[i] = table_entry(inert, probe.margin, likeliest);
        code_margin[i] = probe.margin;
        code_hits[i] = 0;
      }
      if (threadIdx.x == 0) {
        code_g[Bf16Codes::kEntries] = 0u;  // the slot outside the table: never a hit
        code_hits[Bf16Codes::kEntries] = 0;
        worst_hit_bits = 0;
        worst_hit_codes = 0;
        worst_hit_column = INT_MAX;
        top_entry = 0;
        top_entry_codes = 0;
        top_column = INT_MAX;
      }
      __syncthreads();
      const uint4* x4 = reinterpret_cast<const uint4*>(x);
      const uint4* g4 = reinterpret_cast<const uint4*>(g);
      const int packs = cols / 8;
      const std::int64_t label_pack = label >= 0 && label < cols ? label / 8 : -1;
      // A hit counts in its code's entry; misses go to the block's list and are judged in full after the
      // pass, spread over the threads: the pass itself carries no CompareState. The label's element is
      // judged in full too: the pass counts it like any other, and the count is undone after it. The next
      // pack's loads are issued before the current pack is counted. A row with more misses than the list
      // holds is judged again, every element in full, and the counts are dropped.
      int hits = 0;
      unsigned best_entry = 0;  // the largest entry among this thread's hits, first met in pack best_pack
      int best_pack = -1;
      uint4 xw{}, gw{};
      if (static_cast<int>(threadIdx.x) < packs) {
        xw = x4[threadIdx.x];
        gw = g4[threadIdx.x];
      }
      for (int i = threadIdx.x; i < packs; i += kThreads) {
        const uint4 xv = xw, gv = gw;
        if (i + kThreads < packs) {
          xw = x4[i + kThreads];
          gw = g4[i + kThreads];
        }
        unsigned missed = 0, pack_top = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const unsigned gc = Bf16Codes::code_at(gv, k);
          const unsigned index = Bf16Codes::slot_at(xv, k);
          const unsigned entry = code_g[index];
          const bool hit = table_hit(entry, gc);
          if (hit) atomicAdd(&code_hits[index], 1u);
          missed |= static_cast<unsigned>(!hit) << k;
          pack_top = max(pack_top, hit ? entry : 0u);
        }
        if (pack_top > best_entry) {
          best_entry = pack_top;
          best_pack = i;
        }
        hits += 8 - __popc(missed);
        if (missed != 0) {
          int slot = atomicAdd(&miss_count, __popc(missed));
          for (unsigned bits = missed; bits != 0 && slot < kMissCapacity; bits &= bits - 1) {
            missed_columns[slot++] = i * 8 + __ffs(bits) - 1;
          }
        }
      }
      if (best_entry != 0) atomicMax(&top_entry, best_entry);
      __syncthreads();
      if (threadIdx.x == 0 && label_pack >= 0) {
        const unsigned index = Bf16Codes::slot(__bfloat16_as_ushort(reinterpret_cast<const __nv_bfloat16*>(x)[label]));
        if (table_hit(code_g[index], __bfloat16_as_ushort(reinterpret_cast<const __nv_bfloat16*>(g)[label]))) {
          --code_hits[index];
          --hits;
          const int slot = miss_count++;
          if (slot < kMissCapacity) missed_columns[slot] = static_cast<int>(label);
        }
      }
      __syncthreads();
      const int misses = miss_count;
      if (misses > kMissCapacity) {
        rows_without_tables = 7;
        for_each_column<false, true>(x, y, g, cols, vectorized, visit);
      } else {
        // The first hit with the largest entry: from the pack where each thread first met it.
        if (best_entry != 0 && best_entry == top_entry) {
          const uint4 xv = x4[best_pack];
          const uint4 gv = g4[best_pack];
          int k = 0;
          while (k < 7 &&
                 !(code_g[Bf16Codes::slot_at(xv, k)] == best_entry && table_hit(best_entry, Bf16Codes::code_at(gv, k))))
            ++k;
          atomicMin(&top_column, best_pack * 8 + k);
        }
        for (int j = threadIdx.x; j < misses; j += kThreads) {
          const int v = missed_columns[j];
          visit(v, widen<T>(x[v]), 0.0f, widen<T>(g[v]));
        }
        st.compared += hits;
        st.lookups += hits;
        // Every code hit: its error and relative error, once; its hits' values, in the row sums. The worst
        // hit is the first hit (in column order) of the codes with the largest margin: that margin first,
        // then its column, from the pass or from a search of the row from its start for the first element
        // whose (x, g) is such a pair.
        double hit_sum = 0.0, hit_magnitude = 0.0;  // in the gradient's own units
        double worst_margin = -1.0;
        for (int i = threadIdx.x; i < Bf16Codes::kEntries; i += kThreads) {
          const unsigned n = code_hits[i];
          if (n == 0) continue;
          const double expected =
              expected_at(kNotLabel, Bf16Codes::value(Bf16Codes::code_of(static_cast<unsigned>(i))), 0.0f);
          const double got_local = Bf16Codes::value(table_gradient(code_g[i]));
          const double got = got_local * fs;
          st.extrema(expected, got == expected ? 0.0 : fabs(got - expected));
          hit_sum += n * got_local;  // exact: a bf16 times a count below 2^31
          hit_magnitude += n * fabs(got_local);
          worst_margin = fmax(worst_margin, code_margin[i]);
        }
        // Margins of inert judgements are finite and >= 0: their bits order as the values do.
        if (worst_margin >= 0.0)
          atomicMax(&worst_hit_bits, static_cast<unsigned long long>(__double_as_longlong(worst_margin)));
        __syncthreads();
        const double worst_hit_margin = __longlong_as_double(static_cast<long long>(worst_hit_bits));
        for (int i = threadIdx.x; i < Bf16Codes::kEntries; i += kThreads) {
          if (code_hits[i] != 0 && code_g[i] == top_entry) atomicAdd(&top_entry_codes, 1);
          const bool worst = code_hits[i] != 0 && code_margin[i] == worst_hit_margin;
          code_hits[i] = worst;  // from here on: the codes of the worst hits
          if (worst) {
            atomicAdd(&worst_hit_codes, 1);
            worst_hit_slot = i;
          }
        }
        __syncthreads();
        // One code holds the largest margin, and only it has the largest entry: the pass found its first hit
        // (unless that was the label's element, whose count was undone).
        const bool found_in_pass = worst_hit_codes == 1 && top_entry_codes == 1 &&
                                   code_g[worst_hit_slot] == top_entry && top_column != INT_MAX && top_column != label;
        if (found_in_pass) {
          if (threadIdx.x == 0) {
            const unsigned index = static_cast<unsigned>(worst_hit_slot);
            const double expected = expected_at(kNotLabel, Bf16Codes::value(Bf16Codes::code_of(index)), 0.0f);
            const double got = Bf16Codes::value(table_gradient(code_g[index])) * fs;
            st.worst(top_column, worst_hit_margin, expected, got, floor + a.rtol * fabs(expected));
          }
        } else if (worst_hit_codes > 0) {
          for (int base = 0; base < packs; base += kThreads) {
            const int i = base + static_cast<int>(threadIdx.x);
            bool found = false;
            if (i < packs) {
              const uint4 xv = x4[i];
              const uint4 gv = g4[i];
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                const unsigned index = Bf16Codes::slot_at(xv, k);
                if (!found && code_hits[index] != 0 && table_hit(code_g[index], Bf16Codes::code_at(gv, k)) &&
                    i * 8 + k != label) {
                  atomicMin(&worst_hit_column, i * 8 + k);
                  found = true;
                }
              }
            }
            if (__syncthreads_or(found)) break;
          }
          if (threadIdx.x == 0) {
            const int column = worst_hit_column;
            const unsigned index =
                worst_hit_codes == 1
                    ? static_cast<unsigned>(worst_hit_slot)
                    : Bf16Codes::slot(__bfloat16_as_ushort(reinterpret_cast<const __nv_bfloat16*>(x)[column]));
            const double expected = expected_at(kNotLabel, Bf16Codes::value(Bf16Codes::code_of(index)), 0.0f);
            const double got = Bf16Codes::value(table_gradient(code_g[index])) * fs;
            st.worst(column, worst_hit_margin, expected, got, floor + a.rtol * fabs(expected));
          }
        }
        row_sum += hit_sum * fs;
        row_magnitude += hit_magnitude * fabs(fs);
      }
    } else if (a.kd) {
      for_each_column<true, true>(x, y, g, cols, vectorized, visit);
    } else {
      for_each_column<false, true>(x, y, g, cols, vectorized, visit);
    }
    st.sum.s = row_sum;
    st.magnitude.s = row_magnitude;
    st = block_merge<kThreads>(st);
    if (threadIdx.x == 0) {
      RowComparison& o = out[r];
      o.compared = st.compared;
      o.mismatches = st.mismatches;
      o.lookups = st.lookups;
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
  }
}

__global__ void exp_values_kernel(const double* in, double* out, std::size_t count) {
  __shared__ double table[32];
  load_exp_table(table);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    out[i] = exp_reference(in[i], table);
  }
}

// One wave of the blocks the GPU holds at once (the occupancy calculator's count), each taking rows in
// turn: with more blocks than that, a second, partial wave leaves most of the GPU idle at the end.
template <class Kernel>
int reference_blocks(std::int64_t rows, Kernel kernel, int threads, std::size_t shared_bytes) {
  int device = 0, sms = 0, per_sm = 0;
  LV_CUDA(cudaGetDevice(&device));
  LV_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes));
  const std::int64_t blocks = static_cast<std::int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  return static_cast<int>(rows < blocks ? rows : blocks);
}

// The code tables serve bf16 rows of the cross-entropy family without softcap, read with 16-byte loads (`kd`:
// any other row model, KD's or the row coefficients');
// LOSSVERIFY_REFERENCE_TABLES=off turns them off (read per call: tests compare both in one process).
template <class T>
bool use_code_tables(bool kd, double softcap, bool vectorized) {
  const char* e = std::getenv("LOSSVERIFY_REFERENCE_TABLES");
  return std::is_same_v<T, __nv_bfloat16> && !kd && softcap == 0.0 && vectorized &&
         !(e != nullptr && std::string_view(e) == "off");
}

// The kernels the reference launches for a shard of type T, with or without the code tables: one choice
// for the launches and for the preload.
using PartialsKernel = void (*)(ReferencePartialArgs, double*, bool);
template <class T>
PartialsKernel partials_kernel_for(bool tables) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (tables) return partials_kernel<T, true>;
  }
  return partials_kernel<T, false>;
}
struct CompareLaunch {
  void (*kernel)(ReferenceCompareArgs, RowComparison*, bool);
  int threads;
  std::size_t shared_bytes;  // dynamic
};
template <class T>
CompareLaunch compare_launch_for(bool tables) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (tables) {
      // LOSSVERIFY_TABLE_THREADS=256: two blocks of 256 threads per SM, 128 registers (a benchmark knob).
      const char* e = std::getenv("LOSSVERIFY_TABLE_THREADS");
      if (e != nullptr && std::string_view(e) == "256") return {compare_kernel<T, true, 256>, 256, kTableSharedBytes};
      return {compare_kernel<T, true, kTableThreads>, kTableThreads, kTableSharedBytes};
    }
  }
  return {compare_kernel<T, false, kReferenceThreads>, kReferenceThreads, 0};
}

}  // namespace

bool reference_code_tables_apply(StorageType type, bool kd, double softcap) {
  bool apply = false;
  dispatch(type, [&](auto* tag) { apply = use_code_tables<std::remove_pointer_t<decltype(tag)>>(kd, softcap, true); });
  return apply;
}

void reference_partials(StorageType type, const ReferencePartialArgs& args, double* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = rows_vectorizable<T>(args.cols, {args.student, args.teacher});
    const bool tables = use_code_tables<T>(args.kd != 0 || args.row_coefficients != 0, args.softcap, vectorized);
    const PartialsKernel kernel = partials_kernel_for<T>(tables);
    kernel<<<reference_blocks(args.rows, kernel, kReferenceThreads, 0), kReferenceThreads, 0,
             static_cast<cudaStream_t>(stream)>>>(args, out, vectorized);
  });
}

void reference_kl(StorageType type, const ReferenceKlArgs& args, double* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    kl_kernel<T><<<reference_blocks(args.rows, kl_kernel<T>, kReferenceThreads, 0), kReferenceThreads, 0,
                   static_cast<cudaStream_t>(stream)>>>(args, out);
  });
}

void reference_compare(StorageType type, const ReferenceCompareArgs& args, RowComparison* out, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorized = rows_vectorizable<T>(args.cols, {args.student, args.teacher, args.grad});
    // Given expected values (a kind's or a stage's own oracle) are read per element: no code table holds them.
    const bool tables = args.expected == nullptr &&
                        use_code_tables<T>(args.kd != 0 || args.row_coefficients != 0, args.softcap, vectorized);
    const CompareLaunch l = compare_launch_for<T>(tables);
    if (l.shared_bytes > 0) {
      LV_CUDA(cudaFuncSetAttribute(l.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(l.shared_bytes)));
    }
    l.kernel<<<reference_blocks(args.rows, l.kernel, l.threads, l.shared_bytes), l.threads, l.shared_bytes,
               static_cast<cudaStream_t>(stream)>>>(args, out, vectorized);
  });
}

void preload_reference_kernels(StorageType type, bool kd, double softcap, const void* logits, std::int64_t cols) {
  const auto load = load_kernel_code;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // reference_partials' and reference_compare's choices (the gradient is allocated like the logits)
    const bool tables = use_code_tables<T>(kd, softcap, rows_vectorizable<T>(cols, {logits}));
    if (kd) load(reinterpret_cast<const void*>(kl_kernel<T>));
    load(reinterpret_cast<const void*>(partials_kernel_for<T>(tables)));
    load(reinterpret_cast<const void*>(compare_launch_for<T>(tables).kernel));
  });
}

void reference_exp_values(const double* in, double* out, std::size_t count) {
  if (count == 0) return;
  DeviceBytes d_in(count * sizeof(double)), d_out(count * sizeof(double));
  LV_CUDA(cudaMemcpy(d_in.as<void>(), in, d_in.size(), cudaMemcpyHostToDevice));
  exp_values_kernel<<<256, 256>>>(d_in.as<double>(), d_out.as<double>(), count);
  LV_CUDA(cudaGetLastError());
  LV_CUDA(cudaMemcpy(out, d_out.as<void>(), d_out.size(), cudaMemcpyDeviceToHost));
}

}  // namespace lossverify::cuda
