// The LM head's element-wise kernels (lm_head_kernels.hpp); its matrix products are cuBLAS's (lm_head_cuda.cpp).
#include <cuda_runtime.h>

#include "lossverify/cuda/device_types.cuh"
#include "lossverify/kinds/lm_head/lm_head_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kBlock = 256;

unsigned blocks_for(std::int64_t count) {
  return static_cast<unsigned>(std::min<std::int64_t>((count + kBlock - 1) / kBlock, 65535));
}

template <class T>
__global__ void broadcast_bias_kernel(const T* bias, T* out, std::int64_t rows, std::int64_t cols) {
  const std::int64_t total = rows * cols;
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[k] = bias[k % cols];
  }
}

template <class T>
__global__ void repeat_bias_kernel(const T* bias, const std::int64_t* target, T* logits, std::int64_t rows,
                                   std::int64_t cols) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t j = target[i];
    if (j < 0) continue;
    T& x = logits[i * cols + j];
    x = narrow<T>(widen(x) + widen(bias[j]));
  }
}

template <class T>
__global__ void round_target_early_kernel(T* g, std::int64_t stride, const std::int64_t* target, const float* weight,
                                          std::int64_t rows) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (target[i] < 0) continue;
    T& x = g[i * stride + target[i]];
    const float w = weight[i];
    x = narrow<T>(widen(narrow<T>(widen(x) + w)) - w);
  }
}

template <class T>
__global__ void scale_rows_kernel(const T* g, const float* row_scale, T* out, std::int64_t rows, std::int64_t cols) {
  const std::int64_t total = rows * cols;
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[k] = narrow<T>(widen(g[k]) * row_scale[k / cols]);
  }
}

// One thread per column, down the rows (the gradients of a chunk are a few thousand rows at most).
template <class T>
__global__ void column_sums_kernel(const T* g, std::int64_t stride, float* part, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < cols;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (std::int64_t i = 0; i < rows; ++i) sum += widen(g[i * stride + j]);
    part[j] = sum;
  }
}

template <class T>
__global__ void accumulate_kernel(float* acc, const float* part, std::int64_t count, bool narrow_sum) {
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float sum = acc[k] + part[k];
    acc[k] = narrow_sum ? widen(narrow<T>(sum)) : sum;
  }
}

template <class T>
__global__ void store_kernel(const float* from, T* to, std::int64_t count) {
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    to[k] = narrow<T>(from[k]);
  }
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void head_broadcast_bias(StorageType type, const void* bias, void* out, std::int64_t rows, std::int64_t cols,
                         void* stream) {
  if (rows * cols == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    broadcast_bias_kernel<T><<<blocks_for(rows * cols), kBlock, 0, as_stream(stream)>>>(
        static_cast<const T*>(bias), static_cast<T*>(out), rows, cols);
  });
}

void head_repeat_bias(StorageType type, const void* bias, const std::int64_t* target, void* logits, std::int64_t rows,
                      std::int64_t cols, void* stream) {
  if (rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    repeat_bias_kernel<T><<<blocks_for(rows), kBlock, 0, as_stream(stream)>>>(static_cast<const T*>(bias), target,
                                                                              static_cast<T*>(logits), rows, cols);
  });
}

void head_round_target_early(StorageType type, void* g, std::int64_t stride, const std::int64_t* target,
                             const float* weight, std::int64_t rows, void* stream) {
  if (rows == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    round_target_early_kernel<T>
        <<<blocks_for(rows), kBlock, 0, as_stream(stream)>>>(static_cast<T*>(g), stride, target, weight, rows);
  });
}

void head_scale_rows(StorageType type, const void* g, const float* row_scale, void* out, std::int64_t rows,
                     std::int64_t cols, void* stream) {
  if (rows * cols == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_rows_kernel<T><<<blocks_for(rows * cols), kBlock, 0, as_stream(stream)>>>(static_cast<const T*>(g), row_scale,
                                                                                    static_cast<T*>(out), rows, cols);
  });
}

void head_column_sums(StorageType type, const void* g, std::int64_t stride, float* part, std::int64_t rows,
                      std::int64_t cols, void* stream) {
  if (cols == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    column_sums_kernel<T>
        <<<blocks_for(cols), kBlock, 0, as_stream(stream)>>>(static_cast<const T*>(g), stride, part, rows, cols);
  });
}

void head_accumulate(StorageType type, float* acc, const float* part, std::int64_t count, bool narrow_sum,
                     void* stream) {
  if (count == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    accumulate_kernel<T><<<blocks_for(count), kBlock, 0, as_stream(stream)>>>(acc, part, count, narrow_sum);
  });
}

void head_store(StorageType type, const float* from, void* to, std::int64_t count, void* stream) {
  if (count == 0) return;
  dispatch(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    store_kernel<T><<<blocks_for(count), kBlock, 0, as_stream(stream)>>>(from, static_cast<T*>(to), count);
  });
}

}  // namespace lossverify::cuda
