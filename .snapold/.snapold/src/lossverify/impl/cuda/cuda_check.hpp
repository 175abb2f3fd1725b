#pragma once
// CUDA runtime errors as InternalError (exit code 3), naming the call.
#include <cuda_runtime.h>

#include <string>

#include "lossverify/core/errors.hpp"

namespace lossverify::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw InternalError(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace lossverify::cuda

#define LV_CUDA(call) ::lossverify::cuda::check((call), #call)
