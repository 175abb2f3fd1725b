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

constexpr std::size_t kGuardBytes = 4096;  // a guard on each side of a device buffer

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

Buffer::Buffer(lv_memory memory, std::size_t bytes, const std::uint8_t* canary, std::size_t canary_bytes)
    : memory_(memory), bytes_(bytes), canary_(canary), canary_bytes_(canary_bytes) {
  base_ = allocate(memory, bytes + 2 * kGuardBytes);
  data_ = static_cast<unsigned char*>(base_) + kGuardBytes;
  std::vector<unsigned char> fill(bytes + 2 * kGuardBytes, 0);
  for (std::size_t i = 0; i < kGuardBytes; ++i) {
    fill[i] = canary[i % canary_bytes];
    fill[kGuardBytes + bytes + i] = canary[i % canary_bytes];
  }
  try {
    from_host(memory, fill.data(), base_, fill.size());
  } catch (...) {
    release(memory, base_);
    throw;
  }
}

Buffer::~Buffer() { release(memory_, base_); }

void Buffer::upload(const void* host) { from_host(memory_, host, data_, bytes_); }

void Buffer::download(void* host) const { to_host(memory_, data_, host, bytes_); }

bool Buffer::guards_intact() const {
  std::vector<unsigned char> guard(kGuardBytes);
  for (const std::size_t at : {std::size_t{0}, kGuardBytes + bytes_}) {
    to_host(memory_, static_cast<const unsigned char*>(base_) + at, guard.data(), kGuardBytes);
    for (std::size_t i = 0; i < kGuardBytes; ++i) {
      if (guard[i] != canary_[i % canary_bytes_]) return false;
    }
  }
  return true;
}

}  // namespace lossverify::plugin_memory
