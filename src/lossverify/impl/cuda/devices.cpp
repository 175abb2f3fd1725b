// The CUDA devices the host sees: their count, and whether one is usable (with the reason when not).
#include "lossverify/impl/cuda/devices.hpp"

#include <cuda_runtime.h>

#include <cstdio>

namespace lossverify::cuda {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

bool device_available(int device, char* reason, int reason_size) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    const bool absent = e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice;
    std::snprintf(reason, static_cast<std::size_t>(reason_size), "%s(cudaGetDeviceCount: %s)",
                  absent ? "no NVIDIA driver or GPU on this machine " : "", cudaGetErrorString(e));
    return false;
  }
  if (device >= count) {
    std::snprintf(reason, static_cast<std::size_t>(reason_size), "device %d requested, %d present", device, count);
    return false;
  }
  return true;
}

}  // namespace lossverify::cuda
