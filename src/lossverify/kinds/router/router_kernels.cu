// The router's CUDA kernels: routing and counting (pass 1), the loss terms and the gradient (pass 2), one warp per
// (row, layer) of a grid-stride loop.
#include <cuda_runtime.h>

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

// The larger of (value, index) pairs in the order value descending, index ascending.
__device__ void warp_best(float& value, int& index) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, value, offset);
    const int e = __shfl_xor_sync(0xffffffffu, index, offset);
    if (v > value || (v == value && e < index)) {
      value = v;
      index = e;
    }
  }
}

__global__ void __launch_bounds__(kThreads) route_kernel(RouterRouteArgs a) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  const std::int64_t items = a.rows * a.layers;
  const int width = a.experts + 1;
  for (std::int64_t item = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; item < items;
       item += warps) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    if (!a.counted[r]) continue;
    const float* z = a.logits + (r * a.layers + l) * a.experts;
    const int slot = a.sequences != nullptr ? a.slot[r] : -1;
    float previous = INFINITY;
    int previous_index = -1;
    for (int j = 0; j < a.top_k; ++j) {
      float best = -INFINITY;
      int best_index = INT_MAX;
      for (int e = lane; e < a.experts; e += 32) {
        const float v = z[e];
        const bool after = v < previous || (v == previous && e > previous_index);
        if (after && (v > best || (v == best && e < best_index))) {
          best = v;
          best_index = e;
        }
      }
      warp_best(best, best_index);
      if (lane == 0) {
        atomicAdd(&a.scope[l * width + best_index], 1.0f);
        if (slot >= 0)
          atomicAdd(&a.sequences[(static_cast<std::int64_t>(slot) * a.layers + l) * width + best_index], 1.0f);
      }
      previous = best;
      previous_index = best_index;
    }
    if (lane == 0) {
      atomicAdd(&a.scope[l * width + a.experts], 1.0f);
      if (slot >= 0)
        atomicAdd(&a.sequences[(static_cast<std::int64_t>(slot) * a.layers + l) * width + a.experts], 1.0f);
    }
  }
}

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void __launch_bounds__(kThreads) grad_kernel(RouterGradArgs a) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  const std::int64_t items = a.rows * a.layers;
  for (std::int64_t item = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; item < items;
       item += warps) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    if (!a.active[r] || a.slot[r] < 0) continue;  // an active row always lies in one of the micro-batch's sequences
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
    const float z_term = a.z_weight * lse * lse;
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
      a.terms[2 * (r * a.layers + l) + 1] = z_term;
    }
  }
}

int blocks_for(std::int64_t items) {
  const std::int64_t warps_per_block = kThreads / 32;
  const std::int64_t blocks = (items + warps_per_block - 1) / warps_per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace

void router_route(const RouterRouteArgs& args, void* stream) {
  if (args.rows == 0) return;
  route_kernel<<<blocks_for(args.rows * args.layers), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  LV_CUDA(cudaGetLastError());
}

void router_grad(const RouterGradArgs& args, void* stream) {
  if (args.rows == 0) return;
  grad_kernel<<<blocks_for(args.rows * args.layers), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  LV_CUDA(cudaGetLastError());
}

}  // namespace lossverify::cuda
