// Cross-entropy kernels of the CUDA backend: one block per row (a persistent grid), 16-byte vector
// loads where the rows allow them, online softmax statistics in pass 1, the gradient in pass 2.
// The per-element math is the HOST_DEVICE code the CPU kernel uses.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_types.cuh"
#include "lossverify/cuda/row_launch.cuh"
#include "lossverify/cuda/vector_elements.cuh"
#include "lossverify/kinds/cross_entropy/cross_entropy_kernels.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_math.hpp"

namespace lossverify::cuda {

namespace {

// Values of one 16-byte vector.
template <class T>
struct Vec {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

__device__ __forceinline__ float load_capped(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

// exp through the hardware ex2: one MUFU instruction. Relative error ~2^-22 plus the rounding of the
// scaled argument (2^-24 |x|): ~1e-6 where p matters, inside every gradient tolerance.
__device__ __forceinline__ float fast_exp(float x) { return exp2f(x * 1.4426950408889634f); }

// Online softmax state of one thread: max m, sum exp(x - m), sum x, and the target logit if seen.
struct Online {
  float m = -INFINITY;
  float s = 0.0f;
  float sum_x = 0.0f;
  __device__ void add(float x, bool no_shift) {
    sum_x += x;
    if (no_shift) {
      s += expf(x);
      return;
    }
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
};

__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;
  s = (m == -INFINITY ? 0.0f : s * expf(m - mm)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - mm));
  m = mm;
}

// A warp's online state from its lanes' (butterfly: every lane gets the same bits).
__device__ __forceinline__ void warp_combine(float& m, float& s, float& sum_x, bool no_shift) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    sum_x += __shfl_xor_sync(0xffffffffu, sum_x, offset);
    if (no_shift) {
      s += s2;
    } else {
      combine(m, s, m2, s2);
    }
  }
}

// A warp's [m, s, sum x] from its lanes': the warp max first, then each lane's s rescaled to it once and
// plain sums (every lane gets the same bits). fast_exp's ~1e-6 is the kernel's accuracy everywhere.
// Under no-max-shift every m is 0 and the factor is exactly 1.
__device__ __forceinline__ void warp_stats(float& m, float& s, float& sum_x) {
  float top = m;
  for (int offset = 16; offset > 0; offset >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
  s = s == 0.0f ? 0.0f : s * fast_exp(m - top);
  for (int offset = 16; offset > 0; offset >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, offset);
    sum_x += __shfl_xor_sync(0xffffffffu, sum_x, offset);
  }
  m = top;
}

// p = exp(x - M - log S) as the plain paths take it: x - M first (exact near the max, where p matters, however
// large the logits; x log2 e - lse log2 e in one FFMA lost |lse| 2^-24 and failed fp32 cases with logits of
// 120-240), then one FFMA and ex2 without the subnormal fix-up.
__device__ __forceinline__ float exp_shifted(float x, float row_max, float log_sum_log2e) {
  return ex2_ftz(fmaf(x - row_max, kLog2e, -log_sum_log2e));
}

// The plain path's block-wide [m, s, sum x]: warp_stats in each warp, then in warp 0 over the warps' results
// (one rescale per lane instead of an accurate expf pair per shuffle step); every thread gets the result.
__device__ void block_reduce_plain(float& m, float& s, float& sum_x) {
  __shared__ float3 shared[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  warp_stats(m, s, sum_x);
  if (lane == 0) shared[warp] = make_float3(m, s, sum_x);
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    const float3 w = lane < warps ? shared[lane] : make_float3(-INFINITY, 0.0f, 0.0f);
    m = w.x;
    s = w.y;
    sum_x = w.z;
    warp_stats(m, s, sum_x);
    if (lane == 0) shared[0] = make_float3(m, s, sum_x);
  }
  __syncthreads();
  m = shared[0].x;
  s = shared[0].y;
  sum_x = shared[0].z;
  __syncthreads();
}

// Block-wide reduction of the online state; every thread gets the result.
__device__ void block_reduce(float& m, float& s, float& sum_x, bool no_shift) {
  __shared__ float shared_m[32], shared_s[32], shared_x[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  warp_combine(m, s, sum_x, no_shift);
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
    shared_x[warp] = sum_x;
  }
  __syncthreads();
  const int warps = blockDim.x >> 5;
  if (warp == 0) {
    m = lane < warps ? shared_m[lane] : -INFINITY;
    s = lane < warps ? shared_s[lane] : 0.0f;
    sum_x = lane < warps ? shared_x[lane] : 0.0f;
    warp_combine(m, s, sum_x, no_shift);
    if (lane == 0) {
      shared_m[0] = m;
      shared_s[0] = s;
      shared_x[0] = sum_x;
    }
  }
  __syncthreads();
  m = shared_m[0];
  s = shared_s[0];
  sum_x = shared_x[0];
  __syncthreads();
}

// L2 residency hints for the fused kernel: pass 1 loads a row with evict_last so that it is still in L2
// when pass 2 reads it again (evict_first: it is not needed after), and the gradient is stored with
// evict_first so that it does not push rows out. Other kernels read each row once: plain loads.
enum class L2Hint { none, keep, release };
__device__ __forceinline__ std::uint64_t l2_policy(L2Hint hint) {
  std::uint64_t policy = 0;
  if (hint == L2Hint::keep) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  }
  return policy;
}
__device__ __forceinline__ int4 load16(const void* p, L2Hint hint, std::uint64_t policy) {
  if (hint == L2Hint::none) return __ldg(reinterpret_cast<const int4*>(p));
  int4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}
