// The example CUDA plugin's LM head (include/lossverify/plugin.h, LV_SUPPORTS_LM_HEAD; docs/spec.md §11), in front of
// its cross-entropy (cuda_cross_entropy.cu), in device memory: u = h W_r^T (+ b_r) over the rank's columns, accumulated
// in float32 and stored in the dtype; the kind runs on u as on logits and writes its gradient g of u to outputs->grad;
// then dh = g W_r (summed over TP under the head's contract, the rows of head_dh_row_index kept: a reduce-scatter
// under sequence parallelism), dW_r = sum_t g_t^T h_t and db_r = sum_t g_t, accumulated in float32. One thread per
// output element with a plain loop over its sum: an example of the ABI, not a fast head (lossverify's own CUDA head is
// kinds/lm_head/lm_head_cuda.cpp).
#pragma once

#include <lossverify/plugin.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace {

constexpr int kHeadThreads = 256;

unsigned head_blocks(std::int64_t count) {
  return static_cast<unsigned>(std::min<std::int64_t>((count + kHeadThreads - 1) / kHeadThreads, 65535));
}

// Catalogued head bugs the example carries behind ?bug= (docs/catalogue.md).
struct HeadBugs {
  bool dh_shard_partial = false;  // head-dh-shard-partial (Apple ml-cross-entropy #42): dh never summed over TP
};

bool has_head(const lv_rank_inputs& in) { return in.head_hidden > 0; }

// u[i, v] = sum_k h[i, k] W[v, k] + b[v] for every row that is a token (CP padding stays 0: the kind masks it).
template <class T>
__global__ void head_logits_kernel(const T* h, const T* w, const T* b, const std::int64_t* tokens, std::int64_t rows,
                                   std::int64_t width, std::int64_t hidden, T* u) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < rows * width;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / width, v = e % width;
    if (tokens[i] < 0) {
      u[e] = narrow<T>(0.0f);
      continue;
    }
    float sum = 0.0f;
    for (std::int64_t k = 0; k < hidden; ++k) sum += widen(h[i * hidden + k]) * widen(w[v * hidden + k]);
    u[e] = narrow<T>(sum + widen(b[v]));
  }
}

// dh[i, k] = sum_v g[i, v] W[v, k] in float32.
template <class T>
__global__ void head_dh_kernel(const T* g, const T* w, std::int64_t rows, std::int64_t width, std::int64_t hidden,
                               float* dh) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < rows * hidden;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / hidden, k = e % hidden;
    float sum = 0.0f;
    for (std::int64_t v = 0; v < width; ++v) sum += widen(g[i * width + v]) * widen(w[v * hidden + k]);
    dh[e] = sum;
  }
}

// out[j, k] = dh[index[j], k] in the dtype: the rows the rank returns.
template <class T>
__global__ void head_keep_rows_kernel(const float* dh, const std::int64_t* index, std::int64_t kept,
                                      std::int64_t hidden, T* out) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < kept * hidden;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[e] = narrow<T>(dh[index[e / hidden] * hidden + e % hidden]);
  }
}

// dW[v, k] = sum_i g[i, v] h[i, k] and, from the threads of k = 0, db[v] = sum_i g[i, v], in float32, stored once.
template <class T>
__global__ void head_parameters_kernel(const T* g, const T* h, std::int64_t rows, std::int64_t width,
                                       std::int64_t hidden, T* dw, T* db) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < width * hidden;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t v = e / hidden, k = e % hidden;
    float sum = 0.0f, bias = 0.0f;
    for (std::int64_t i = 0; i < rows; ++i) {
      const float gv = widen(g[i * width + v]);
      sum += gv * widen(h[i * hidden + k]);
      bias += gv;
    }
    dw[e] = narrow<T>(sum);
    if (k == 0 && db != nullptr) db[v] = narrow<T>(bias);
  }
}

// The rank's logits out of its head (device memory, rows x its columns).
template <class T>
DeviceArray<T> head_logits(const lv_rank_inputs& in, const RankStream& stream) {
  if (in.hidden_states == nullptr || in.head_weight == nullptr || in.head_bias_values == nullptr) {
    throw std::invalid_argument("a head without its hidden states, weight or bias");
  }
  const std::int64_t width = in.vocab_end - in.vocab_begin;
  DeviceArray<T> u(static_cast<std::size_t>(in.rows * width));
  head_logits_kernel<T><<<head_blocks(in.rows * width), kHeadThreads, 0, stream.get()>>>(
      static_cast<const T*>(in.hidden_states), static_cast<const T*>(in.head_weight),
      static_cast<const T*>(in.head_bias_values), in.tokens, in.rows, width, in.head_hidden, u.get());
  stream.finish("head_logits_kernel");
  return u;
}

// From the kind's gradient in outputs->grad: dh (its returned rows), dW_r and db_r into the outputs.
template <class T>
void head_backward(const lv_rank_inputs& in, lv_rank_outputs& out, const HeadBugs& bugs, const RankStream& stream,
                   const Collectives& comm) {
  const std::int64_t width = in.vocab_end - in.vocab_begin, hidden = in.head_hidden;
  const T* g = static_cast<const T*>(out.grad);
  DeviceArray<float> dh(static_cast<std::size_t>(in.rows * hidden));
  head_dh_kernel<T><<<head_blocks(in.rows * hidden), kHeadThreads, 0, stream.get()>>>(
      g, static_cast<const T*>(in.head_weight), in.rows, width, hidden, dh.get());
  stream.finish("head_dh_kernel");
  if (in.head_dh_reduce == LV_HEAD_DH_HEAD && !bugs.dh_shard_partial) {
    stream.allreduce(comm, LV_GROUP_TP, dh.get(), in.rows * hidden, LV_REDUCE_SUM);
  }
  // head_dh_row_index is host memory (lv_rank_inputs says so for every memory kind).
  std::vector<std::int64_t> index(in.head_dh_row_index, in.head_dh_row_index + in.head_dh_rows);
  for (const std::int64_t row : index) {
    if (row < 0 || row >= in.rows) throw std::invalid_argument("head_dh_row_index names a row outside the rank's");
  }
  DeviceArray<std::int64_t> d_index(index.size());
  stream.upload(d_index.get(), index, "cudaMemcpyAsync (head_dh_row_index)");
  head_keep_rows_kernel<T><<<head_blocks(in.head_dh_rows * hidden), kHeadThreads, 0, stream.get()>>>(
      dh.get(), d_index.get(), in.head_dh_rows, hidden, static_cast<T*>(out.head_dh));
  stream.finish("head_keep_rows_kernel");
  out.head_dh_count = in.head_dh_rows * hidden;
  head_parameters_kernel<T><<<head_blocks(width * hidden), kHeadThreads, 0, stream.get()>>>(
      g, static_cast<const T*>(in.hidden_states), in.rows, width, hidden, static_cast<T*>(out.head_dw),
      in.head_bias != 0 ? static_cast<T*>(out.head_db) : nullptr);
  stream.finish("head_parameters_kernel");
  out.head_dw_count = width * hidden;
  out.head_db_count = in.head_bias != 0 ? width : 0;
}

}  // namespace
