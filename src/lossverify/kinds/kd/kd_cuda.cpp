// KD on the CUDA backend: the kernels' side of the protocol over one micro-batch (CUDA builds).
#include <cuda_runtime.h>

#include <cmath>
#include <span>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kinds/kd/kd_kernels.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"
#include "lossverify/kinds/kd/kd_protocol.hpp"

namespace lossverify::cuda {

namespace {

// The CUDA kernels' side of the KD protocol over one micro-batch: pass 1 gives per-row
// [M_a, S_a, M_b, S_b, W, U, argmax, 0] relative to the local maxima, rescaled here to the global ones.
class CudaKdShard final : public KdShard {
 public:
  // `host_active`: the host copy of args.active.
  CudaKdShard(StorageType type, const KdStatsArgs& stats_args, const int* host_active, void* grad,
              const BugSwitches& bugs, cudaStream_t stream)
      : type_(type),
        args_(stats_args),
        grad_(grad),
        bugs_(bugs),
        stream_(stream),
        stats_(static_cast<std::size_t>(stats_args.rows) * 8),
        active_(host_active, host_active + stats_args.rows) {}

  void local_maxima(std::span<float> maxima) override {
    const std::size_t n = stats_.size() / 8;
    DeviceBytes d_stats(stats_.size() * sizeof(float));
    kd_stats(type_, args_, d_stats.as<float>(), stream_);
    LV_CUDA(cudaGetLastError());
    LV_CUDA(cudaMemcpyAsync(stats_.data(), d_stats.as<void>(), stats_.size() * sizeof(float), cudaMemcpyDeviceToHost,
                            stream_));
    LV_CUDA(cudaStreamSynchronize(stream_));
    for (std::size_t i = 0; i < n; ++i) {
      if (!active_[i]) continue;
      maxima[i] = at(i, 0);
      maxima[n + i] = at(i, 2);
    }
  }

  void shifted_sums(std::span<const float> maxima, std::span<float> packed) override {
    const std::size_t n = stats_.size() / 8;
    const bool cross_entropy_value = packed.size() == 4 * n;
    for (std::size_t i = 0; i < n; ++i) {
      if (!active_[i]) continue;
      const float ma = maxima[i], mb = maxima[n + i];
      const float fa = std::exp(at(i, 0) - ma), fb = std::exp(at(i, 2) - mb);
      packed[i] = at(i, 1) * fa;
      packed[n + i] = at(i, 3) * fb;
      packed[2 * n + i] = at(i, 4) * fb;
      if (cross_entropy_value) packed[3 * n + i] = fb * (at(i, 5) + (at(i, 0) - ma) * at(i, 3));
    }
  }

  void gradient(std::span<const float> lse_a, std::span<const float> lse_b, std::span<const float> weight) override {
    const std::size_t n = stats_.size() / 8;
    std::vector<float> argmax(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) {
      if (active_[i]) argmax[i] = at(i, 6);
    }
    DeviceBytes d_lse_a = upload(lse_a.data(), lse_a.size(), stream_);
    DeviceBytes d_lse_b = upload(lse_b.data(), lse_b.size(), stream_);
    DeviceBytes d_w = upload(weight.data(), weight.size(), stream_);
    DeviceBytes d_arg = upload(argmax, stream_);
    const KdGradArgs ga{args_.student,
                        args_.teacher,
                        grad_,
                        args_.rows,
                        args_.cols,
                        args_.active,
                        d_lse_a.as<float>(),
                        d_lse_b.as<float>(),
                        d_w.as<float>(),
                        d_arg.as<float>(),
                        args_.inverse_temperature,
                        bugs_.kd_untracked_allreduce};
    kd_grad(type_, ga, stream_);
    LV_CUDA(cudaGetLastError());
    LV_CUDA(cudaStreamSynchronize(stream_));  // the uploads above are freed on return
  }

 private:
  float at(std::size_t i, int j) const { return stats_[8 * i + static_cast<std::size_t>(j)]; }

  StorageType type_;
  KdStatsArgs args_;
  void* grad_;
  const BugSwitches& bugs_;
  cudaStream_t stream_;
  std::vector<float> stats_;
  std::vector<int> active_;
};

class KdCudaRank final : public CudaKindRank {
 public:
  explicit KdCudaRank(const CudaRankSetup& s) : setup_(s) {}

  void micro_batch(const RankPlan& plan, RankGroups& groups, const CudaRows& rows, std::int64_t b, std::int64_t n,
                   KindOutputs& out) override {
    const std::size_t offset = setup_.row_offset(b);  // the student's and its gradient's rows
    const std::size_t teacher_offset = static_cast<std::size_t>(b * setup_.cols) * setup_.element;
    const KdStatsArgs sa{setup_.logits + offset,
                         setup_.teacher + teacher_offset,
                         n,
                         setup_.cols,
                         rows.active + b,
                         static_cast<float>(1.0 / kd_options(setup_.c.loss).temperature)};
    CudaKdShard shard(setup_.type, sa, rows.host_active + b, setup_.grad + offset, setup_.bugs,
                      static_cast<cudaStream_t>(setup_.stream));
    kd_protocol(setup_.c, setup_.bugs, plan, groups, b, n, shard, out.token_loss);
  }

 private:
  CudaRankSetup setup_;
};

}  // namespace

std::unique_ptr<CudaKindRank> make_kd_cuda_rank(const CudaRankSetup& setup) {
  if (setup.preload) preload_kd_kernels(setup.type);
  return std::make_unique<KdCudaRank>(setup);
}

}  // namespace lossverify::cuda