__device__ __forceinline__ void store16(void* p, int4 v, L2Hint hint, std::uint64_t policy) {
  if (hint == L2Hint::none) {
    __stcs(reinterpret_cast<int4*>(p), v);  // streaming store
    return;
  }
  asm volatile("st.global.L2::cache_hint.v4.s32 [%0], {%1, %2, %3, %4}, %5;"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
}

// Pass 1 over one row: [M_r, S_r, sum x, x_l] with S relative to M_r (M_r = 0 under no-max-shift).
// kPlain (no softcap, no catalogued kernel variant): the vector's max on packed pairs, and per element an
// FADD for sum x, the exponent as (x - M) log2 e (exact near the max), ex2 without the subnormal fix-up and an FADD.
template <class T, bool kPlain>
__device__ void row_stats(const T* row, std::int64_t cols, std::int64_t target, const CrossEntropyConstants& k,
                          bool vectorized, float out[4], L2Hint hint = L2Hint::none) {
  const std::uint64_t policy = hint == L2Hint::none ? 0 : l2_policy(hint);
  __shared__ float target_value;
  if (threadIdx.x == 0) target_value = 0.0f;
  __syncthreads();
  Online o;
  const bool no_shift = k.no_max_shift != 0;
  if (no_shift) o.m = 0.0f;
  if (vectorized) {
    using V = Vec<T>;
    const V* vrow = reinterpret_cast<const V*>(row);
    const int vectors = static_cast<int>(cols / V::kCount);  // 32-bit: a row of 2^31 vectors is 32 GB
    // The running max is rescaled once per vector, not per element.
    auto consume = [&](const V& vec) {
      if constexpr (kPlain) {
        const int4 raw = *reinterpret_cast<const int4*>(&vec);
        const float vmax = vector_max<T>(raw);
        if (vmax > o.m) {
          o.s = o.m == -INFINITY ? 0.0f : o.s * ex2_ftz((o.m - vmax) * kLog2e);
          o.m = vmax;
        }
        float part = 0.0f, xs = 0.0f;
        each_element<T>(raw, [&](float x, int) {
          xs += x;
          part += ex2_ftz((x - o.m) * kLog2e);
        });
        o.sum_x += xs;
        o.s += part;
      } else {
        float x[V::kCount];
        float vmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < V::kCount; ++j) {
          x[j] = load_capped(widen<T>(vec.v[j]), k.softcap);
          vmax = fmaxf(vmax, x[j]);
          o.sum_x += x[j];
        }
        if (no_shift) {
#pragma unroll
          for (int j = 0; j < V::kCount; ++j) o.s += fast_exp(x[j]);
          return;
        }
        if (vmax > o.m) {
          o.s = o.m == -INFINITY ? 0.0f : o.s * fast_exp(o.m - vmax);
          o.m = vmax;
        }
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < V::kCount; ++j) part += fast_exp(x[j] - o.m);
        o.s += part;
      }
    };
    // Four vectors in flight per thread before any arithmetic (memory-level parallelism).
    for_each_vector<4>(
        reinterpret_cast<const int4*>(vrow), vectors, [&](const int4* p) { return load16(p, hint, policy); },
        [&](const int4& raw, int) { consume(*reinterpret_cast<const V*>(&raw)); });
  } else {
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      o.add(load_capped(widen<T>(row[c]), k.softcap), no_shift);
  }
  if (threadIdx.x == 0 && target >= 0) target_value = load_capped(widen<T>(row[target]), k.softcap);
  float m = o.m, s = o.s, sum_x = o.sum_x;
  if constexpr (kPlain) {
    block_reduce_plain(m, s, sum_x);
  } else {
    block_reduce(m, s, sum_x, no_shift);
  }
  out[0] = no_shift ? 0.0f : m;
  out[1] = s;
  out[2] = sum_x;
  out[3] = target_value;
}

