#pragma once
// One definition of the per-element math serves the CPU and the CUDA kernels (the CUTLASS idiom).
#if defined(__CUDACC__)
#define LV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LV_HOST_DEVICE inline
#endif
