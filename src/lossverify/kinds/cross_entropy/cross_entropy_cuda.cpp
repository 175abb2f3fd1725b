// Cross-entropy on the CUDA backend: the kernels' side of the protocol over one micro-batch (CUDA builds).
#include <cuda_runtime.h>

#include <cmath>
#include <span>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_kernels.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_protocol.hpp"

namespace lossverify::cuda {

namespace {

CrossEntropyConstants constants_for(const Case& c, const BugSwitches& bugs, float shard_width) {
  const SmoothingPair q = smoothing_for(c, bugs, shard_width);
  CrossEntropyConstants k{};
  k.q_on_forward = q.forward.on_target;
  k.q_off_forward = q.forward.off_target;
  k.q_on_backward = q.backward.on_target;
  k.q_off_backward = q.backward.off_target;
  k.z_loss_weight = static_cast<float>(cross_entropy_options(c.loss).z_loss_weight);
  k.softcap = static_cast<float>(cross_entropy_options(c.loss).softcap);
  k.no_max_shift = bugs.no_max_shift;
  k.zloss_grad_after_smoothing = bugs.zloss_grad_after_smoothing;
  k.grad_rounded_early = bugs.grad_rounded_early;
  return k;
}

// The CUDA kernels' side of the cross-entropy protocol over one micro-batch. Whole rows take the fused
// kernel (statistics and gradient in one pass); sharded rows take pass 1 (per-row [local M, S relative to
// it, sum x, x_target]), the protocol's collectives, then pass 2.
class CudaCrossEntropyShard final : public CrossEntropyShard {
 public:
  struct Buffers {
    GradArgs grad;           // the micro-batch's rows (row_max and log_sum point at the device copies)
    void* logits = nullptr;  // writable view of the same logits (overwrites-input)
    float* device_stats = nullptr;
    float* host_stats = nullptr;           // page-locked, 4 per row
    const std::int64_t* target = nullptr;  // host copy of the target columns, -1 where not in the shard
    const int* active = nullptr;           // host copy
    const CudaRankSetup* setup = nullptr;  // its gradient_enqueued()
    cudaEvent_t stats_copied = nullptr;    // recorded after the statistics' download
  };
  CudaCrossEntropyShard(StorageType type, const CrossEntropyConstants& k, const BugSwitches& bugs, bool whole_rows,
                        const Buffers& at, cudaStream_t stream)
      : type_(type), k_(k), bugs_(bugs), whole_rows_(whole_rows), at_(at), stream_(stream) {}

  bool fused_pass(std::span<float> max, std::span<float> log_sum, std::span<float> target_shifted,
                  std::span<float> sum_shifted) override {
    if (!whole_rows_) return false;
    cross_entropy_fused(type_, at_.grad, k_, at_.device_stats, stream_);
    LV_CUDA(cudaGetLastError());
    // A stage's backward may be enqueued behind the gradient and run while the host reads the statistics (unless a
    // bug rewrites the gradient later, in gradient()).
    LV_CUDA(cudaMemcpyAsync(at_.host_stats, at_.device_stats,
                            static_cast<std::size_t>(at_.grad.rows) * 4 * sizeof(float), cudaMemcpyDeviceToHost,
                            stream_));
    LV_CUDA(cudaEventRecord(at_.stats_copied, stream_));
    if (!bugs_.overwrites_input) at_.setup->gradient_enqueued();
    LV_CUDA(cudaEventSynchronize(at_.stats_copied));
    const auto width = static_cast<float>(at_.grad.cols);
    for (std::size_t i = 0; i < max.size(); ++i) {
      const float* s = at_.host_stats + 4 * i;
      max[i] = s[0];
      log_sum[i] = s[1];
      sum_shifted[i] = s[2] - width * s[0];
      if (at_.target[i] >= 0) target_shifted[i] = s[3] - s[0];
    }
    fused_ = true;
    return true;
  }

  void local_max(std::span<float> max) override {
    compute_stats();
    for (std::size_t i = 0; i < max.size(); ++i) {
      if (at_.active[i]) max[i] = at_.host_stats[4 * i];
    }
  }

  void shifted_sums(std::span<const float> max, std::span<float> sum_exp, std::span<float> target_shifted,
                    std::span<float> sum_shifted) override {
    if (!stats_ready_) compute_stats();  // no-max-shift asks for no maxima
    const auto width = static_cast<float>(at_.grad.cols);
    for (std::size_t i = 0; i < max.size(); ++i) {
      if (!at_.active[i]) continue;
      const float* s = at_.host_stats + 4 * i;
      const float m = max[i];
      sum_exp[i] = s[1] * std::exp(s[0] - m);
      if (at_.target[i] >= 0) target_shifted[i] = s[3] - m;
      sum_shifted[i] = s[2] - width * m;
    }
  }

  void sum_log_p(std::span<const float> max, std::span<const float> sum_exp, std::span<float> out) override {
    DeviceBytes d_row_max = upload(max.data(), max.size(), stream_);
    DeviceBytes d_sum_exp = upload(sum_exp.data(), sum_exp.size(), stream_);
    DeviceBytes d_out(out.size() * sizeof(float));
    const SumLogProbArgs args{at_.grad.logits, at_.grad.rows,         at_.grad.cols,
                              at_.grad.active, d_row_max.as<float>(), d_sum_exp.as<float>()};
    cross_entropy_sum_log_p(type_, args, k_, d_out.as<float>(), stream_);
    LV_CUDA(cudaGetLastError());
    LV_CUDA(cudaMemcpyAsync(out.data(), d_out.as<void>(), out.size_bytes(), cudaMemcpyDeviceToHost, stream_));
    LV_CUDA(cudaStreamSynchronize(stream_));
  }

