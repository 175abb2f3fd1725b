// The router's CUDA kernels: routing and counting (pass 1), the loss terms and the gradient (pass 2), one warp per
// (row, layer) of a grid-stride loop.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/kinds/router/router_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// A float's bits as an unsigned integer of the same order (-inf lowest), and back.
__device__ unsigned ordered_bits(float v) {
  const unsigned b = __float_as_uint(v);
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}
__device__ float from_ordered_bits(unsigned u) {
  return __uint_as_float((u & 0x80000000u) != 0 ? (u ^ 0x80000000u) : ~u);
}

// The warp's best of its lanes' (value, index) pairs in the order value descending, index ascending: two integer
// warp reductions (sm_80 and later) instead of five rounds of two shuffles.
__device__ void warp_best(float& value, int& index) {
  const unsigned key = ordered_bits(value);
  const unsigned top = __reduce_max_sync(0xffffffffu, key);
  index = static_cast<int>(__reduce_min_sync(0xffffffffu, key == top ? static_cast<unsigned>(index) : 0xffffffffu));
  value = from_ordered_bits(top);
}

// A lane's values sorted in the order value descending, index ascending (Batcher's networks for 2 and 8), so that
// each round of the top-k reads one head per lane.
__device__ void order_pair(float (&v)[8], int (&id)[8], int a, int b) {
  if (v[b] > v[a] || (v[b] == v[a] && id[b] < id[a])) {
    const float t = v[a];
    v[a] = v[b];
    v[b] = t;
    const int u = id[a];
    id[a] = id[b];
    id[b] = u;
  }
}
template <int PER>
__device__ void sort_lane(float (&v)[PER], int (&id)[PER]);
template <>
__device__ void sort_lane<2>(float (&v)[2], int (&id)[2]) {
  if (v[1] > v[0] || (v[1] == v[0] && id[1] < id[0])) {
    const float t = v[0];
    v[0] = v[1];
    v[1] = t;
    const int u = id[0];
    id[0] = id[1];
    id[1] = u;
  }
}
template <>
__device__ void sort_lane<8>(float (&v)[8], int (&id)[8]) {
  constexpr int pairs[19][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {1, 2}, {5, 6},
                                {0, 4}, {1, 5}, {2, 6}, {3, 7}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}};
#pragma unroll
  for (const auto& p : pairs) order_pair(v, id, p[0], p[1]);
}

// The expert after (previous, previous_index) in that order, among a row in memory (any width).
__device__ void next_in_memory(const float* z, int lane, int experts, float previous, int previous_index, float& best,
                               int& best_index) {
  for (int e = lane; e < experts; e += 32) {
    const float v = z[e];
    const bool after = v < previous || (v == previous && e > previous_index);
    if (after && (v > best || (v == best && e < best_index))) {
      best = v;
      best_index = e;
    }
  }
}

