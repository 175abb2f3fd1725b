#pragma once
// The head's own inputs (h, W, b) generated on a GPU from the case's Philox streams, as the implementation
// (lm_head_cuda.cpp) and the oracle (lm_head_oracle.cpp) each generate their own copy: the same generator, separate
// buffers, so that neither reads memory the other wrote.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/storage.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify::cuda {

// Rows `counters` (each its Philox row) of stage input `input`, columns [begin, end), normal values of `scale` in
// the dtype `type`, into `out` (counters.size() x (end - begin) elements); synchronous.
inline void generate_head_rows(const Case& c, StorageType type, InputStream input,
                               const std::vector<std::int64_t>& counters, std::int64_t begin, std::int64_t end,
                               double scale, void* out, cudaStream_t stream) {
  const std::vector<int> no_padding(counters.size(), 0);
  const DeviceBytes d_counters = upload(counters, stream), d_padding = upload(no_padding, stream);
  const GenerateArgs g{c.inputs.seed,
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
