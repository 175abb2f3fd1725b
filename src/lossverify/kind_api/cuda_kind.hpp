#pragma once
// A loss kind's part of the CUDA backend (impl/cuda/cuda_backend.cpp), in terms free of CUDA headers. The
// backend generates a rank's inputs on its GPU, plans its rows and hands each micro-batch to the kind's
// CudaKindRank; the kind launches its kernels and runs its collective protocol. Built-in kinds are listed
// in kinds/cuda_kinds.cpp (CUDA builds only); a kind without an entry runs on the CPU backend only.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "lossverify/cuda/storage.hpp"

namespace lossverify {
struct Case;
struct BugSwitches;
class RankPlan;
struct RankGroups;
struct RankAssignment;
struct RankOutput;
struct GradJudgement;
class InputSource;
class Oracle;
}  // namespace lossverify

namespace lossverify::cuda {

// Which of the rank's rows the kind's logits and gradient buffers hold: from row `first` on (0 and every row without
// a stage; behind a stage, the chunk the stage has just made, kind_api/cuda_stage.hpp).
struct RowWindow {
  std::int64_t first = 0;
};

// Told when a micro-batch's gradient is enqueued (a stage then enqueues its own work on it, which runs while the kind
// finishes on the host); a kind that never tells has its stage's work enqueued after micro_batch returns.
class GradientListener {
 public:
  virtual ~GradientListener() = default;
  virtual void gradient_enqueued() = 0;
};

// One rank's device buffers, as the backend made them.
struct CudaRankSetup {
  const Case& c;
  const BugSwitches& bugs;
  StorageType type;
  std::size_t element = 0;          // bytes per logit
  std::int64_t rows = 0, cols = 0;  // the kernel's rows and columns (kernel_columns)
  std::int64_t owner_base = 0;      // global column of the kernel's first column, as its labels see it
  std::byte* logits = nullptr;      // rows x cols (writable: a bug may overwrite them); see row_offset
  const std::byte* teacher = nullptr;
  std::byte* grad = nullptr;                   // rows x cols
  bool whole_rows = false;                     // a TP group of one
  bool preload = true;                         // load the kernels' code now rather than at their first launch
  void* stream = nullptr;                      // the rank's cudaStream_t
  const RankAssignment* assignment = nullptr;  // the rank's rows and micro-batches
  const RowWindow* window = nullptr;           // logits and grad hold the window's rows (null: rows 0 on)
  GradientListener* listener = nullptr;        // behind a stage: told when the gradient is enqueued
  // The byte offset of the rank's row `row` in logits and grad (the teacher's rows are always the rank's own).
  // The kind's call once a micro-batch's gradient is enqueued on the stream and before it waits on the host for work
  // enqueued after it (a second call is ignored).
  void gradient_enqueued() const {
    if (listener != nullptr) listener->gradient_enqueued();
  }
  std::size_t row_offset(std::int64_t row) const {
    return static_cast<std::size_t>((row - (window != nullptr ? window->first : 0)) * cols) * element;
  }
};

// Per-row arrays from the rank plan, on the host and the device (the micro-batch's slice is at row b).
struct CudaRows {
  const std::int64_t* target = nullptr;  // the label's column among the kernel's, -1 where not there
  const int* active = nullptr;
  const int* valid = nullptr;
  const float* weight = nullptr;  // backward weight
  const std::int64_t* host_target = nullptr;
  const int* host_active = nullptr;
};

// What a micro-batch writes for the rank's rows (RankOutput's fields of the same names).
struct KindOutputs {
  std::vector<float>& token_loss;
  std::vector<float>& logged_token_loss;  // where the plan separates it (KindRowPlan::separate_logged_loss)
  std::vector<float>& token_values;       // rows x the kind's token_quantities()
  std::vector<double>& logged_stats;      // the kind's logged_statistics(): this rank's share
  std::vector<double>& scope_values;      // GA x the kind's scope_values_width() (LossKind::scope_values_name)
};

class CudaKindRank {
 public:
  virtual ~CudaKindRank() = default;
  // Rows [b, b + n) of the rank: kernels, the protocol's collectives over groups.tp, out.token_loss[b + i]. Called
  // for every micro-batch in order; one without rows is skipped for a kind that splits columns (its TP peers hold
  // the same rows), not for one whose rows are whole (its peers may hold rows and reach its collectives).
  virtual void micro_batch(const RankPlan& plan, RankGroups& groups, const CudaRows& rows, std::int64_t b,
                           std::int64_t n, KindOutputs& out) = 0;
};

// Made while the rank's inputs are generated: it loads its kernels' code and allocates its buffers then.
using CudaKindFactory = std::unique_ptr<CudaKindRank> (*)(const CudaRankSetup& setup);

// nullptr when the kind has no CUDA implementation.
CudaKindFactory cuda_kind_factory(std::string_view kind_name);

// A kind's own GPU oracle, for a kind whose reference the generic row models (DeviceRowModel) cannot evaluate: a
// router's needs the routing of the whole step before any row. Made before the implementation runs, it generates and
// owns its inputs on `device` and starts its first pass; judge() is called once the rank's outputs exist (its
// gradient on the device).
class CudaKindOracle {
 public:
  virtual ~CudaKindOracle() = default;
  virtual std::unique_ptr<Oracle> judge(const RankOutput& out, const GradJudgement& judgement) = 0;
};
using CudaOracleFactory = std::unique_ptr<CudaKindOracle> (*)(const Case& c, const InputSource& inputs,
                                                              const RankAssignment& assignment, int device);
// nullptr when the kind has none (or the build has no CUDA).
CudaOracleFactory cuda_oracle_factory(std::string_view kind_name);

}  // namespace lossverify::cuda