// Pass 1. The scope's counts gather in shared memory per block (one global add per block and count at the end:
// every warp adding to the same E + 1 floats in global memory serialises them) where they fit (`shared_counts`).
// PER > 0: rows of at most 32 PER experts, read once into registers and sorted per lane, so that each of the k
// rounds compares one head per lane and the winner's lane pops it; 0: any width, each round a scan of the row for
// the expert after the previous one. A warp counts its rows in a register, added once at the end.
template <int PER>
__global__ void __launch_bounds__(kThreads) route_kernel(RouterRouteArgs a, int shared_counts) {
  extern __shared__ float block_counts[];
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  const std::int64_t items = a.rows * a.layers;
  const int width = a.experts + 1;
  float* counts = shared_counts ? block_counts : a.scope;
  if (shared_counts) {
    for (int i = threadIdx.x; i < a.layers * width; i += blockDim.x) block_counts[i] = 0.0f;
    __syncthreads();
  }
  constexpr int kLane = PER > 0 ? PER : 1;
  float rows_counted = 0.0f;  // this warp's rows of layer 0 (every layer counts the same rows)
  for (std::int64_t item = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; item < items;
       item += warps) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    if (!a.counted[r]) continue;
    const float* z = a.logits + (r * a.layers + l) * a.experts;
    float v[kLane];
    int id[kLane];
    if constexpr (PER > 0) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < a.experts ? z[e] : -INFINITY;
        id[i] = e < a.experts ? e : INT_MAX;
      }
      sort_lane<PER>(v, id);
    }
    const int slot = a.sequences != nullptr ? a.slot[r] : -1;
    float* own = slot >= 0 ? a.sequences + (static_cast<std::int64_t>(slot) * a.layers + l) * width : nullptr;
    float previous = INFINITY;
    int previous_index = -1;
    for (int j = 0; j < a.top_k; ++j) {
      float best = -INFINITY;
      int best_index = INT_MAX;
      if constexpr (PER > 0) {
        best = v[0];
        best_index = id[0];
      } else {
        next_in_memory(z, lane, a.experts, previous, previous_index, best, best_index);
      }
      warp_best(best, best_index);
      if constexpr (PER > 0) {
        if (id[0] == best_index) {  // the winner's lane: its next value moves up
#pragma unroll
          for (int i = 0; i + 1 < PER; ++i) {
            v[i] = v[i + 1];
            id[i] = id[i + 1];
          }
          v[PER - 1] = -INFINITY;
          id[PER - 1] = INT_MAX;
          atomicAdd(&counts[l * width + best_index], 1.0f);
          if (own != nullptr) atomicAdd(&own[best_index], 1.0f);
        }
      } else if (lane == 0) {
        atomicAdd(&counts[l * width + best_index], 1.0f);
        if (own != nullptr) atomicAdd(&own[best_index], 1.0f);
      }
      previous = best;
      previous_index = best_index;
    }
    if (l == 0) rows_counted += 1.0f;
    if (lane == 0 && own != nullptr) atomicAdd(&own[a.experts], 1.0f);
  }
  if (lane == 0 && rows_counted != 0.0f) {
    for (int l = 0; l < a.layers; ++l) atomicAdd(&counts[l * width + a.experts], rows_counted);
  }
  if (shared_counts) {
    __syncthreads();
    for (int i = threadIdx.x; i < a.layers * width; i += blockDim.x) {
      if (block_counts[i] != 0.0f) atomicAdd(&a.scope[i], block_counts[i]);
    }
  }
}

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Whether key (value, index) comes before (other, other_index): larger keys first, ties to the lower index.
__device__ bool before(float value, int index, float other, int other_index) {
  return value > other || (value == other && index < other_index);
}

// The routed map's key of expert e: the routing score plus the expert's bias.
__device__ float routing_key(const float* z, const float* bias, int e, int use_sigmoid, float lse) {
  return (use_sigmoid ? sigmoid(z[e]) : expf(z[e] - lse)) + bias[e];
}

// The best expert of [begin, end) (within `allowed` groups of `size`) after (previous, previous_index).
__device__ void next_routed(const float* z, const float* bias, int use_sigmoid, float lse, int begin, int end,
                            unsigned long long allowed, int size, float previous, int previous_index, float& best,
                            int& best_index) {
  best = -INFINITY;
  best_index = INT_MAX;
  for (int e = begin; e < end; ++e) {
    if (((allowed >> (e / size)) & 1ull) == 0) continue;
    const float key = routing_key(z, bias, e, use_sigmoid, lse);
    if (before(previous, previous_index, key, e) && before(key, e, best, best_index)) {
      best = key;
      best_index = e;
    }
  }
}

// The routed map, one thread per (row, layer) (RouterRouteArgs::bias): groups by the sum of their top keys, then the
// top keys among the kept groups' experts, counted as the plain kernel counts.
__global__ void __launch_bounds__(kThreads) routed_route_kernel(RouterRouteArgs a) {
  const std::int64_t items = a.rows * a.layers;
  const int width = a.experts + 1;
  const int size = a.experts / a.groups;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    if (!a.counted[r]) continue;
    const float* z = a.logits + (r * a.layers + l) * a.experts;
    const float* bias = a.bias + static_cast<std::int64_t>(l) * a.experts;
    float lse = 0.0f;
    if (!a.sigmoid) {
      float max = -INFINITY, sum = 0.0f;
      for (int e = 0; e < a.experts; ++e) max = fmaxf(max, z[e]);
      for (int e = 0; e < a.experts; ++e) sum += expf(z[e] - max);
      lse = max + logf(sum);
    }
    unsigned long long allowed = ~0ull;
    if (a.groups > 1) {
      float score[64];
      const int best_keys = a.router_k / a.top_groups > 0 ? a.router_k / a.top_groups : 1;
      for (int q = 0; q < a.groups; ++q) {
        float previous = INFINITY, sum = 0.0f;
        int previous_index = -1;
        for (int j = 0; j < best_keys && j < size; ++j) {
          float best;
          int best_index;
          next_routed(z, bias, a.sigmoid, lse, q * size, (q + 1) * size, ~0ull, size, previous, previous_index, best,
                      best_index);
          sum += best;
          previous = best;
          previous_index = best_index;
        }
        score[q] = sum;
      }
      allowed = 0ull;
      float previous = INFINITY;
      int previous_index = -1;
      for (int j = 0; j < a.top_groups; ++j) {
        float best = -INFINITY;
        int best_index = INT_MAX;
        for (int q = 0; q < a.groups; ++q) {
          if (before(previous, previous_index, score[q], q) && before(score[q], q, best, best_index)) {
            best = score[q];
            best_index = q;
          }
        }
        allowed |= 1ull << best_index;
        previous = best;
        previous_index = best_index;
      }
    }
    const int slot = a.sequences != nullptr ? a.slot[r] : -1;
    float* own = slot >= 0 ? a.sequences + (static_cast<std::int64_t>(slot) * a.layers + l) * width : nullptr;
    float previous = INFINITY;
    int previous_index = -1;
    for (int j = 0; j < a.top_k; ++j) {
      float best;
      int best_index;
      next_routed(z, bias, a.sigmoid, lse, 0, a.experts, allowed, size, previous, previous_index, best, best_index);
      atomicAdd(&a.scope[l * width + best_index], 1.0f);
      if (own != nullptr) atomicAdd(&own[best_index], 1.0f);
      previous = best;
      previous_index = best_index;
    }
    atomicAdd(&a.scope[l * width + a.experts], 1.0f);
    if (own != nullptr) atomicAdd(&own[a.experts], 1.0f);
  }
}

