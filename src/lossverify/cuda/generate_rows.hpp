#pragma once
// Rows of one of a case's Philox input streams generated on a GPU, normal values in a storage dtype: the LM head's own
// inputs (the implementation and the oracle each generate their own copy, into their own buffers) and the
// benchmarks' random operands.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/storage.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify::cuda {

// Rows `counters` (each its Philox row) of stream `input` of seed `seed`, columns [begin, end), normal(0, scale)
// values in `type`, into `out` (counters.size() x (end - begin) elements); synchronous.
inline void generate_normal_rows(std::uint64_t seed, StorageType type, InputStream input,
                                 const std::vector<std::int64_t>& counters, std::int64_t begin, std::int64_t end,
                                 double scale, void* out, cudaStream_t stream) {
  const std::vector<int> no_padding(counters.size(), 0);
  const DeviceBytes d_counters = upload(counters, stream), d_padding = upload(no_padding, stream);
  const GenerateArgs g{seed,
                       static_cast<int>(input),
                       d_counters.as<std::int64_t>(),
                       d_padding.as<int>(),
                       static_cast<std::int64_t>(counters.size()),
                       begin,
                       end,
                       static_cast<int>(LogitDistribution::normal),
                       0.0,
                       scale,
                       0.0,
                       scale};
  generate_logits(type, g, out, stream);
  LV_CUDA(cudaGetLastError());
  LV_CUDA(cudaStreamSynchronize(stream));  // the counters' buffers go out of scope
}

}  // namespace lossverify::cuda
