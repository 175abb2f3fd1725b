// Built when the CUDA toolkit is absent: the GPU oracle exists and says why it cannot run.
#include "lossverify/core/errors.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"
#include "lossverify/oracle/cuda/gpu_reference.hpp"

namespace lossverify::cuda {

namespace {
[[noreturn]] void unavailable() {
  throw InternalError("--reference gpu: this build has no CUDA (the CUDA toolkit was not found at configure time)");
}
}  // namespace

std::shared_ptr<OracleShard> make_oracle_shard(const Case&, const InputSource&, const RankAssignment&, int) {
  unavailable();
}
void gpu_reference_partials_launch(OracleShard&, const Case&, std::span<const std::int64_t>, std::span<const int>) {
  unavailable();
}
void gpu_reference_partials_wait(OracleShard&, std::span<double>) { unavailable(); }
std::vector<double> gpu_reference_kl(OracleShard&, const Case&, const std::vector<double>&, const std::vector<double>&,
                                     const std::vector<int>&) {
  unavailable();
}
void gpu_reference_compare_launch(OracleShard&, const DeviceShard&, const Case&, const GpuCompareInputs&, bool) {
  unavailable();
}
std::span<const RowComparison> gpu_reference_compare_wait(OracleShard&) { unavailable(); }
const void* oracle_shard_logits(const OracleShard&) { unavailable(); }
void* oracle_shard_stream(OracleShard&) { unavailable(); }
CudaOracleFactory cuda_oracle_factory(std::string_view) { return nullptr; }
CudaOracleFactory cuda_stage_oracle_factory(const Case&) { return nullptr; }

}  // namespace lossverify::cuda
