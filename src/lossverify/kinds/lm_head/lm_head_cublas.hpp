#pragma once
// cuBLAS as the LM head's CUDA files use it (lm_head_cuda.cpp, lm_head_oracle.cpp): a handle on a stream, and its
// errors as lossverify's.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "lossverify/core/errors.hpp"

namespace lossverify::cuda {

inline void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw InternalError(std::string("cuBLAS ") + what + ": " + cublasGetStatusString(status));
  }
}

class CublasHandle {
 public:
  explicit CublasHandle(cudaStream_t stream) {
    check_cublas(cublasCreate(&handle_), "cublasCreate");
    check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  }
  ~CublasHandle() { cublasDestroy(handle_); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace lossverify::cuda