// The gradient of one element from the row's global max and log-sum: the HOST_DEVICE cross-entropy
// gradient plus the catalogued kernel-level variants.
template <class T>
struct GradElement {
  float row_max, log_sum, lse, z_factor, weight;
  bool valid;
  std::int64_t target;
  CrossEntropyConstants k;
  SmoothingWeights<float> q;
  __device__ GradElement(float row_max_, float log_sum_, float weight_, bool valid_, std::int64_t target_,
                         const CrossEntropyConstants& k_)
      : row_max(row_max_),
        log_sum(log_sum_),
        lse(row_max_ + log_sum_),
        z_factor(1.0f + 2.0f * k_.z_loss_weight * (row_max_ + log_sum_)),
        weight(weight_),
        valid(valid_),
        target(target_),
        k(k_),
        q{k_.q_on_backward, k_.q_off_backward} {}
  __device__ __forceinline__ T operator()(float raw, std::int64_t c) const { return (*this)(raw, c == target); }
  __device__ __forceinline__ T operator()(float raw, bool is_target) const {
    const float x = load_capped(raw, k.softcap);
    const float p = fast_exp((x - row_max) - log_sum);
    float g;
    if (!valid) {
      g = 2.0f * k.z_loss_weight * lse * p;
    } else if (k.zloss_grad_after_smoothing) {
      g = (p - (is_target ? q.on_target : q.off_target)) * z_factor;
    } else {
      g = cross_entropy_grad(p, is_target, q, z_factor);
    }
    if (k.softcap > 0.0f) g *= 1.0f - (x / k.softcap) * (x / k.softcap);
    if (k.grad_rounded_early) return narrow<T>(widen<T>(narrow<T>(g)) * weight);
    return narrow<T>(weight * g);
  }
};

// Pass 2 over one row: the gradient from the global max and log-sum. kPlain: as the row-resident kernel's
// plain path: exp_shifted, the shared gradient formula and the weight per element, the target's comparison only in
// the vector that holds it.
template <class T, bool kPlain>
__device__ void row_grad(const T* row, T* grad, std::int64_t cols, std::int64_t target, float row_max, float log_sum,
                         float weight, bool valid, const CrossEntropyConstants& k, bool vectorized,
                         L2Hint hint = L2Hint::none) {
  const std::uint64_t policy = hint == L2Hint::none ? 0 : l2_policy(L2Hint::release);
  const GradElement<T> value(row_max, log_sum, weight, valid, target, k);
  if (vectorized) {
    using V = Vec<T>;
    const V* vrow = reinterpret_cast<const V*>(row);
    V* vgrad = reinterpret_cast<V*>(grad);
    const int vectors = static_cast<int>(cols / V::kCount);
    const float log_sum_log2e = log_sum * kLog2e;
    const SmoothingWeights<float> q = valid ? value.q : SmoothingWeights<float>{0.0f, 0.0f};
    const float z_factor = valid ? value.z_factor : 2.0f * k.z_loss_weight * value.lse;
    const int target_vector = target >= 0 ? static_cast<int>(target / V::kCount) : -1;
    auto emit = [&](const V& in, int i) {
      if constexpr (kPlain) {
        const int4 raw = *reinterpret_cast<const int4*>(&in);
        int4 out;
        if (i != target_vector) {
          out = map_vector<T>(raw, [&](float x) {
            return weight * cross_entropy_grad(exp_shifted(x, row_max, log_sum_log2e), false, q, z_factor);
          });
        } else {
          const int lane = static_cast<int>(target - static_cast<std::int64_t>(i) * V::kCount);
          out = map_vector_indexed<T>(raw, [&](float x, int e) {
            return weight * cross_entropy_grad(exp_shifted(x, row_max, log_sum_log2e), e == lane, q, z_factor);
          });
        }
        store16(vgrad + i, out, hint, policy);
      } else {
        V out;
#pragma unroll
        for (int j = 0; j < V::kCount; ++j) {
          out.v[j] = value(widen<T>(in.v[j]), static_cast<std::int64_t>(i) * V::kCount + j);
        }
        store16(vgrad + i, *reinterpret_cast<const int4*>(&out), hint, policy);
      }
    };
    for_each_vector<4>(
        reinterpret_cast<const int4*>(vrow), vectors, [&](const int4* p) { return load16(p, hint, policy); },
        [&](const int4& raw, int i) { emit(*reinterpret_cast<const V*>(&raw), i); });
  } else {
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) grad[c] = value(widen<T>(row[c]), c);
  }
}

template <class T>
bool can_vectorize(const void* a, const void* b, std::int64_t cols) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; };
  return (cols * static_cast<std::int64_t>(sizeof(T))) % 16 == 0 && aligned(a) && (b == nullptr || aligned(b));
}

template <class T, bool kPlain>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(StatsArgs a, CrossEntropyConstants k, float* out, bool vectorized) {
  const T* logits = static_cast<const T*>(a.logits);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float* o = out + 4 * r;
    if (!a.active[r]) {
      if (threadIdx.x == 0) o[0] = o[1] = o[2] = o[3] = 0.0f;
      continue;
    }
    float stats[4];
    row_stats<T, kPlain>(logits + r * a.cols, a.cols, a.target_column[r], k, vectorized, stats);
    if (threadIdx.x == 0) {
      for (int j = 0; j < 4; ++j) o[j] = stats[j];
    }
  }
}

template <class T, bool kPlain>
__global__ void __launch_bounds__(kThreads) grad_kernel(GradArgs a, CrossEntropyConstants k, bool vectorized) {
  const T* logits = static_cast<const T*>(a.logits);
  T* grad = static_cast<T*>(a.grad);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    if (!a.active[r]) {
      zero_row(grad + r * a.cols, a.cols);
      continue;
    }
    row_grad<T, kPlain>(logits + r * a.cols, grad + r * a.cols, a.cols, a.target_column[r], a.row_max[r], a.log_sum[r],
                        a.weight[r], a.valid[r] != 0, k, vectorized);
  }
}

