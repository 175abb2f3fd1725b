#pragma once
// What the CUDA benchmarks share: a device allocation that frees itself, the median of repeated timings,
// event timing of a launch, and the device-to-device copy that sets the bandwidth ceiling.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/generate_rows.hpp"
#include "lossverify/cuda/shard_inputs.hpp"
#include "lossverify/cuda/storage.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/inputs/philox_stream.hpp"

namespace lossverify::cuda::bench_timing {

struct Buffer {
  void* p = nullptr;
  explicit Buffer(std::size_t bytes) { LV_CUDA(cudaMalloc(&p, bytes)); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// The benchmark's GPU, checked and made current, its properties, and a stream that is destroyed with it.
struct BenchDevice {
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;
  explicit BenchDevice(int device) {
    require_device(device);
    LV_CUDA(cudaSetDevice(device));
    LV_CUDA(cudaGetDeviceProperties(&prop, device));
    LV_CUDA(cudaStreamCreate(&stream));
  }
  ~BenchDevice() { cudaStreamDestroy(stream); }
  BenchDevice(const BenchDevice&) = delete;
  BenchDevice& operator=(const BenchDevice&) = delete;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median time in milliseconds of `launch(i)` on `stream`, with events around each repetition after three
// warm-ups.
template <class F>
double time_ms(int repeats, cudaStream_t stream, F&& launch) {
  cudaEvent_t a, b;
  LV_CUDA(cudaEventCreate(&a));
  LV_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch(i);
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    LV_CUDA(cudaEventRecord(a, stream));
    launch(i);
    LV_CUDA(cudaEventRecord(b, stream));
    LV_CUDA(cudaEventSynchronize(b));
    float ms = 0.0f;
    LV_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
  }
  LV_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(times);
}

// The bandwidth ceiling of the current device in TB/s: a 2 GiB device-to-device copy, bytes read plus
// bytes written.
inline double copy_bandwidth_tb_per_s(int repeats, cudaStream_t stream) {
  const std::size_t copy_bytes = std::size_t{2} << 30;
  Buffer src(copy_bytes), dst(copy_bytes);
  LV_CUDA(cudaMemsetAsync(src.p, 1, copy_bytes, stream));
  const double ms = time_ms(repeats, stream, [&](int) {
    LV_CUDA(cudaMemcpyAsync(dst.p, src.p, copy_bytes, cudaMemcpyDeviceToDevice, stream));
  });
  return 2.0 * static_cast<double>(copy_bytes) / (ms * 1e-3) / 1e12;
}

// rows x cols normal(0, scale) values of Philox seed `seed` (row r from counter r), generated on the device into
// `out`: a benchmark's random operands (never zeros, which hide unwritten outputs and run faster).
inline void fill_normal(void* out, StorageType type, std::int64_t rows, std::int64_t cols, std::uint64_t seed,
                        double scale, cudaStream_t stream) {
  std::vector<std::int64_t> counters(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) counters[static_cast<std::size_t>(i)] = i;
  generate_normal_rows(seed, type, InputStream::student_logits, counters, 0, cols, scale, out, stream);
}

// Two sets of a benchmark's logits, rows x cols of tokens 0..rows-1 from seeds 7 and 8 (scale 2), generated on
// the device: launches alternate between them so that L2 never holds the next launch's input.
struct BenchLogits {
  Buffer set[2];
  BenchLogits(StorageType type, std::int64_t rows, std::int64_t cols, std::size_t element, cudaStream_t stream)
      : set{Buffer(static_cast<std::size_t>(rows * cols) * element),
            Buffer(static_cast<std::size_t>(rows * cols) * element)} {
    for (int k = 0; k < 2; ++k) fill_normal(set[k].p, type, rows, cols, static_cast<std::uint64_t>(7 + k), 2.0, stream);
  }
  void* at(int i) const { return set[i % 2].p; }
};

}  // namespace lossverify::cuda::bench_timing
