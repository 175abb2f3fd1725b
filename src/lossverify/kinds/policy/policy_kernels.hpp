#pragma once
// The policy kind's CUDA kernels, in terms free of CUDA headers (policy_kernels.cu): each row's local
// statistics (PolicyLocalStats), and the gradient from per-row coefficients (PolicyGradRow).
#include <cstdint>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

struct PolicyKernelArgs {
  const void* logits = nullptr;  // rows x cols in the storage type
  void* grad = nullptr;          // rows x cols
  std::int64_t rows = 0, cols = 0;
  const int* active = nullptr;           // per row
  const std::int64_t* target = nullptr;  // per row: the label's local column, -1 where the shard holds none
  float inverse_temperature = 1.0f;
  int round_scaled = 0;   // x / T rounded to the storage type (rl-logprob-16bit, rl-temperature-16bit)
  int grad_rounding = 0;  // the gradient's PolicyGradRounding (policy_protocol.hpp)
};

// PolicyLocalStats::kFloats floats per row into `stats` (device memory); inactive rows get zeros.
void policy_local_stats(StorageType type, const PolicyKernelArgs& args, float* stats, void* stream);
// The gradient of every active row from PolicyGradRow::kFloats floats per row (device memory); inactive
// rows get zeros.
void policy_gradient(StorageType type, const PolicyKernelArgs& args, const float* rows, void* stream);

}  // namespace lossverify::cuda