template <class T, bool kPlain>
__global__ void __launch_bounds__(kThreads)
    fused_kernel(GradArgs a, CrossEntropyConstants k, float* row_stats_out, bool vectorized, L2Hint l2_hint) {
  const T* logits = static_cast<const T*>(a.logits);
  T* grad = static_cast<T*>(a.grad);
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float* o = row_stats_out + 4 * r;
    if (!a.active[r]) {
      zero_row(grad + r * a.cols, a.cols);
      if (threadIdx.x == 0) o[0] = o[1] = o[2] = o[3] = 0.0f;
      continue;
    }
    float stats[4];
    row_stats<T, kPlain>(logits + r * a.cols, a.cols, a.target_column[r], k, vectorized, stats, l2_hint);
    const float log_sum = logf(stats[1]);
    row_grad<T, kPlain>(logits + r * a.cols, grad + r * a.cols, a.cols, a.target_column[r], stats[0], log_sum,
                        a.weight[r], a.valid[r] != 0, k, vectorized,
                        l2_hint == L2Hint::none ? L2Hint::none : L2Hint::release);
    if (threadIdx.x == 0) {
      o[0] = stats[0];
      o[1] = log_sum;
      o[2] = stats[2];
      o[3] = stats[3];
    }
  }
}

// Row-resident fused kernel for long rows (TP = 1). A cluster of up to 8 CTAs holds one row in
// registers: each thread loads kResidentVectors 16-byte vectors of the row, the CTAs combine their
// statistics through distributed shared memory (one cluster barrier per row), and the gradient is
// computed from the registers. DRAM sees each logit once and each gradient once, the 4-byte floor for
// bf16, without relying on L2 to keep a 256 KB row between two passes; several CTAs per SM, each at its
// own row, overlap one row's loads with another's reduction and stores.
constexpr int kResidentVectors = 8;

// An empty asm that claims to change the row's registers: each pass widens the packed values again
// instead of the compiler keeping all of them widened across passes (64 more live registers, spills).
template <int N>
__device__ __forceinline__ void opaque(int4 (&data)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) asm volatile("" : "+r"(data[j].x), "+r"(data[j].y), "+r"(data[j].z), "+r"(data[j].w));
}

// The copy engine's 1-D bulk copy into this CTA's shared memory, completing on an mbarrier.
__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(std::uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(barrier)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival (the issuing thread's) that also expects `bytes` of copies, then the copy itself.
__device__ __forceinline__ void bulk_load(void* destination, const void* source, std::uint32_t bytes,
                                          std::uint64_t* barrier) {
  const std::uint32_t b = smem_address(barrier);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  if (bytes > 0) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_address(destination)),
                 "l"(source), "r"(bytes), "r"(b)
                 : "memory");
  }
}
__device__ __forceinline__ void barrier_wait(std::uint64_t* barrier, std::uint32_t parity) {
  const std::uint32_t b = smem_address(barrier);
  std::uint32_t done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(b), "r"(parity)
                 : "memory");
  }
}
// The same wait, acquiring at cluster scope what peers' st.async released into this CTA.
__device__ __forceinline__ void cluster_barrier_wait(std::uint64_t* barrier, std::uint32_t parity) {
  const std::uint32_t b = smem_address(barrier);
  std::uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
  }
}
// Expect `bytes` more on this CTA's barrier (one arrival, the calling thread's).
__device__ __forceinline__ void expect_bytes(std::uint64_t* barrier, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)), "r"(bytes)
               : "memory");
}
// v into CTA `rank`'s copy of `slot`, completing 16 bytes on that CTA's copy of `barrier` (st.async: no fence
// over this thread's other stores, which a cluster barrier's release would wait for).
__device__ __forceinline__ void send_to_peer(float4* slot, std::uint64_t* barrier, unsigned rank, float4 v) {
  std::uint32_t remote_slot, remote_barrier;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_slot) : "r"(smem_address(slot)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_barrier) : "r"(smem_address(barrier)), "r"(rank));
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(remote_slot),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_barrier)
      : "memory");
}

