#pragma once
// A rank's logits (and KD teacher logits) generated on its GPU from the case's Philox streams, with the
// rows a case writes by hand laid on top from the host. The CUDA backend makes the implementation's
// inputs with it, and the GPU oracle its own copy: two allocations, so that nothing an implementation
// writes can reach what the oracle reads.
#include <cuda_runtime.h>

#include "lossverify/case/case.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::cuda {

inline StorageType storage_of(DType d) {
  return d == DType::fp32 ? StorageType::fp32 : d == DType::bf16 ? StorageType::bf16 : StorageType::fp16;
}

struct ShardInputs {
  DeviceBytes student{0};
  DeviceBytes teacher{0};  // KD only
};

// Columns `columns` of every row of `assignment` (CP padding rows included), enqueued on `stream`. Without
// `student` only a KD teacher's (a stage makes the student's logits).
ShardInputs generate_shard_inputs(const Case& c, const InputSource& inputs, const RankAssignment& assignment,
                                  VocabRange columns, cudaStream_t stream, bool student = true);

}  // namespace lossverify::cuda
