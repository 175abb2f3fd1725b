// The policy kind on the CUDA backend: the kernels' side of the protocol (policy_protocol.hpp) over one
// micro-batch (CUDA builds).
#include <cuda_runtime.h>

#include <span>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kinds/policy/policy_kernels.hpp"
#include "lossverify/kinds/policy/policy_protocol.hpp"

namespace lossverify::cuda {

namespace {

class CudaPolicyShard final : public PolicyShard {
 public:
  CudaPolicyShard(StorageType type, const PolicyKernelArgs& args, cudaStream_t stream)
      : type_(type), args_(args), stream_(stream) {}

  void local_stats(float inverse_t, bool round_scaled, std::span<float> stats) override {
    args_.inverse_temperature = inverse_t;
    args_.round_scaled = round_scaled ? 1 : 0;
    DeviceBytes d_stats(stats.size() * sizeof(float));
    policy_local_stats(type_, args_, d_stats.as<float>(), stream_);
    LV_CUDA(cudaGetLastError());
    LV_CUDA(cudaMemcpyAsync(stats.data(), d_stats.as<void>(), stats.size() * sizeof(float), cudaMemcpyDeviceToHost,
                            stream_));
    LV_CUDA(cudaStreamSynchronize(stream_));
  }

  void gradient(float inverse_t, PolicyGradRounding rounding, std::span<const float> rows) override {
    args_.inverse_temperature = inverse_t;
    args_.round_scaled = rounding != PolicyGradRounding::none ? 1 : 0;
    args_.grad_rounding = static_cast<int>(rounding);
    DeviceBytes d_rows = upload(rows.data(), rows.size(), stream_);
    policy_gradient(type_, args_, d_rows.as<float>(), stream_);
    LV_CUDA(cudaGetLastError());
    LV_CUDA(cudaStreamSynchronize(stream_));  // the upload above is freed on return
  }

 private:
  StorageType type_;
  PolicyKernelArgs args_;
  cudaStream_t stream_;
};

class PolicyCudaRank final : public CudaKindRank {
 public:
  explicit PolicyCudaRank(const CudaRankSetup& s) : setup_(s) {}

  void micro_batch(const RankPlan& plan, RankGroups& groups, const CudaRows& rows, std::int64_t b, std::int64_t n,
                   KindOutputs& out) override {
    const std::size_t offset = setup_.row_offset(b);
    PolicyKernelArgs args;
    args.logits = setup_.logits + offset;
    args.grad = setup_.grad + offset;
    args.rows = n;
    args.cols = setup_.cols;
    args.active = rows.active + b;
    args.target = rows.target + b;
    CudaPolicyShard shard(setup_.type, args, static_cast<cudaStream_t>(setup_.stream));
    const VocabRange work{setup_.owner_base, setup_.owner_base + setup_.cols};
    const PolicyBatch batch{
        setup_.c,         setup_.bugs,     plan, groups, b, n, work, out.token_loss, out.logged_token_loss,
        out.token_values, out.logged_stats};
    policy_protocol(batch, shard);
  }

 private:
  CudaRankSetup setup_;
};

}  // namespace

std::unique_ptr<CudaKindRank> make_policy_cuda_rank(const CudaRankSetup& setup) {
  return std::make_unique<PolicyCudaRank>(setup);
}

}  // namespace lossverify::cuda