template <class T, int kBlock, int kMinBlocks, bool kGeneric>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
    resident_fused_kernel(GradArgs a, CrossEntropyConstants k, float* row_stats_out) {
  using V = Vec<T>;
  if constexpr (!kGeneric) {  // the plain instantiation: no softcap and no catalogued kernel variant
    k.softcap = 0.0f;
    k.no_max_shift = 0;
    k.zloss_grad_after_smoothing = 0;
    k.grad_rounded_early = 0;
  }
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const unsigned size = cluster.num_blocks();
  const std::int64_t clusters = gridDim.x / size;
  const int vectors = static_cast<int>(a.cols / V::kCount);  // a row of 2^31 elements would be 4 GB
  const bool no_shift = k.no_max_shift != 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kWarps = kBlock / 32;
  // Every CTA's [m, s, sum x] of the row, sent by each CTA into every CTA's inbox (st.async, completing on
  // the receiver's `received` barrier of the row's parity among active rows). A peer writes an inbox of
  // parity p again two active rows later, which it reaches only after this CTA's partial of the row between,
  // sent after this CTA read the inbox. The exchange replaced a cluster barrier per row, whose release
  // waited for the previous row's gradient stores (Nsight Compute: membar stalls).
  __shared__ float4 inbox[2][8];
  __shared__ std::uint64_t received[2];
  __shared__ float3 partial[kWarps];
  __shared__ float3 row_final;  // rewritten a row later, after a block barrier that every reader has passed
  __shared__ std::uint64_t loaded;
  // The next row's chunk, prefetched by the copy engine while this row is computed from registers.
  extern __shared__ int4 staged[];
  // This CTA's chunk of every row: vectors [first_vector, first_vector + chunk); thread t holds
  // chunk vectors t + j kBlock.
  const int first_vector = static_cast<int>(rank) * kBlock * kResidentVectors;
  const int chunk = max(0, min(vectors - first_vector, kBlock * kResidentVectors));
  const int limit = chunk - static_cast<int>(threadIdx.x);
  auto prefetch = [&](std::int64_t r) {  // thread 0; nothing to read for an inactive row
    const bool active = a.active[r] != 0;
    const T* row = static_cast<const T*>(a.logits) + r * a.cols;
    bulk_load(staged, reinterpret_cast<const V*>(row) + first_vector,
              active ? static_cast<std::uint32_t>(chunk) * 16u : 0u, &loaded);
  };
  if (threadIdx.x == 0) {
    barrier_init(&loaded);
    barrier_init(&received[0]);
    barrier_init(&received[1]);
    expect_bytes(&received[0], 16u * size);
    expect_bytes(&received[1], 16u * size);
  }
  cluster.sync();  // every CTA's barriers are initialised before any peer sends to them
  std::int64_t r = blockIdx.x / size;
  if (threadIdx.x == 0 && r < a.rows) prefetch(r);
  std::uint32_t phase = 0;
  std::uint32_t received_phases = 0;  // bit p: the phase of received[p] awaited next
  int parity = 0;
  for (; r < a.rows; r += clusters) {
    // Pointers into the row are made where they are used: live across the passes they cost registers (the
    // kernel sits at its 64-register cap).
    const auto mine_grad = [&] {
      return reinterpret_cast<V*>(static_cast<T*>(a.grad) + r * a.cols) + first_vector + threadIdx.x;
    };
    const bool active = a.active[r] != 0;
    barrier_wait(&loaded, phase);
    phase ^= 1u;
    int4 data[kResidentVectors];
    const std::int64_t target = active ? a.target_column[r] : -1;
    // The target's vector relative to this thread's first (a multiple of kBlock below kResidentVectors
    // kBlock for the thread that holds it), and its element.
    const int target_vector =
        target >= 0 ? static_cast<int>(target / V::kCount) - first_vector - static_cast<int>(threadIdx.x) : -1;
    const int target_lane = target >= 0 ? static_cast<int>(target % V::kCount) : -1;
    const bool holds_target = target_vector >= 0 && target_vector % kBlock == 0 && target_vector < limit &&
                              target_vector < kBlock * kResidentVectors;
    float x_target = 0.0f;
    if (active) {
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        data[j] = j * kBlock < limit ? staged[threadIdx.x + j * kBlock] : make_int4(0, 0, 0, 0);
      }
      if constexpr (!kGeneric) {  // the plain path rewrites the target element from this value
        if (holds_target) x_target = widen<T>(reinterpret_cast<const T*>(staged)[target - first_vector * V::kCount]);
      }
    }
    // Every thread has its registers, the buffer takes the next row: warp 0 (whose thread 0 asks for it) waits
    // for the others' arrival, which do not wait.
    if (warp == 0) {
      asm volatile("bar.sync 1, %0;" ::"r"(kBlock) : "memory");
    } else {
      asm volatile("bar.arrive 1, %0;" ::"r"(kBlock) : "memory");
    }
    if (threadIdx.x == 0 && r + clusters < a.rows) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      prefetch(r + clusters);
    }
    if (!active) {  // the same for every CTA of the cluster: no barrier skipped by some only
      V zero;
#pragma unroll
      for (int e = 0; e < V::kCount; ++e) zero.v[e] = narrow<T>(0.0f);
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        if (j * kBlock < limit)
          __stcs(reinterpret_cast<int4*>(mine_grad() + j * kBlock), *reinterpret_cast<const int4*>(&zero));
      }
      if (rank == 0 && threadIdx.x == 0) {
        float* o = row_stats_out + 4 * r;
        o[0] = o[1] = o[2] = o[3] = 0.0f;
      }
      continue;
    }
    float target_value = 0.0f;
    if (rank == 0 && threadIdx.x == 0 && target >= 0) {
      target_value = load_capped(widen<T>(static_cast<const T*>(a.logits)[r * a.cols + target]), k.softcap);
    }
    // This thread's max (exact, order-free), then its sums relative to it.
    float m = no_shift ? 0.0f : -INFINITY;
    float s = 0.0f, sum_x = 0.0f;
    if constexpr (kGeneric) {
      if (!no_shift) {
#pragma unroll
        for (int j = 0; j < kResidentVectors; ++j) {
          if (j * kBlock >= limit) continue;
          const V& v = *reinterpret_cast<const V*>(&data[j]);
#pragma unroll
          for (int e = 0; e < V::kCount; ++e) m = fmaxf(m, load_capped(widen<T>(v.v[e]), k.softcap));
        }
      }
      opaque(data);
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        if (j * kBlock >= limit) continue;
        const V& v = *reinterpret_cast<const V*>(&data[j]);
#pragma unroll
        for (int e = 0; e < V::kCount; ++e) {
          const float x = load_capped(widen<T>(v.v[e]), k.softcap);
          sum_x += x;
          s += fast_exp(x - m);
        }
      }
    } else {
      int4 top = lowest_vector<T>();
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        if (j * kBlock < limit) packed_max<T>(data[j], top);
      }
      each_element<T>(top, [&](float x, int) { m = fmaxf(m, x); });
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        if (j * kBlock >= limit) continue;
        each_element<T>(data[j], [&](float x, int) {
          sum_x += x;
          s += ex2_ftz((x - m) * kLog2e);
        });
      }
    }
    warp_stats(m, s, sum_x);
    if (lane == 0) partial[warp] = make_float3(m, s, sum_x);
    __syncthreads();
    if (warp == 0) {
      const float3 w = lane < kWarps ? partial[lane] : make_float3(-INFINITY, 0.0f, 0.0f);
      m = w.x;
      s = w.y;
      sum_x = w.z;
      warp_stats(m, s, sum_x);
      if (lane < static_cast<int>(size)) {
        send_to_peer(&inbox[parity][rank], &received[parity], static_cast<unsigned>(lane),
                     make_float4(m, s, sum_x, 0.0f));
      }
    }
    // The row's statistics from the inbox, one slot per lane of warp 0 in rank order (the same values through
    // the same tree give the same bits in every CTA). Lane 0 re-arms the barrier for the row two active rows
    // on: the phase it arms stays incomplete until peers send that row.
    if (warp == 0) {
      cluster_barrier_wait(&received[parity], (received_phases >> parity) & 1u);
      received_phases ^= 1u << parity;
      const float4 peer =
          lane < static_cast<int>(size) ? inbox[parity][lane] : make_float4(-INFINITY, 0.0f, 0.0f, 0.0f);
      __syncwarp();
      if (lane == 0) expect_bytes(&received[parity], 16u * size);
      m = peer.x;
      s = peer.y;
      sum_x = peer.z;
      warp_stats(m, s, sum_x);
      if (lane == 0) row_final = make_float3(m, s, sum_x);
    }
    __syncthreads();
    const float row_m = row_final.x, row_s = row_final.y, row_x = row_final.z;
    parity ^= 1;
    const float log_sum = logf(row_s);
    opaque(data);
    const GradElement<T> value(row_m, log_sum, a.weight[r], a.valid[r] != 0, target, k);
    if constexpr (kGeneric) {
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        if (j * kBlock >= limit) continue;
        const V& in = *reinterpret_cast<const V*>(&data[j]);
        V out;
#pragma unroll
        for (int e = 0; e < V::kCount; ++e) {
          out.v[e] = value(widen<T>(in.v[e]), j * kBlock == target_vector && e == target_lane);
        }
        __stcs(reinterpret_cast<int4*>(mine_grad() + j * kBlock), *reinterpret_cast<const int4*>(&out));
      }
    } else {
      // Every element as off-target (exp_shifted, the shared gradient formula, the weight); the thread that holds
      // the target then rewrites that element.
      const float log_sum_log2e = log_sum * kLog2e;
      const SmoothingWeights<float> q = value.valid ? value.q : SmoothingWeights<float>{0.0f, 0.0f};
      const float z_factor = value.valid ? value.z_factor : 2.0f * k.z_loss_weight * value.lse;
      const float weight = value.weight;
#pragma unroll
      for (int j = 0; j < kResidentVectors; ++j) {
        if (j * kBlock >= limit) continue;
        const int4 out = map_vector<T>(data[j], [&](float x) {
          return weight * cross_entropy_grad(exp_shifted(x, row_m, log_sum_log2e), false, q, z_factor);
        });
        __stcs(reinterpret_cast<int4*>(mine_grad() + j * kBlock), out);
      }
      if (holds_target) {
        const float p = exp_shifted(x_target, row_m, log_sum_log2e);
        reinterpret_cast<T*>(mine_grad())[target - (first_vector + threadIdx.x) * V::kCount] =
            narrow<T>(weight * cross_entropy_grad(p, true, q, z_factor));
      }
    }
    if (rank == 0 && threadIdx.x == 0) {
      float* o = row_stats_out + 4 * r;
      o[0] = row_m;
      o[1] = log_sum;
      o[2] = row_x;
      o[3] = target_value;
    }
  }
  cluster.sync();  // no CTA leaves while a peer may still send to it
}

