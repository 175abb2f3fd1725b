#pragma once
// cuBLAS as the LM head's CUDA files use it (lm_head_cuda.cpp, lm_head_oracle.cpp, lm_head_bench.cpp), loaded at
// its first use (cuda/cublas_library.hpp): a handle on a stream, and its errors as lossverify's.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cublas_library.hpp"

namespace lossverify::cuda {

inline void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw InternalError(std::string("cuBLAS ") + what + ": " + cublas_library().status_string(status));
  }
}

class CublasHandle {
 public:
  explicit CublasHandle(cudaStream_t stream) {
    check_cublas(cublas_library().create(&handle_), "cublasCreate");
    check_cublas(cublas_library().set_stream(handle_, stream), "cublasSetStream");
  }
  ~CublasHandle() { cublas_library().destroy(handle_); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace lossverify::cuda