// One (row, layer) of pass 2 with the row in registers, PER values per lane (experts <= 32 PER): one read of the
// logits, one write of the gradient.
template <int PER>
__device__ void grad_in_registers(const RouterGradArgs& a, std::int64_t r, int l, int lane) {
  const std::int64_t offset = (r * a.layers + l) * a.experts;
  const float* z = a.logits + offset;
  const std::int64_t table = (static_cast<std::int64_t>(a.slot[r]) * a.layers + l) * a.experts;
  float x[PER], s[PER];
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < a.experts ? z[e] : -INFINITY;
    max = fmaxf(max, x[i]);
  }
  max = warp_max(max);
  float sum = 0.0f, total = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const bool in = lane + 32 * i < a.experts;
    s[i] = in ? expf(x[i] - max) : 0.0f;
    sum += s[i];
    if (a.sigmoid && in) total += sigmoid(x[i]);
  }
  const float row_sum = warp_sum(sum);
  const float lse = max + logf(row_sum);
  total = warp_sum(total);
  float dot = 0.0f, sequence_dot = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    if (e >= a.experts) continue;
    const float p = s[i] / row_sum;
    s[i] = a.sigmoid ? sigmoid(x[i]) / total : p;
    x[i] = p;  // the softmax probability, for the z-loss
    dot += a.weights[table + e] * s[i];
    sequence_dot += a.sequence_weights[table + e] * s[i];
  }
  dot = warp_sum(dot);
  sequence_dot = warp_sum(sequence_dot);
  const float scale = a.weight[r] * a.all;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    if (e >= a.experts) continue;
    // The weights read again from L1 (kept in registers, they cost more than they save: measured on an H200).
    const float w = a.weights[table + e], ws = a.sequence_weights[table + e];
    // sigmoid's slope 1 - sigma(z) = 1 - q total (q = sigma / total)
    const float slope = a.sigmoid ? 1.0f - s[i] * total : 1.0f;
    const float aux = s[i] * slope * ((w - ws) - (dot - sequence_dot));
    const float sequence_aux = s[i] * slope * (ws - sequence_dot);
    a.grad[offset + e] = scale * (a.aux * (aux + a.sequence_aux * sequence_aux) + 2.0f * a.z_weight * lse * x[i]);
  }
  if (lane == 0) {
    a.terms[2 * (r * a.layers + l)] = dot;
    a.terms[2 * (r * a.layers + l) + 1] = a.z_weight * lse * lse;
  }
}