// smoothing-log-after-exp's third pass: sum_v log(exp(x_v - M) / S) over the row's local columns.
template <class T>
__global__ void __launch_bounds__(kThreads) sum_log_p_kernel(SumLogProbArgs a, CrossEntropyConstants k, float* out) {
  const T* logits = static_cast<const T*>(a.logits);
  __shared__ float shared[32];
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    float sum = 0.0f;
    if (a.active[r]) {
      const T* x = logits + r * a.cols;
      const float m = a.row_max[r], total = a.sum_exp[r];
      // Accurate expf and logf: the bug is the underflow of exp(x - M) to 0, then log(0) = -inf.
      for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
        sum += logf(expf(load_capped(widen<T>(x[c]), k.softcap) - m) / total);
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += shared[w];
      out[r] = total;
    }
    __syncthreads();
  }
}

// Whether a kernel needs its generic per-element code: softcap or a catalogued kernel variant.
bool needs_generic(const CrossEntropyConstants& k) {
  return k.softcap > 0.0f || k.no_max_shift || k.zloss_grad_after_smoothing || k.grad_rounded_early;
}

// f(std::true_type) where the plain per-element code applies, else f(std::false_type): the kernels' kPlain.
template <class F>
void with_plain(const CrossEntropyConstants& k, F&& f) {
  if (needs_generic(k)) {
    f(std::false_type{});
  } else {
    f(std::true_type{});
  }
}

}  // namespace