  void gradient(std::span<const float> max, std::span<const float> log_sum) override {
    if (fused_ && !bugs_.overwrites_input) return;
    float* const d_max = const_cast<float*>(at_.grad.row_max);
    float* const d_log_sum = const_cast<float*>(at_.grad.log_sum);
    LV_CUDA(cudaMemcpyAsync(d_max, max.data(), max.size_bytes(), cudaMemcpyHostToDevice, stream_));
    LV_CUDA(cudaMemcpyAsync(d_log_sum, log_sum.data(), log_sum.size_bytes(), cudaMemcpyHostToDevice, stream_));
    if (!fused_) {
      cross_entropy_grad(type_, at_.grad, k_, stream_);
      LV_CUDA(cudaGetLastError());
    }
    if (bugs_.overwrites_input) {
      // The softmax over the kernel's own logits, and that buffer handed over as the gradient.
      const SoftmaxInPlaceArgs args{at_.logits,      at_.grad.grad,    at_.grad.rows,   at_.grad.cols,
                                    at_.grad.active, at_.grad.row_max, at_.grad.log_sum};
      cross_entropy_softmax_in_place(type_, args, k_.softcap, stream_);
      LV_CUDA(cudaGetLastError());
      LV_CUDA(cudaStreamSynchronize(stream_));  // the protocol's host vectors go out of scope on return
    }
    at_.setup->gradient_enqueued();
  }

 private:
  void download_stats() {
    LV_CUDA(cudaMemcpyAsync(at_.host_stats, at_.device_stats,
                            static_cast<std::size_t>(at_.grad.rows) * 4 * sizeof(float), cudaMemcpyDeviceToHost,
                            stream_));
    LV_CUDA(cudaStreamSynchronize(stream_));
  }
  void compute_stats() {
    const StatsArgs args{at_.grad.logits, at_.grad.rows, at_.grad.cols, at_.grad.target_column, at_.grad.active};
    cross_entropy_stats(type_, args, k_, at_.device_stats, stream_);
    LV_CUDA(cudaGetLastError());
    download_stats();
    stats_ready_ = true;
  }

  StorageType type_;
  CrossEntropyConstants k_;
  const BugSwitches& bugs_;
  bool whole_rows_;
  Buffers at_;
  cudaStream_t stream_;
  bool fused_ = false;
  bool stats_ready_ = false;
};

// A rank's cross-entropy on its GPU: the kernels' code loaded and the per-row buffers made while the
// inputs are generated, then one CudaCrossEntropyShard per micro-batch.
class CrossEntropyCudaRank final : public CudaKindRank {
 public:
  explicit CrossEntropyCudaRank(const CudaRankSetup& s)
      : setup_(s),
        constants_(constants_for(s.c, s.bugs, static_cast<float>(s.cols))),
        d_stats_(static_cast<std::size_t>(s.rows) * 4 * sizeof(float)),
        d_max_(static_cast<std::size_t>(s.rows) * sizeof(float)),
        d_log_sum_(static_cast<std::size_t>(s.rows) * sizeof(float)),
        h_stats_(static_cast<std::size_t>(s.rows) * 4 * sizeof(float)) {}

  void micro_batch(const RankPlan& plan, RankGroups& groups, const CudaRows& rows, std::int64_t b, std::int64_t n,
                   KindOutputs& out) override {
    const std::size_t offset = setup_.row_offset(b);
    CudaCrossEntropyShard::Buffers at;
    at.grad = GradArgs{setup_.logits + offset,
                       setup_.grad + offset,
                       n,
                       setup_.cols,
                       rows.target + b,
                       rows.active + b,
                       rows.valid + b,
                       d_max_.as<float>() + b,
                       d_log_sum_.as<float>() + b,
                       rows.weight + b};
    at.logits = setup_.logits + offset;
    at.device_stats = d_stats_.as<float>() + 4 * b;
    at.host_stats = h_stats_.as<float>() + 4 * b;
    at.target = rows.host_target + b;
    at.active = rows.host_active + b;
    at.setup = &setup_;
    at.stats_copied = stats_copied_.get();
    CudaCrossEntropyShard shard(setup_.type, constants_, setup_.bugs, setup_.whole_rows, at,
                                static_cast<cudaStream_t>(setup_.stream));
    cross_entropy_protocol(setup_.c, setup_.bugs, plan, groups, b, n, setup_.cols, shard, out.token_loss);
  }

  CrossEntropyConstants constants() const { return constants_; }

 private:
  CudaRankSetup setup_;
  CrossEntropyConstants constants_;
  DeviceBytes d_stats_, d_max_, d_log_sum_;
  PinnedBytes h_stats_;
  Event stats_copied_;
};

}  // namespace

std::unique_ptr<CudaKindRank> make_cross_entropy_cuda_rank(const CudaRankSetup& setup) {
  auto rank = std::make_unique<CrossEntropyCudaRank>(setup);
  if (setup.preload) {
    preload_cross_entropy_kernels(setup.type, rank->constants(), setup.whole_rows, setup.logits, setup.cols);
  }
  return rank;
}

}  // namespace lossverify::cuda
