#pragma once
// The memory a plugin reads and writes inside its host process (host_main.cpp): host memory is the shared
// region itself; CUDA device memory is a copy of it, in buffers that this file allocates. A device buffer is
// zero-filled and sits between two guards of the run's canary pattern (random per run), so a write before or
// past it is caught. Without CUDA at build time, device memory raises InternalError saying so.
#include <cstddef>
#include <cstdint>

#include "lossverify/plugin.h"

namespace lossverify::plugin_memory {

class Buffer {
 public:
  // `canary`: `canary_bytes` bytes repeated over each guard.
  Buffer(lv_memory memory, std::size_t bytes, const std::uint8_t* canary, std::size_t canary_bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  void upload(const void* host);    // size() bytes from the host
  void download(void* host) const;  // size() bytes to the host
  bool guards_intact() const;

 private:
  lv_memory memory_;
  std::size_t bytes_;
  void* base_ = nullptr;  // the front guard
  void* data_ = nullptr;
  const std::uint8_t* canary_;
  std::size_t canary_bytes_;
};

// Copies between the host and `memory` (plain copies for host memory; cudaMemcpy otherwise, complete on
// return: a copy from pageable memory may return before the data lands, so it is waited for).
void to_host(lv_memory memory, const void* source, void* host, std::size_t bytes);
void from_host(lv_memory memory, const void* host, void* destination, std::size_t bytes);
// Makes `device` the calling thread's CUDA device (device memory only).
void select_device(lv_memory memory, int device);
// Waits until the calling thread's device is idle (device memory only).
void wait_for_device(lv_memory memory);

}  // namespace lossverify::plugin_memory
