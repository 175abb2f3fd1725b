#include "lossverify/comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <compare>
#include <exception>
#include <map>
#include <mutex>
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

// What one member of a group keeps between runs: its NCCL communicator, the stream its collectives run
// on, and the device buffer they stage through. Torn down with ncclCommAbort, which is local: endpoints
// are released one after another from one thread, and those of a failed run may have absent peers.
struct Endpoint {
  int device = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* buffer = nullptr;
  std::size_t buffer_bytes = 0;

  explicit Endpoint(int d) : device(d) {}
  ~Endpoint() {
    cudaSetDevice(device);
    if (comm != nullptr) ncclCommAbort(comm);
    if (buffer != nullptr) cudaFree(buffer);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
};

// A member's endpoint is found again by its group's role, the members' devices in group order, and its
// own place in the group.
struct EndpointKey {
  int role = 0;
  std::vector<int> devices;
  int group_rank = 0;
  auto operator<=>(const EndpointKey&) const = default;
};

class EndpointCache {
 public:
  std::unique_ptr<Endpoint> take(const EndpointKey& key) {
    std::lock_guard lock(mutex_);
    const auto it = idle_.find(key);
    if (it == idle_.end()) return nullptr;
    std::unique_ptr<Endpoint> endpoint = std::move(it->second);
    idle_.erase(it);
    return endpoint;
  }
  void keep(const EndpointKey& key, std::unique_ptr<Endpoint> endpoint) {
    std::unique_ptr<Endpoint> displaced;  // torn down outside the lock
    std::lock_guard lock(mutex_);
    auto& slot = idle_[key];
    displaced = std::move(slot);
    slot = std::move(endpoint);
  }
  void release_all() {
    std::map<EndpointKey, std::unique_ptr<Endpoint>> gone;
    {
      std::lock_guard lock(mutex_);
      gone.swap(idle_);
    }
  }
  void count_created() { ++created_; }
  std::int64_t created() const { return created_.load(); }
  std::int64_t kept() {
    std::lock_guard lock(mutex_);
    return static_cast<std::int64_t>(idle_.size());
  }

 private:
  std::mutex mutex_;
  std::map<EndpointKey, std::unique_ptr<Endpoint>> idle_;
  std::atomic<std::int64_t> created_{0};
};

EndpointCache& endpoint_cache() {
  static EndpointCache* cache = new EndpointCache();  // never destroyed: endpoints are released explicitly
  return *cache;
}

// Collective over `host`: a new endpoint for every member (rank 0 makes the id, the host group carries it).
std::unique_ptr<Endpoint> create_endpoint(Communicator& host, int device) {
  auto endpoint = std::make_unique<Endpoint>(device);
  LV_CUDA(cudaSetDevice(device));
  LV_CUDA(cudaStreamCreateWithFlags(&endpoint->stream, cudaStreamNonBlocking));
  ncclUniqueId id{};
  if (host.rank() == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", host.world_rank());
  std::vector<ncclUniqueId> ids(static_cast<std::size_t>(host.size()));
  host.all_gather(&id, ids.data(), sizeof(id));
  // Every member has just passed the host all-gather above, so the (blocking) initialisation meets
  // no absent peer; collectives are enqueued and their completion is polled (wait_stream).
  nccl_check(ncclCommInitRank(&endpoint->comm, host.size(), ids[0], host.rank()), "ncclCommInitRank",
             host.world_rank());
  endpoint_cache().count_created();
  return endpoint;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& host, std::unique_ptr<Endpoint> endpoint, EndpointKey key, double timeout_seconds)
      : host_(host),
        endpoint_(std::move(endpoint)),
        key_(std::move(key)),
        timeout_seconds_(timeout_seconds),
        exceptions_at_start_(std::uncaught_exceptions()) {}
  ~NcclCommunicator() override {
    // Kept only after a clean run: no collective broke, this rank is not unwinding an error, no rank of
    // the world failed, and nothing is left on the stream. Anything else is aborted with the endpoint.
    const bool unwinding = std::uncaught_exceptions() > exceptions_at_start_;
    if (endpoint_ == nullptr || broken_ || unwinding || host_.aborted()) return;
    if (cudaSetDevice(endpoint_->device) != cudaSuccess || cudaStreamQuery(endpoint_->stream) != cudaSuccess) return;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(endpoint_->comm, &async) != ncclSuccess || async != ncclSuccess) return;
    endpoint_cache().keep(key_, std::move(endpoint_));
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
    if (endpoint_ == nullptr) {
      throw InternalError("rank " + std::to_string(world_rank()) + ": NCCL group used after an earlier failure");
    }
    const std::size_t total = bytes * static_cast<std::size_t>(size());
    reserve(bytes + total);
    std::byte* send = static_cast<std::byte*>(endpoint_->buffer);
    std::byte* receive = send + bytes;
    // Every member first meets the others on the host: an NCCL kernel is launched only once the whole group
    // has arrived, so a rank that fails before a collective never leaves its peers' kernels spinning on the
    // GPU (which ncclCommAbort does not reliably release in this process). Only a rank that dies between
    // the barrier and its enqueue can, and that ends the process.
    host_.barrier();
    LV_CUDA(cudaSetDevice(endpoint_->device));
    LV_CUDA(cudaMemcpyAsync(send, mine, bytes, cudaMemcpyHostToDevice, endpoint_->stream));
    nccl_check(ncclAllGather(send, receive, bytes, ncclUint8, endpoint_->comm, endpoint_->stream), "ncclAllGather",
               world_rank());
    LV_CUDA(cudaMemcpyAsync(out, receive, total, cudaMemcpyDeviceToHost, endpoint_->stream));
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
    if (bytes <= endpoint_->buffer_bytes) return;
    LV_CUDA(cudaSetDevice(endpoint_->device));
    if (endpoint_->buffer != nullptr) LV_CUDA(cudaFree(endpoint_->buffer));
    endpoint_->buffer = nullptr;
    endpoint_->buffer_bytes = 0;
    LV_CUDA(cudaMalloc(&endpoint_->buffer, bytes));
    endpoint_->buffer_bytes = bytes;
  }

