#include "lossverify/comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"

namespace lossverify::cuda {

namespace {

using Clock = std::chrono::steady_clock;

void nccl_check(ncclResult_t r, const char* what, int world_rank) {
  if (r != ncclSuccess) {
    throw InternalError("rank " + std::to_string(world_rank) + ": NCCL " + what + ": " + ncclGetErrorString(r));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& host, int device, double timeout_seconds)
      : host_(host), device_(device), timeout_seconds_(timeout_seconds) {
    LV_CUDA(cudaSetDevice(device_));
    LV_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    // Rank 0 of the group makes the id; the host group carries it to the others.
    ncclUniqueId id{};
    if (host_.rank() == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", host_.world_rank());
    std::vector<ncclUniqueId> ids(static_cast<std::size_t>(host_.size()));
    host_.all_gather(&id, ids.data(), sizeof(id));
    // Every member has just passed the host all-gather above, so the (blocking) initialisation meets
    // no absent peer; collectives are enqueued and their completion is polled (wait_stream).
    nccl_check(ncclCommInitRank(&comm_, host_.size(), ids[0], host_.rank()), "ncclCommInitRank", host_.world_rank());
  }
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      if (broken_) {
        ncclCommAbort(comm_);
      } else {
        ncclCommDestroy(comm_);
      }
    }
    if (device_buffer_ != nullptr) cudaFree(device_buffer_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  int world_rank() const override { return host_.world_rank(); }
  bool aborted() const override { return host_.aborted(); }

  void all_gather(const void* mine, void* out, std::size_t bytes) override {
    CollectiveTimer timer(collective_seconds_);
    if (bytes == 0) return;
    const std::size_t total = bytes * static_cast<std::size_t>(size());
    reserve(bytes + total);
    std::byte* send = static_cast<std::byte*>(device_buffer_);
    std::byte* receive = send + bytes;
    LV_CUDA(cudaSetDevice(device_));
    LV_CUDA(cudaMemcpyAsync(send, mine, bytes, cudaMemcpyHostToDevice, stream_));
    nccl_check(ncclAllGather(send, receive, bytes, ncclUint8, comm_, stream_), "ncclAllGather", world_rank());
    LV_CUDA(cudaMemcpyAsync(out, receive, total, cudaMemcpyDeviceToHost, stream_));
    wait_stream("ncclAllGather");
  }

  void allreduce(void* data, std::size_t count, ElementType type, ReduceOp op) override {
    if (count == 0) return;
    const std::size_t bytes = count * element_size(type);
    gathered_.resize(bytes * static_cast<std::size_t>(size()));
    all_gather(data, gathered_.data(), bytes);
    std::vector<const void*> inputs(static_cast<std::size_t>(size()));
    for (int r = 0; r < size(); ++r)
      inputs[static_cast<std::size_t>(r)] = gathered_.data() + bytes * static_cast<std::size_t>(r);
    reduce_in_rank_order(inputs.data(), size(), data, 0, count, type, op);
  }

  void barrier() override {
    CollectiveTimer timer(collective_seconds_);
    host_.barrier();
  }
  std::unique_ptr<Communicator> split(int color, int key) override { return host_.split(color, key); }
  void abort(const std::string& reason) override {
    broken_ = true;
    host_.abort(reason);
  }

 private:
  void reserve(std::size_t bytes) {
    if (bytes <= device_bytes_) return;
    LV_CUDA(cudaSetDevice(device_));
    if (device_buffer_ != nullptr) LV_CUDA(cudaFree(device_buffer_));
    device_buffer_ = nullptr;
    LV_CUDA(cudaMalloc(&device_buffer_, bytes));
    device_bytes_ = bytes;
  }

  // Polls instead of blocking: a peer that failed (abort flag) or never arrives (deadline) ends the wait.
  template <class Done>
  void poll(const char* what, Done done) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds_);
    for (;;) {
      if (done()) return;
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess) {
        broken_ = true;
        nccl_check(async, what, world_rank());
      }
      if (host_.aborted()) {
        broken_ = true;
        throw InternalError("rank " + std::to_string(world_rank()) + ": " + what + " abandoned: another rank failed");
      }
      if (Clock::now() > deadline) {
        broken_ = true;
        throw TimeoutError("rank " + std::to_string(world_rank()) + ": " + what + " waited more than " +
                           std::to_string(static_cast<int>(timeout_seconds_)) +
                           " s for the other GPUs of its group (a rank never arrived)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  void wait_stream(const char* what) {
    poll(what, [&] {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaErrorNotReady) return false;
      check(e, what);
      return true;
    });
  }
  Communicator& host_;
  int device_;
  double timeout_seconds_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  void* device_buffer_ = nullptr;
  std::size_t device_bytes_ = 0;
  std::vector<std::byte> gathered_;
  bool broken_ = false;
};

}  // namespace

bool built_with_nccl() { return true; }

std::unique_ptr<Communicator> make_nccl_group(Communicator& host_group, int device, double timeout_seconds) {
  return std::make_unique<NcclCommunicator>(host_group, device, timeout_seconds);
}

}  // namespace lossverify::cuda
