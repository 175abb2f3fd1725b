// Built when the CUDA toolkit is absent: the backend exists and says why it cannot run.
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"

namespace lossverify::cuda {

namespace {
[[noreturn]] void unavailable() {
  throw InternalError("--backend cuda: this build has no CUDA (the CUDA toolkit was not found at configure time)");
}
}  // namespace

bool built_with_cuda() { return false; }
void require_device(int) { unavailable(); }
int visible_devices() { return 0; }
bool runs_kind(std::string_view) { return false; }
bool runs_stage(std::string_view) { return false; }
RankOutput run_sharded_loss(const Case&, const InputSource&, RankAssignment, RankGroups, const BugSwitches&,
                            const CudaRankOptions&) {
  unavailable();
}
nlohmann::json bench(const BenchOptions&) { unavailable(); }
nlohmann::json bench_policy(const BenchOptions&) { unavailable(); }
nlohmann::json bench_head(const BenchOptions&) { unavailable(); }
nlohmann::json bench_router(const BenchOptions&) { unavailable(); }
nlohmann::json bench_multi_gpu(const MultiGpuBenchOptions&) { unavailable(); }
}  // namespace lossverify::cuda