  // Polls instead of blocking: a peer that failed (abort flag) or never arrives (deadline) ends the wait.
  template <class Done>
  void poll(const char* what, Done done) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds_);
    for (;;) {
      if (done()) return;
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(endpoint_->comm, &async);
      if (async != ncclSuccess) {
        abandon();
        nccl_check(async, what, world_rank());
      }
      if (host_.aborted()) {
        abandon();
        throw InternalError("rank " + std::to_string(world_rank()) + ": " + what + " abandoned: another rank failed");
      }
      if (Clock::now() > deadline) {
        abandon();
        throw TimeoutError("rank " + std::to_string(world_rank()) + ": " + what + " waited more than " +
                           std::to_string(static_cast<int>(timeout_seconds_)) +
                           " s for the other GPUs of its group (a rank never arrived)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  void wait_stream(const char* what) {
    poll(what, [&] {
      const cudaError_t e = cudaStreamQuery(endpoint_->stream);
      if (e == cudaErrorNotReady) return false;
      if (e != cudaSuccess) abandon();
      check(e, what);
      return true;
    });
  }

  // A collective that will not complete: its NCCL kernel may be spinning on the GPU, waiting for a peer that
  // failed, and any device-wide synchronisation (a cudaFree while the error unwinds) would wait for it too.
  // The endpoint is aborted here, before the error is thrown: ncclCommAbort stops the kernel.
  void abandon() {
    broken_ = true;
    endpoint_.reset();
  }

  Communicator& host_;
  std::unique_ptr<Endpoint> endpoint_;
  EndpointKey key_;
  double timeout_seconds_;
  int exceptions_at_start_;
  std::vector<std::byte> gathered_;
  bool broken_ = false;
};

}  // namespace

bool built_with_nccl() { return true; }

std::unique_ptr<Communicator> make_nccl_group(Communicator& host_group, int device, double timeout_seconds,
                                              NcclRole role) {
  EndpointKey key;
  key.role = static_cast<int>(role);
  key.group_rank = host_group.rank();
  key.devices.resize(static_cast<std::size_t>(host_group.size()));
  host_group.all_gather(&device, key.devices.data(), sizeof(int));
  std::unique_ptr<Endpoint> endpoint = endpoint_cache().take(key);
  // Reused only when every member holds its endpoint of the same group: one that a failed run aborted
  // on some member makes them all start afresh (the others abort theirs, which is local).
  const int held = endpoint != nullptr ? 1 : 0;
  std::vector<int> all_held(static_cast<std::size_t>(host_group.size()));
  host_group.all_gather(&held, all_held.data(), sizeof(int));
  bool everyone = true;
  for (const int h : all_held) everyone = everyone && h == 1;
  if (!everyone) {
    endpoint.reset();
    endpoint = create_endpoint(host_group, device);
  }
  return std::make_unique<NcclCommunicator>(host_group, std::move(endpoint), std::move(key), timeout_seconds);
}

std::int64_t nccl_endpoints_created() { return endpoint_cache().created(); }

std::int64_t nccl_endpoints_kept() { return endpoint_cache().kept(); }

void release_nccl_endpoints() { endpoint_cache().release_all(); }

}  // namespace lossverify::cuda