// Any width: the row read from memory (L1) in each of its passes.
__device__ void grad_in_passes(const RouterGradArgs& a, std::int64_t r, int l, int lane) {
  const std::int64_t offset = (r * a.layers + l) * a.experts;
  const float* z = a.logits + offset;
  const std::int64_t table = (static_cast<std::int64_t>(a.slot[r]) * a.layers + l) * a.experts;
  const float* w = a.weights + table;
  const float* ws = a.sequence_weights + table;
  float max = -INFINITY;
  for (int e = lane; e < a.experts; e += 32) max = fmaxf(max, z[e]);
  max = warp_max(max);
  float sum = 0.0f, total = 0.0f;
  for (int e = lane; e < a.experts; e += 32) {
    sum += expf(z[e] - max);
    if (a.sigmoid) total += sigmoid(z[e]);
  }
  const float lse = max + logf(warp_sum(sum));
  total = warp_sum(total);
  auto score = [&](float x) { return a.sigmoid ? sigmoid(x) / total : expf(x - lse); };
  float dot = 0.0f, sequence_dot = 0.0f;
  for (int e = lane; e < a.experts; e += 32) {
    const float s = score(z[e]);
    dot += w[e] * s;
    sequence_dot += ws[e] * s;
  }
  dot = warp_sum(dot);
  sequence_dot = warp_sum(sequence_dot);
  const float scale = a.weight[r] * a.all;
  for (int e = lane; e < a.experts; e += 32) {
    const float s = score(z[e]);
    const float slope = a.sigmoid ? 1.0f - sigmoid(z[e]) : 1.0f;
    const float aux = s * slope * ((w[e] - ws[e]) - (dot - sequence_dot));
    const float sequence_aux = s * slope * (ws[e] - sequence_dot);
    const float z_grad = 2.0f * a.z_weight * lse * expf(z[e] - lse);
    a.grad[offset + e] = scale * (a.aux * (aux + a.sequence_aux * sequence_aux) + z_grad);
  }
  if (lane == 0) {
    a.terms[2 * (r * a.layers + l)] = dot;
    a.terms[2 * (r * a.layers + l) + 1] = a.z_weight * lse * lse;
  }
}

// PER > 0: rows of at most 32 PER experts, in registers; 0: any width.
template <int PER>
__global__ void __launch_bounds__(kThreads) grad_kernel(RouterGradArgs a) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  const std::int64_t items = a.rows * a.layers;
  for (std::int64_t item = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; item < items;
       item += warps) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    if (!a.active[r] || a.slot[r] < 0) continue;  // an active row always lies in one of the micro-batch's sequences
    if constexpr (PER > 0) {
      grad_in_registers<PER>(a, r, l, lane);
    } else {
      grad_in_passes(a, r, l, lane);
    }
  }
}

int persistent_sms() {
  int device = 0;
  cudaGetDevice(&device);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 132;
}

int blocks_for(std::int64_t items) {
  const std::int64_t warps_per_block = kThreads / 32;
  const std::int64_t blocks = (items + warps_per_block - 1) / warps_per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace

void router_route(const RouterRouteArgs& args, void* stream) {
  if (args.rows == 0) return;
  if (args.bias != nullptr) {
    const std::int64_t items = args.rows * args.layers;
    const int blocks = static_cast<int>(std::min<std::int64_t>((items + kThreads - 1) / kThreads, 65535));
    routed_route_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
    LV_CUDA(cudaGetLastError());
    return;
  }
  const std::size_t counts = static_cast<std::size_t>(args.layers) * (static_cast<std::size_t>(args.experts) + 1);
  const bool shared = counts * sizeof(float) <= 32 * 1024;
  // Enough blocks to fill the GPU, each with many rows (its counts leave the block once).
  const int blocks = std::min(blocks_for(args.rows * args.layers), shared ? 8 * persistent_sms() : 65535);
  const std::size_t bytes = shared ? counts * sizeof(float) : 0;
  const auto s = static_cast<cudaStream_t>(stream);
  if (args.experts <= 32 * 2) {
    route_kernel<2><<<blocks, kThreads, bytes, s>>>(args, shared ? 1 : 0);
  } else if (args.experts <= 32 * 8) {
    route_kernel<8><<<blocks, kThreads, bytes, s>>>(args, shared ? 1 : 0);
  } else {
    route_kernel<0><<<blocks, kThreads, bytes, s>>>(args, shared ? 1 : 0);
  }
  LV_CUDA(cudaGetLastError());
}

void router_grad(const RouterGradArgs& args, void* stream) {
  if (args.rows == 0) return;
  const int blocks = blocks_for(args.rows * args.layers);
  const auto s = static_cast<cudaStream_t>(stream);
  if (args.experts <= 32 * 2) {
    grad_kernel<2><<<blocks, kThreads, 0, s>>>(args);
  } else if (args.experts <= 32 * 8) {
    grad_kernel<8><<<blocks, kThreads, 0, s>>>(args);
  } else {
    grad_kernel<0><<<blocks, kThreads, 0, s>>>(args);
  }
  LV_CUDA(cudaGetLastError());
}

}  // namespace lossverify::cuda
