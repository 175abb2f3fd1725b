#pragma once
// A rank's view of its group: the one abstraction behind thread ranks and (later) MPI processes.
// Collectives reduce in rank order, so results are bitwise identical from run to run.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace lossverify {

enum class ElementType { f32, f64, i64 };
enum class ReduceOp { sum, max };

std::size_t element_size(ElementType type);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank of this process in the world group, for messages.
  virtual int world_rank() const = 0;

  // In-place all-reduce of count elements.
  virtual void allreduce(void* data, std::size_t count, ElementType type, ReduceOp op) = 0;
  // Gathers `bytes` bytes from every rank into out (size() * bytes), in rank order.
  virtual void all_gather(const void* mine, void* out, std::size_t bytes) = 0;
  // Gathers `bytes` bytes from every rank into out (size() * bytes) on rank 0 only; out is untouched
  // elsewhere. Backends that can avoid giving every rank a copy (threads: O(size) memory per rank, O(size^2)
  // in all) do; the default gathers everywhere.
  virtual void gather_to_root(const void* mine, void* out, std::size_t bytes);
  virtual void barrier() = 0;
  // Ranks with the same color form a group, ordered by key (then by rank). Collective.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Stops every rank of the world: their pending and future collectives throw.
  virtual void abort(const std::string& reason) = 0;
  // Whether some rank of the world has failed (backends that can tell; others say false). Transports
  // that wait outside this communicator (NCCL) poll it so that a failed rank does not leave them hanging.
  virtual bool aborted() const { return false; }

  // Seconds this rank has spent inside collectives (waiting included).
  double collective_seconds() const { return collective_seconds_; }

  void allreduce_sum(std::span<float> v) { allreduce(v.data(), v.size(), ElementType::f32, ReduceOp::sum); }
  void allreduce_sum(std::span<double> v) { allreduce(v.data(), v.size(), ElementType::f64, ReduceOp::sum); }
  void allreduce_sum(std::span<std::int64_t> v) { allreduce(v.data(), v.size(), ElementType::i64, ReduceOp::sum); }
  void allreduce_max(std::span<float> v) { allreduce(v.data(), v.size(), ElementType::f32, ReduceOp::max); }
  void allreduce_max(std::span<double> v) { allreduce(v.data(), v.size(), ElementType::f64, ReduceOp::max); }
  void allreduce_max(std::span<std::int64_t> v) { allreduce(v.data(), v.size(), ElementType::i64, ReduceOp::max); }

 protected:
  double collective_seconds_ = 0.0;
};

// Times a collective into the communicator's counter.
class CollectiveTimer {
 public:
  explicit CollectiveTimer(double& counter) : counter_(counter), start_(std::chrono::steady_clock::now()) {}
  ~CollectiveTimer() { counter_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  CollectiveTimer(const CollectiveTimer&) = delete;
  CollectiveTimer& operator=(const CollectiveTimer&) = delete;

 private:
  double& counter_;
  std::chrono::steady_clock::time_point start_;
};

// Reduces `ranks` buffers element by element in rank order: out[i] = in[0][i] op in[1][i] op ...
void reduce_in_rank_order(const void* const* inputs, int ranks, void* out, std::size_t begin, std::size_t end,
                          ElementType type, ReduceOp op);

}  // namespace lossverify
