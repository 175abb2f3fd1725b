#pragma once
// Storage types of the CUDA kernels: widening to float, narrowing with round-to-nearest-even, and the
// dispatch from StorageType to the element type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

template <class T>
__device__ __forceinline__ float widen(T x);
template <>
__device__ __forceinline__ float widen<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float widen<__half>(__half x) {
  return __half2float(x);
}
template <class T>
__device__ __forceinline__ T narrow(float x);
template <>
__device__ __forceinline__ float narrow<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half narrow<__half>(float x) {
  return __float2half_rn(x);
}

template <class F>
void dispatch(StorageType type, F&& f) {
  switch (type) {
    case StorageType::fp32:
      f(static_cast<float*>(nullptr));
      break;
    case StorageType::bf16:
      f(static_cast<__nv_bfloat16*>(nullptr));
      break;
    case StorageType::fp16:
      f(static_cast<__half*>(nullptr));
      break;
  }
}

}  // namespace lossverify::cuda
