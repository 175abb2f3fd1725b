// The loss kinds and stages that run on the CUDA backend, and the kinds with their own GPU oracle (CUDA builds only).
#include <string_view>

#include "lossverify/case/case.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify::cuda {

std::unique_ptr<CudaKindRank> make_cross_entropy_cuda_rank(const CudaRankSetup& setup);
std::unique_ptr<CudaKindRank> make_kd_cuda_rank(const CudaRankSetup& setup);
std::unique_ptr<CudaKindRank> make_policy_cuda_rank(const CudaRankSetup& setup);
std::unique_ptr<CudaKindRank> make_router_cuda_rank(const CudaRankSetup& setup);
std::unique_ptr<CudaKindOracle> make_router_cuda_oracle(const Case& c, const InputSource& inputs,
                                                        const RankAssignment& assignment, int device);

CudaKindFactory cuda_kind_factory(std::string_view kind_name) {
  if (kind_name == "cross_entropy") return &make_cross_entropy_cuda_rank;
  if (kind_name == "kd") return &make_kd_cuda_rank;
  if (kind_name == "policy") return &make_policy_cuda_rank;
  if (kind_name == "router") return &make_router_cuda_rank;
  return nullptr;
}

std::unique_ptr<CudaStageRank> make_lm_head_cuda_rank(const CudaStageSetup& setup);

CudaStageFactory cuda_stage_factory(std::string_view stage_name) {
  if (stage_name == "lm_head") return &make_lm_head_cuda_rank;
  return nullptr;
}

CudaOracleFactory lm_head_oracle_factory(const Case& c);

CudaOracleFactory cuda_stage_oracle_factory(const Case& c) {
  if (c.loss.stage != nullptr && c.loss.stage->name() == "lm_head") return lm_head_oracle_factory(c);
  return nullptr;
}

CudaOracleFactory cuda_oracle_factory(std::string_view kind_name) {
  if (kind_name == "router") return &make_router_cuda_oracle;
  return nullptr;
}

}  // namespace lossverify::cuda
