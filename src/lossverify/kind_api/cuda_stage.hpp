#pragma once
// A stage's part of the CUDA backend (kind_api/stage.hpp for the stage itself), in terms free of CUDA headers. The
// backend runs a rank's rows chunk by chunk: the stage writes a chunk's logits into the kind's buffer, the kind
// computes their gradient in place of its own, and the stage turns that gradient into its own gradients before the
// next chunk overwrites both buffers. Built-in stages are listed in kinds/cuda_kinds.cpp (CUDA builds only).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "lossverify/cuda/storage.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"

namespace lossverify {
struct Case;
struct BugSwitches;
struct RankAssignment;
struct RankGroups;
struct RankOutput;
class InputSource;
}  // namespace lossverify

namespace lossverify::cuda {

// One rank's stage on its GPU: `logits` and `logit_grad` hold `chunk_rows` rows of `cols` columns (the kind's
// columns, global columns [work_begin, work_begin + cols); the rank's own, assignment.vocab, lie among them), row r of
// a chunk being the rank's row first + r.
struct CudaStageSetup {
  const Case& c;
  const BugSwitches& bugs;
  const InputSource& inputs;
  const RankAssignment& assignment;
  StorageType type;
  std::int64_t work_begin = 0, cols = 0, chunk_rows = 0;
  int tp_ranks = 1;  // the size of the rank's TP group
  // The stage's own chunks of the rank's rows (Stage::chunk_rows), over which it accumulates its parameter gradients:
  // no more than chunk_rows where the kind's rows are independent, a piece of a micro-batch's where they are not.
  std::int64_t accumulate_rows = 0;
  std::byte* logits = nullptr;
  std::byte* logit_grad = nullptr;  // the stage may rewrite it (a fused head forms part of it itself)
  void* stream = nullptr;           // the rank's cudaStream_t
};

class CudaStageRank {
 public:
  virtual ~CudaStageRank() = default;
  // Before the first chunk of each step (a benchmark runs several on one rank): its accumulators start from zero.
  virtual void start_step() = 0;
  // The logits of the rank's rows [first, first + n) (n <= chunk_rows), into the setup's buffer.
  virtual void forward(std::int64_t first, std::int64_t n) = 0;
  // From the kind's gradient of those rows: the stage's gradients of them, its collectives over groups.tp.
  virtual void backward(std::int64_t first, std::int64_t n, RankGroups& groups) = 0;
  // Each of the rank's rows' backward weights (RowPlan::backward_weight), once the rank's plan is made, before the
  // first chunk (StageRank::row_weights on the CPU).
  virtual void row_weights(std::span<const float> weights) { (void)weights; }
  // After the last chunk: the stage's gradients and parameter gradients into `out` (stage_grads, stage_columns,
  // stage_params, in the dtype).
  virtual void finish(RankOutput& out) = 0;
};

using CudaStageFactory = std::unique_ptr<CudaStageRank> (*)(const CudaStageSetup& setup);
// nullptr when the stage has no CUDA implementation.
CudaStageFactory cuda_stage_factory(std::string_view stage_name);

// The GPU oracle of a case with a stage (cuda_kind.hpp's CudaKindOracle: made before the implementation runs, it
// evaluates the stage and the kind behind it on the device); nullptr where the stage has none for the case's kind (or
// the build has no CUDA): the host oracle judges the case.
CudaOracleFactory cuda_stage_oracle_factory(const Case& c);

}  // namespace lossverify::cuda
