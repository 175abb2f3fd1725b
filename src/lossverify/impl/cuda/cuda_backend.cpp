#include "lossverify/impl/cuda/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <string_view>

#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/cuda_rank_run.hpp"
#include "lossverify/impl/cuda/devices.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"

namespace lossverify::cuda {

bool built_with_cuda() { return true; }

int visible_devices() { return device_count(); }

bool runs_kind(std::string_view kind_name) { return cuda_kind_factory(kind_name) != nullptr; }

bool runs_stage(std::string_view stage_name) { return cuda_stage_factory(stage_name) != nullptr; }

void require_device(int device) {
  char reason[256] = {0};
  if (!device_available(device, reason, sizeof(reason))) {
    throw InternalError(std::string("--backend cuda: no usable CUDA device: ") + reason);
  }
}

RankOutput run_sharded_loss(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                            const BugSwitches& bugs, const CudaRankOptions& options) {
  CudaRankRun run(c, inputs, std::move(assignment), groups, bugs, options);
  run.compute();
  return run.finish();
}

}  // namespace lossverify::cuda
