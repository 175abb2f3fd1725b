#pragma once
// Host-side owners of device resources (the cuCollections idiom: owners here, plain pointers in kernels).
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

// Owning allocation made by Alloc and released by Free (the cuCollections idiom: owners here, plain
// pointers in the kernels): DeviceBytes on the device, PinnedBytes page-locked on the host (fast,
// asynchronous copies to and from the device).
template <cudaError_t (*Alloc)(void**, std::size_t), cudaError_t (*Free)(void*)>
class OwnedBytes {
 public:
  explicit OwnedBytes(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) LV_CUDA(Alloc(&ptr_, bytes_));
  }
  ~OwnedBytes() {
    if (ptr_ != nullptr) Free(ptr_);
  }
  OwnedBytes(const OwnedBytes&) = delete;
  OwnedBytes& operator=(const OwnedBytes&) = delete;
  OwnedBytes(OwnedBytes&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  OwnedBytes& operator=(OwnedBytes&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};
inline cudaError_t allocate_device(void** p, std::size_t bytes) { return cudaMalloc(p, bytes); }
inline cudaError_t allocate_pinned(void** p, std::size_t bytes) { return cudaMallocHost(p, bytes); }
inline cudaError_t free_device(void* p) { return cudaFree(p); }
inline cudaError_t free_pinned(void* p) { return cudaFreeHost(p); }
using DeviceBytes = OwnedBytes<allocate_device, free_device>;
using PinnedBytes = OwnedBytes<allocate_pinned, free_pinned>;

template <class T>
DeviceBytes upload(const T* host, std::size_t count, cudaStream_t stream) {
  DeviceBytes d(count * sizeof(T));
  if (count > 0) LV_CUDA(cudaMemcpyAsync(d.as<void>(), host, d.size(), cudaMemcpyHostToDevice, stream));
  return d;
}
template <class T>
DeviceBytes upload(const std::vector<T>& host, cudaStream_t stream) {
  return upload(host.data(), host.size(), stream);
}
// The first `count` elements of a device allocation, on the host once the stream has finished with them.
template <class T>
std::vector<T> download(const DeviceBytes& d, std::size_t count, cudaStream_t stream) {
  if (count * sizeof(T) > d.size()) throw InternalError("download: more than the allocation holds");
  std::vector<T> host(count);
  if (count > 0) LV_CUDA(cudaMemcpyAsync(host.data(), d.as<void>(), count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  LV_CUDA(cudaStreamSynchronize(stream));
  return host;
}

// Into an allocation of at least the vector's size.
template <class T>
void copy_to_device(const DeviceBytes& d, const std::vector<T>& host, cudaStream_t stream) {
  if (host.size() * sizeof(T) > d.size()) throw InternalError("copy_to_device: the allocation is too small");
  if (!host.empty())
    LV_CUDA(cudaMemcpyAsync(d.as<void>(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
}

class Stream {
 public:
  Stream() { LV_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void sync() const { LV_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_{};
};

class Event {
 public:
  Event() { LV_CUDA(cudaEventCreate(&event_)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) const { LV_CUDA(cudaEventRecord(event_, stream)); }

 private:
  cudaEvent_t event_{};
};

// A rank's output left on its GPU after the kernel: the gradient it wrote, never copied to the host. The GPU
// oracle reads it (read-only) next to its own copy of the inputs (gpu_reference.hpp).
struct DeviceShard {
  int device = 0;
  StorageType type = StorageType::fp32;
  std::int64_t rows = 0, cols = 0, begin = 0;
  DeviceBytes grad{0};
};

}  // namespace lossverify::cuda
