// The router's float64 reference kernels (router_oracle_kernels.hpp): one thread per (row, layer), scores recomputed
// from the logits where a loop needs them, compensated sums (Neumaier) in expert order, as the host's definitions
// take them. Compiled without FMA contraction, like the other reference kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/kinds/router/router_oracle_kernels.hpp"
#include "lossverify/oracle/cuda/compensated.cuh"

namespace lossverify::cuda {

namespace {

constexpr int kThreads = 128;

__device__ double sigmoid(double x) { return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }

// A layer's row: the log-sum-exp of its logits and, for sigmoid scores, sum_e sigma(z_e) (router::scores).
struct RowScores {
  const float* z;
  int experts, use_sigmoid;
  double lse = 0.0, total = 1.0;
  __device__ RowScores(const float* z_in, int experts_in, int sigmoid_in)
      : z(z_in), experts(experts_in), use_sigmoid(sigmoid_in) {
    double max = -DBL_MAX;
    for (int e = 0; e < experts; ++e) max = fmax(max, static_cast<double>(z[e]));
    Neumaier sum;
    for (int e = 0; e < experts; ++e) sum.add(exp(static_cast<double>(z[e]) - max));
    lse = max + log(sum.value());
    if (use_sigmoid) {
      Neumaier t;
      for (int e = 0; e < experts; ++e) t.add(sigmoid(z[e]));
      total = t.value();
    }
  }
  __device__ double softmax(int e) const { return exp(static_cast<double>(z[e]) - lse); }
  // s_e: the loss's score.
  __device__ double score(int e) const { return use_sigmoid ? sigmoid(z[e]) / total : softmax(e); }
  // r_e: the routed map's routing score (sigma not normalised).
  __device__ double routing(int e) const { return use_sigmoid ? sigmoid(z[e]) : softmax(e); }
};

// Whether (value, index) comes before (other, other_index): larger first, ties to the lower index.
__device__ bool before(double value, int index, double other, int other_index) {
  return value > other || (value == other && index < other_index);
}

// The key of expert e: the loss's score (plain map) or the routing score plus the bias (routed map).
struct Keys {
  const RowScores& row;
  const double* bias;  // null: the plain map
  __device__ double key(int e) const { return bias == nullptr ? row.score(e) : row.routing(e) + bias[e]; }
  __device__ double magnitude(int e) const {
    return bias == nullptr ? row.score(e) : fabs(row.routing(e)) + fabs(bias[e]);
  }
};

// The best of experts [begin, end) (those of groups in `allowed`, of `size` each) after (previous, previous_index).
__device__ void next_best(const Keys& keys, int begin, int end, unsigned long long allowed, int size, double previous,
                          int previous_index, double& best, int& best_index) {
  best = -DBL_MAX;
  best_index = INT_MAX;
  for (int e = begin; e < end; ++e) {
    if (((allowed >> (e / size)) & 1ull) == 0) continue;
    const double k = keys.key(e);
    if (before(previous, previous_index, k, e) && before(k, e, best, best_index)) {
      best = k;
      best_index = e;
    }
  }
}

__global__ void __launch_bounds__(kThreads) route_kernel(RouterReferenceRouteArgs a) {
  const std::int64_t items = a.rows * a.layers;
  const int size = a.experts / a.groups;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    if (!a.valid[r]) continue;
    const RowScores row(a.logits + item * a.experts, a.experts, a.sigmoid);
    const Keys keys{row, a.routed_map ? a.bias + static_cast<std::int64_t>(l) * a.experts : nullptr};
    double* margins = a.margins + item * 4;
    margins[2] = INFINITY;
    margins[3] = 0.0;
    unsigned long long allowed = ~0ull;
    int candidates = a.experts;
    if (a.routed_map && a.groups > 1) {
      double score[64], scale[64];
      const int best_keys = a.router_k / a.top_groups;
      for (int q = 0; q < a.groups; ++q) {
        double previous = DBL_MAX;
        int previous_index = -1;
        score[q] = 0.0;
        scale[q] = 0.0;
        for (int j = 0; j < best_keys; ++j) {
          double best;
          int best_index;
          next_best(keys, q * size, (q + 1) * size, ~0ull, size, previous, previous_index, best, best_index);
          score[q] += best;
          scale[q] += keys.magnitude(best_index);
          previous = best;
          previous_index = best_index;
        }
      }
      allowed = 0ull;
      double previous = DBL_MAX;
      int previous_index = -1;
      for (int j = 0; j <= a.top_groups && j < a.groups; ++j) {
        double best = -DBL_MAX;
        int best_index = INT_MAX;
        for (int q = 0; q < a.groups; ++q) {
          if (before(previous, previous_index, score[q], q) && before(score[q], q, best, best_index)) {
            best = score[q];
            best_index = q;
          }
        }
        if (j == a.top_groups) {  // the next group: the selection's margin
          margins[2] = score[previous_index] - best;
          margins[3] = fmax(scale[previous_index], scale[best_index]);
          break;
        }
        allowed |= 1ull << best_index;
        previous = best;
        previous_index = best_index;
      }
      candidates = a.top_groups * size;
    }
    int* out = a.experts_out + item * a.take;
    double previous = DBL_MAX;
    int previous_index = -1;
    for (int j = 0; j < a.take; ++j) {
      double best;
      int best_index;
      next_best(keys, 0, a.experts, allowed, size, previous, previous_index, best, best_index);
      out[j] = best_index;
      previous = best;
      previous_index = best_index;
    }
    margins[1] = keys.magnitude(previous_index);
    if (a.take < candidates) {
      double best;
      int best_index;
      next_best(keys, 0, a.experts, allowed, size, previous, previous_index, best, best_index);
      a.next_out[item] = best_index;
      margins[0] = previous - best;
      if (a.routed_map) margins[1] = fmax(margins[1], keys.magnitude(best_index));
    } else {
      a.next_out[item] = -1;
      margins[0] = INFINITY;
    }
  }
}

__global__ void __launch_bounds__(kThreads) rows_kernel(RouterReferenceRowArgs a) {
  const std::int64_t items = a.rows * a.layers;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = item / a.layers;
    const int l = static_cast<int>(item % a.layers);
    const int slot = a.slot[r];
    if (slot < 0) continue;
    const RowScores row(a.logits + item * a.experts, a.experts, a.sigmoid);
    const std::int64_t table = (static_cast<std::int64_t>(slot) * a.layers + l) * a.experts;
    const double* w = a.weights + table;
    const double* tw = a.tie_weights != nullptr ? a.tie_weights + table : nullptr;
    Neumaier inner, tie_inner;
    for (int e = 0; e < a.experts; ++e) {
      const double s = row.score(e);
      inner.add(s * w[e]);
      if (tw != nullptr) tie_inner.add(s * tw[e]);
    }
    const double weight = a.weight[r], z_weight = a.z_weight[r];
    double* expected = a.expected + item * a.experts;
    double* slack = a.slack != nullptr ? a.slack + item * a.experts : nullptr;
    for (int e = 0; e < a.experts; ++e) {
      const double s = row.score(e);
      const double slope = a.sigmoid ? 1.0 - sigmoid(row.z[e]) : 1.0;
      const double aux = s * slope * (w[e] - inner.value());
      const double z = 2.0 * z_weight * row.lse * row.softmax(e);
      expected[e] = weight * (aux + z);
      if (slack != nullptr) slack[e] = tw != nullptr ? fabs(weight) * s * slope * (tw[e] + tie_inner.value()) : 0.0;
    }
    double* terms = a.terms + item * 3;
    terms[0] = inner.value();
    terms[1] = z_weight * row.lse * row.lse;
    terms[2] = tie_inner.value();
  }
}

int blocks_for(std::int64_t items) {
  return static_cast<int>(std::min<std::int64_t>(std::max<std::int64_t>((items + kThreads - 1) / kThreads, 1), 65535));
}

}  // namespace

void router_reference_route(const RouterReferenceRouteArgs& args, void* stream) {
  if (args.rows == 0) return;
  route_kernel<<<blocks_for(args.rows * args.layers), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  LV_CUDA(cudaGetLastError());
}

void router_reference_rows(const RouterReferenceRowArgs& args, void* stream) {
  if (args.rows == 0) return;
  rows_kernel<<<blocks_for(args.rows * args.layers), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  LV_CUDA(cudaGetLastError());
}

}  // namespace lossverify::cuda
