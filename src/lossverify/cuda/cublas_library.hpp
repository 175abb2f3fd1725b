#pragma once
// cuBLAS, loaded at its first use rather than linked: the LM head's CUDA files are its only users, and linking it
// (with cublasLt) cost every lossverify process about 26,000 page faults of relocations at start, 0.4 s on a
// 2-core machine, for every check-dump and every CLI run of the tests. The entries keep cuBLAS's own types.
#include <cublas_v2.h>

namespace lossverify::cuda {

// cublasGemmEx as the library exports it (the header adds an inline C++ overload taking a cudaDataType compute type).
using CublasGemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                        const void*, const void*, cudaDataType, int, const void*, cudaDataType, int,
                                        const void*, void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

struct CublasLibrary {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasDgemm_v2) dgemm = nullptr;
  CublasGemmEx gemm_ex = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

// The library, loaded once (thread-safe); InternalError naming the library and the loader's message where it
// cannot be loaded or lacks an entry.
const CublasLibrary& cublas_library();

}  // namespace lossverify::cuda