void cross_entropy_stats(StorageType type, const StatsArgs& args, const CrossEntropyConstants& k, float* out,
                         void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const LaunchShape shape = shard_launch_shape<T>(args.rows);
    with_plain(k, [&](auto plain) {
      stats_kernel<T, decltype(plain)::value><<<shape.blocks, shape.threads, 0, static_cast<cudaStream_t>(stream)>>>(
          args, k, out, can_vectorize<T>(args.logits, nullptr, args.cols));
    });
  });
}

namespace {

// overwrites-input: p = exp(x - M - log S) over the row's own logits, and the same into its gradient.
template <class T>
__global__ void __launch_bounds__(kThreads) softmax_in_place_kernel(SoftmaxInPlaceArgs a, float softcap) {
  T* const logits = static_cast<T*>(a.logits);
  T* const grad = static_cast<T*>(a.grad);
  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    if (!a.active[row]) continue;
    const float shift = a.row_max[row] + a.log_sum[row];
    for (std::int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const std::int64_t at = row * a.cols + c;
      logits[at] = narrow<T>(fast_exp(load_capped(widen<T>(logits[at]), softcap) - shift));
      grad[at] = logits[at];
    }
  }
}

}  // namespace

void cross_entropy_softmax_in_place(StorageType type, const SoftmaxInPlaceArgs& args, float softcap, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(args.rows, 65535));
    softmax_in_place_kernel<T><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, softcap);
  });
}

void cross_entropy_grad(StorageType type, const GradArgs& args, const CrossEntropyConstants& k, void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const LaunchShape shape = shard_launch_shape<T>(args.rows);
    with_plain(k, [&](auto plain) {
      grad_kernel<T, decltype(plain)::value><<<shape.blocks, shape.threads, 0, static_cast<cudaStream_t>(stream)>>>(
          args, k, can_vectorize<T>(args.logits, args.grad, args.cols));
    });
  });
}

