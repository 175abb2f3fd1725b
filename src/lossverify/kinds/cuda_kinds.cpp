// The loss kinds that run on the CUDA backend, and those with their own GPU oracle (CUDA builds only).
#include <string_view>

#include "lossverify/kind_api/cuda_kind.hpp"

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

CudaOracleFactory cuda_oracle_factory(std::string_view kind_name) {
  if (kind_name == "router") return &make_router_cuda_oracle;
  return nullptr;
}

}  // namespace lossverify::cuda
