// Built when NCCL was not found at configure time: one GPU per rank falls back to host collectives.
#include "lossverify/comm/nccl_communicator.hpp"
#include "lossverify/core/errors.hpp"

namespace lossverify::cuda {

bool built_with_nccl() { return false; }

std::unique_ptr<Communicator> make_nccl_group(Communicator&, int, double, NcclRole) {
  throw InternalError(
      "--collectives nccl: this build has no NCCL (nccl.h and libnccl were not found at configure time)");
}

std::int64_t nccl_endpoints_created() { return 0; }

std::int64_t nccl_endpoints_kept() { return 0; }

void release_nccl_endpoints() {}

}  // namespace lossverify::cuda
