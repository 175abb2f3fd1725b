#pragma once
// Plain-data interface between the LM head's CUDA rank (lm_head_cuda.cpp) and its element-wise kernels
// (lm_head_kernels.cu, compiled by nvcc); the matrix products are cuBLAS's. Nothing here includes CUDA headers.
#include <cstdint>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

// Every row of `out` (rows x cols, the dtype) set to `bias` (cols, the dtype): the product then adds onto it.
void head_broadcast_bias(StorageType type, const void* bias, void* out, std::int64_t rows, std::int64_t cols,
                         void* stream);

// head-bias-repeated: the row's bias added once more to its target logit (target[i] < 0: not in the shard).
void head_repeat_bias(StorageType type, const void* bias, const std::int64_t* target, void* logits, std::int64_t rows,
                      std::int64_t cols, void* stream);

// head-target-rounded-early: the true class's entry of each row (target[i] among the row's `stride` columns, < 0: not
// in the shard) formed as a fused head forms it, g_y = (w p_y rounded to the dtype) - w, w = weight[i], from the
// kind's g_y = w (p_y - 1).
void head_round_target_early(StorageType type, void* g, std::int64_t stride, const std::int64_t* target,
                             const float* weight, std::int64_t rows, void* stream);

// out = g with each row scaled by row_scale (head-grad-output-first), rounded to the dtype.
void head_scale_rows(StorageType type, const void* g, const float* row_scale, void* out, std::int64_t rows,
                     std::int64_t cols, void* stream);

// part[j] = sum over rows of g[i * stride + j], j < cols, in float32.
void head_column_sums(StorageType type, const void* g, std::int64_t stride, float* part, std::int64_t rows,
                      std::int64_t cols, void* stream);

// acc[j] += part[j] in float32; `narrow`: the sum rounded to the dtype (head-dw-16bit-accumulate).
void head_accumulate(StorageType type, float* acc, const float* part, std::int64_t count, bool narrow, void* stream);

// to[j] = from[j] rounded to the dtype.
void head_store(StorageType type, const float* from, void* to, std::int64_t count, void* stream);

}  // namespace lossverify::cuda