namespace {

// The row-resident kernel's launch: LOSSVERIFY_FUSED_RESIDENT=off|256x4|256x3|512x2|1024x1 (threads x
// CTAs per SM; a tuning aid, the default was measured best on the H100, bench/NOTES.md).
struct ResidentShape {
  int block = 256, per_sm = 4;
};
ResidentShape resident_shape() {
  static const ResidentShape shape = [] {
    ResidentShape r;
    const char* e = std::getenv("LOSSVERIFY_FUSED_RESIDENT");
    if (e == nullptr) return r;
    const std::string_view v(e);
    if (v == "off") r.block = 0;
    if (v == "256x3") r.per_sm = 3;
    if (v == "512x2") r = {512, 2};
    if (v == "1024x1") r = {1024, 1};
    return r;
  }();
  return shape;
}

// The plain row-resident instantiation (no softcap, no catalogued kernel variant) fits 64 registers; the
// generic one takes 80, so three 256-thread CTAs per SM.
ResidentShape resident_shape_for(const CrossEntropyConstants& k) {
  ResidentShape shape = resident_shape();
  if (shape.block != 0 && needs_generic(k)) shape = {256, 3};
  return shape;
}

// Cluster size the row-resident kernel uses for rows of `cols` elements; 0 where it does not apply
// (rows of up to 64 KB, which the many-rows-per-SM kernel serves at the floor; rows beyond 8 CTAs'
// registers; rows that cannot be read in 16-byte vectors).
template <class T>
int resident_cluster(const void* logits, const void* grad, std::int64_t cols, int block) {
  if (block == 0 || cols * static_cast<std::int64_t>(sizeof(T)) <= 64 * 1024 || !can_vectorize<T>(logits, grad, cols)) {
    return 0;
  }
  const std::int64_t vectors = cols / Vec<T>::kCount;
  const std::int64_t per_cta = static_cast<std::int64_t>(block) * kResidentVectors;
  int cluster = 1;
  while (cluster * per_cta < vectors) cluster *= 2;
  return cluster <= 8 ? cluster : 0;
}

// The row-resident instantiation for these constants (its threads x CTAs per SM, generic or plain).
using ResidentKernel = void (*)(GradArgs, CrossEntropyConstants, float*);
struct ResidentVariant {
  ResidentKernel kernel;
  int block;
};
template <class T>
ResidentVariant resident_variant(const CrossEntropyConstants& k) {
  const ResidentShape shape = resident_shape_for(k);
  if (needs_generic(k)) return {resident_fused_kernel<T, 256, 3, true>, 256};
  if (shape.block == 1024) return {resident_fused_kernel<T, 1024, 1, false>, 1024};
  if (shape.block == 512) return {resident_fused_kernel<T, 512, 2, false>, 512};
  if (shape.per_sm == 3) return {resident_fused_kernel<T, 256, 3, false>, 256};
  return {resident_fused_kernel<T, 256, 4, false>, 256};
}

bool launch_resident(const ResidentVariant& variant, const GradArgs& args, const CrossEntropyConstants& k,
                     float* row_stats, int cluster, cudaStream_t stream) {
  const ResidentKernel kernel = variant.kernel;
  const int block = variant.block;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.gridDim = dim3(static_cast<unsigned>(cluster * persistent_blocks()));
  // The prefetch buffer: one chunk of a row per CTA.
  const int staged_bytes = block * kResidentVectors * 16;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, staged_bytes) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  config.dynamicSmemBytes = static_cast<std::size_t>(staged_bytes);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  int max_clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config) != cudaSuccess || max_clusters < 1) {
    cudaGetLastError();  // clear it: the caller falls back to the two-pass kernel
    return false;
  }
  // A persistent grid: as many clusters as fit at once, each walking the rows.
  const std::int64_t clusters = std::min<std::int64_t>(args.rows, max_clusters);
  config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
  if (cudaLaunchKernelEx(&config, kernel, args, k, row_stats) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

template <class T>
bool launch_resident(const GradArgs& args, const CrossEntropyConstants& k, float* row_stats, cudaStream_t stream) {
  const ResidentShape shape = resident_shape_for(k);
  const int cluster = resident_cluster<T>(args.logits, args.grad, args.cols, shape.block);
  if (cluster == 0) return false;
  return launch_resident(resident_variant<T>(k), args, k, row_stats, cluster, stream);
}

}  // namespace

int fused_cluster_size(StorageType type, const CrossEntropyConstants& k, const void* logits, const void* grad,
                       std::int64_t cols) {
  int cluster = 0;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cluster = resident_cluster<T>(logits, grad, cols, resident_shape_for(k).block);
  });
  return cluster;
}

void cross_entropy_fused(StorageType type, const GradArgs& args, const CrossEntropyConstants& k, float* row_stats_out,
                         void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto s = static_cast<cudaStream_t>(stream);
    if (launch_resident<T>(args, k, row_stats_out, s)) return;
    const LaunchShape shape = launch_shape<T>(args.rows, args.cols);
    // Tuning aid: LOSSVERIFY_FUSED_L2=none turns the L2 residency hints off.
    static const bool hints = [] {
      const char* e = std::getenv("LOSSVERIFY_FUSED_L2");
      return e == nullptr || std::string_view(e) != "none";
    }();
    with_plain(k, [&](auto plain) {
      fused_kernel<T, decltype(plain)::value><<<shape.blocks, shape.threads, 0, s>>>(
          args, k, row_stats_out, can_vectorize<T>(args.logits, args.grad, args.cols),
          hints ? L2Hint::keep : L2Hint::none);
    });
  });
}

void cross_entropy_sum_log_p(StorageType type, const SumLogProbArgs& args, const CrossEntropyConstants& k, float* out,
                             void* stream) {
  if (args.rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const LaunchShape shape = launch_shape<T>(args.rows, args.cols);
    sum_log_p_kernel<T><<<shape.blocks, shape.threads, 0, static_cast<cudaStream_t>(stream)>>>(args, k, out);
  });
}

namespace {
template <class... Kernels>
void load_functions(Kernels... kernels) {
  (load_kernel_code(reinterpret_cast<const void*>(kernels)), ...);
}
}  // namespace

void preload_cross_entropy_kernels(StorageType type, const CrossEntropyConstants& constants, bool whole_rows,
                                   const void* logits, std::int64_t cols) {
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (!whole_rows) {
      with_plain(constants, [](auto plain) {
        load_functions(stats_kernel<T, decltype(plain)::value>, grad_kernel<T, decltype(plain)::value>);
      });
    } else {
      // cross_entropy_fused's choice (launch_resident): the row-resident instantiation, else the fused kernel.
      const int block = resident_shape_for(constants).block;
      if (resident_cluster<T>(logits, logits, cols, block) == 0) {
        with_plain(constants, [](auto plain) { load_functions(fused_kernel<T, decltype(plain)::value>); });
      } else {
        load_functions(resident_variant<T>(constants).kernel);
      }
    }
  });
}

}  // namespace lossverify::cuda
