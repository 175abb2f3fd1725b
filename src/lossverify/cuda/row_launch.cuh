#pragma once
// What the loss kinds' row kernels share (cross-entropy, KD): the block size they are bounded by, zeroing a
// row's gradient, and the launch shape of a persistent grid over rows. Included by .cu files only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "lossverify/cuda/device_types.cuh"

namespace lossverify::cuda {

inline constexpr int kThreads = 1024;

template <class T>
__device__ void zero_row(T* grad, std::int64_t cols) {
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) grad[c] = narrow<T>(0.0f);
}

inline int persistent_blocks() {
  int device = 0;
  cudaGetDevice(&device);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 132;
}

// Launch shape of the other row kernels (the fused two-pass kernel, KD's): rows of up to 64 KB get
// 128-thread blocks, sixteen per SM, so many rows are in flight on each SM (measured on the H100 for a TP = 8 shard:
// 256 x 4 gave 79% of the floor, 256 x 8 81%, 128 x 8 85%, 128 x 16 87%, 512 x 2 71%); longer rows get one 1024-thread
// block per SM (the row stays in L2 between the passes).
struct LaunchShape {
  int blocks;
  int threads;
};
// Tuning aid: LOSSVERIFY_SMALL_ROW_LAUNCH / LOSSVERIFY_LARGE_ROW_LAUNCH="threads,blocks_per_sm" override
// the two shapes (bench/NOTES.md records the measured alternatives).
struct RowShape {
  int threads, blocks_per_sm;
  RowShape(const char* variable, int default_threads, int default_blocks)
      : threads(default_threads), blocks_per_sm(default_blocks) {
    if (const char* e = std::getenv(variable)) {
      int t = 0, b = 0;
      if (std::sscanf(e, "%d,%d", &t, &b) == 2 && t >= 32 && t <= kThreads && t % 32 == 0 && b >= 1 && b <= 32) {
        threads = t;
        blocks_per_sm = b;
      }
    }
  }
};
// The two kernels around a TP shard's all-reduce (statistics, then gradient) on rows of any width: 64-thread
// blocks, 32 per SM, so many rows are in flight on each SM and a block's reduction at the end of its row
// hides behind the others' loads (measured on an H200 for N = 16384, V = 128256 bf16 at TP 2, 4 and 8:
// 64x32 93.6%, 87.5% and 84.8% of the floor; 128x16 92.2%, 86.6%, 82.1%; 1024x1 at TP 2 77.1%; 32x32
// 92.5%, 88.3%, 84.7%). Tuning aid: LOSSVERIFY_SHARD_LAUNCH="threads,blocks_per_sm".
template <class T>
LaunchShape shard_launch_shape(std::int64_t rows) {
  static const RowShape shape("LOSSVERIFY_SHARD_LAUNCH", 64, 32);
  const std::int64_t blocks = static_cast<std::int64_t>(persistent_blocks()) * shape.blocks_per_sm;
  return {static_cast<int>(std::min<std::int64_t>(rows, blocks)), shape.threads};
}

template <class T>
LaunchShape launch_shape(std::int64_t rows, std::int64_t cols) {
  static const RowShape small_shape("LOSSVERIFY_SMALL_ROW_LAUNCH", 128, 16);
  static const RowShape large_shape("LOSSVERIFY_LARGE_ROW_LAUNCH", kThreads, 1);
  const bool small = cols * static_cast<std::int64_t>(sizeof(T)) <= 64 * 1024;
  const RowShape& shape = small ? small_shape : large_shape;
  const int threads = shape.threads;
  const std::int64_t blocks = static_cast<std::int64_t>(persistent_blocks()) * shape.blocks_per_sm;
  return {static_cast<int>(std::min<std::int64_t>(rows, blocks)), threads};
}

}  // namespace lossverify::cuda
