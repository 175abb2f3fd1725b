#include "lossverify/impl/plugin/plugin_memory.hpp"

#include <cstring>
#include <string>
#include <vector>

#include "lossverify/core/errors.hpp"

#ifdef LOSSVERIFY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace lossverify::plugin_memory {

namespace {

constexpr std::size_t kGuardBytes = 256;
constexpr unsigned char kGuardByte = 0xA5;

#ifdef LOSSVERIFY_HAVE_CUDA
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw InternalError(std::string("plugin memory: CUDA ") + what + ": " + cudaGetErrorString(e));
}
#else
[[noreturn]] void no_cuda() {
  throw InternalError(
      "the plugin declares CUDA device memory, but this build has no CUDA (the CUDA toolkit was not "
      "found at configure time)");
}
#endif

void* allocate(lv_memory memory, std::size_t bytes) {
  if (memory == LV_MEMORY_HOST) return ::operator new(bytes);
#ifdef LOSSVERIFY_HAVE_CUDA
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
#else
  no_cuda();
#endif
}

void release(lv_memory memory, void* p) {
  if (p == nullptr) return;
  if (memory == LV_MEMORY_HOST) {
    ::operator delete(p);
    return;
  }
#ifdef LOSSVERIFY_HAVE_CUDA
  cudaFree(p);
#endif
}

}  // namespace

void to_host(lv_memory memory, const void* source, void* host, std::size_t bytes) {
  if (bytes == 0) return;
  if (memory == LV_MEMORY_HOST) {
    std::memcpy(host, source, bytes);
    return;
  }
#ifdef LOSSVERIFY_HAVE_CUDA
  check(cudaMemcpy(host, source, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (device to host)");
#else
  no_cuda();
#endif
}

void from_host(lv_memory memory, const void* host, void* destination, std::size_t bytes) {
  if (bytes == 0) return;
  if (memory == LV_MEMORY_HOST) {
    std::memcpy(destination, host, bytes);
    return;
  }
#ifdef LOSSVERIFY_HAVE_CUDA
  check(cudaMemcpy(destination, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (host to device)");
  check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize after a copy to the device");
#else
  no_cuda();
#endif
}

void select_device(lv_memory memory, int device) {
  if (memory == LV_MEMORY_HOST) return;
#ifdef LOSSVERIFY_HAVE_CUDA
  check(cudaSetDevice(device), "cudaSetDevice");
#else
  (void)device;
  no_cuda();
#endif
}

void wait_for_device(lv_memory memory) {
  if (memory == LV_MEMORY_HOST) return;
#ifdef LOSSVERIFY_HAVE_CUDA
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the plugin returned");
#else
  no_cuda();
#endif
}

Buffer::Buffer(lv_memory memory, std::size_t bytes) : memory_(memory), bytes_(bytes) {
  data_ = allocate(memory, bytes + kGuardBytes);
  std::vector<unsigned char> fill(bytes + kGuardBytes, 0);
  std::memset(fill.data() + bytes, kGuardByte, kGuardBytes);
  try {
    from_host(memory, fill.data(), data_, fill.size());
  } catch (...) {
    release(memory, data_);
    throw;
  }
}

Buffer::~Buffer() { release(memory_, data_); }

void Buffer::upload(const void* host) { from_host(memory_, host, data_, bytes_); }

void Buffer::download(void* host) const { to_host(memory_, data_, host, bytes_); }

bool Buffer::guard_intact() const {
  unsigned char guard[kGuardBytes];
  to_host(memory_, static_cast<const unsigned char*>(data_) + bytes_, guard, kGuardBytes);
  for (unsigned char b : guard) {
    if (b != kGuardByte) return false;
  }
  return true;
}

}  // namespace lossverify::plugin_memory
