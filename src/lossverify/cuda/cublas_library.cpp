#include "lossverify/cuda/cublas_library.hpp"

#include <dlfcn.h>

#include <string>

#include "lossverify/core/errors.hpp"

namespace lossverify::cuda {

namespace {

// The soname of the cuBLAS the headers belong to; then the same file in the toolkit's library folder, for a
// process whose search path does not hold it.
void* open_cublas(std::string& tried) {
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) tried = soname + " (" + dlerror() + ")";
#ifdef LOSSVERIFY_CUBLAS_DIR
  if (handle == nullptr) {
    const std::string path = std::string(LOSSVERIFY_CUBLAS_DIR) + "/" + soname;
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) tried += ", " + path + " (" + dlerror() + ")";
  }
#endif
  return handle;
}

template <class F>
void bind(void* library, const char* name, F& entry) {
  entry = reinterpret_cast<F>(dlsym(library, name));
  if (entry == nullptr) throw InternalError(std::string("cuBLAS: the library lacks ") + name);
}

CublasLibrary load() {
  std::string tried;
  void* library = open_cublas(tried);
  if (library == nullptr) throw InternalError("cuBLAS could not be loaded (the LM head on CUDA needs it): " + tried);
  CublasLibrary l;
  bind(library, "cublasCreate_v2", l.create);
  bind(library, "cublasDestroy_v2", l.destroy);
  bind(library, "cublasSetStream_v2", l.set_stream);
  bind(library, "cublasDgemm_v2", l.dgemm);
  bind(library, "cublasGemmEx", l.gemm_ex);
  bind(library, "cublasGetStatusString", l.status_string);
  return l;  // the library stays loaded for the process's life
}

}  // namespace

const CublasLibrary& cublas_library() {
  static const CublasLibrary library = load();
  return library;
}

}  // namespace lossverify::cuda
