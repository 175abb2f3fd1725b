#pragma once
// One rank's sharded loss on its GPU, in three steps (the CUDA backend runs them once; a benchmark times compute()
// alone, repeatedly): the constructor generates the rank's inputs on the device, makes its buffers, its kind's
// (and stage's) part and its plan; compute() runs its micro-batches; finish() hands the outputs over.
#include <chrono>
#include <memory>
#include <optional>

#include "lossverify/case/case.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"

namespace lossverify::cuda {

struct RowArrays;
class ChunkBackward;
class ChunkBackward;

// Where a stage's chunks spend their time (event timings summed over the chunks of one compute()); where the kind
// says when its gradient is enqueued, the stage's backward runs inside the kind's part.
struct ChunkPartTimes {
  double forward_ms = 0.0, kind_ms = 0.0, backward_ms = 0.0;
};

class CudaRankRun {
 public:
  CudaRankRun(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
              const BugSwitches& bugs, const CudaRankOptions& options);
  ~CudaRankRun();
  CudaRankRun(const CudaRankRun&) = delete;
  CudaRankRun& operator=(const CudaRankRun&) = delete;
  // The micro-batches (behind a stage, chunk by chunk). Enqueued on stream(); the kinds' protocols synchronize it.
  void compute(ChunkPartTimes* times = nullptr);
  RankOutput finish();
  cudaStream_t stream() const { return stream_.get(); }
  // The device bytes the kind's logits and gradient buffers hold (behind a stage: one chunk's each).
  std::size_t logit_buffer_bytes() const { return d_logits_.size() + d_grad_.size(); }
  // One chunk's logits: the logits buffer alone.
  std::size_t chunk_logit_bytes() const { return d_logits_.size(); }

 private:
  const std::chrono::steady_clock::time_point start_;
  const Case& c_;
  const Case kind_case_;  // what the kind's kernels read (kind_case_of)
  RankGroups groups_;
  const CudaRankOptions options_;
  double collectives_before_ = 0.0;
  const int device_;  // made current before the stream (and everything after it) is created on it
  Stream stream_;
  RankOutput out_;
  VocabRange vocab_, work_;
  std::int64_t held_rows_ = 0;
  bool grad_in_place_ = false;  // the kind's gradient written over its logits (one buffer)
  DeviceBytes d_logits_{0}, d_teacher_{0}, d_grad_{0};
  RowWindow window_;
  std::unique_ptr<CudaKindRank> kind_rank_;
  std::unique_ptr<CudaStageRank> stage_rank_;
  std::optional<RankPlan> plan_;
  std::unique_ptr<RowArrays> row_arrays_;
  std::unique_ptr<KindOutputs> kind_outputs_;
  std::unique_ptr<ChunkBackward> chunk_backward_;  // behind a stage: the kind's GradientListener
};

}  // namespace lossverify::cuda
