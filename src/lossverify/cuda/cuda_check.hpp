#pragma once
// CUDA runtime errors as InternalError (exit code 3), naming the call.
#include <cuda_runtime.h>

#include <string>

#include "lossverify/core/errors.hpp"

namespace lossverify::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw InternalError(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Loads a kernel's code on the current device now (CUDA's lazy loading loads it at its first launch
// otherwise): reading its attributes needs the code. A failure is left for the launch to report.
inline void load_kernel_code(const void* kernel) {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) cudaGetLastError();
}

}  // namespace lossverify::cuda

#define LV_CUDA(call) ::lossverify::cuda::check((call), #call)
