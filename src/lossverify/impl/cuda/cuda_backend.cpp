#include "lossverify/impl/cuda/cuda_backend.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/stage_trace.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/shard_inputs.hpp"
#include "lossverify/impl/cuda/kernels.hpp"
#include "lossverify/impl/loss_protocol.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/impl/row_loss.hpp"

namespace lossverify::cuda {

namespace {

CrossEntropyConstants constants_for(const Case& c, const BugSwitches& bugs, float shard_width) {
  const SmoothingPair q = smoothing_for(c, bugs, shard_width);
  CrossEntropyConstants k{};
  k.q_on_forward = q.forward.on_target;
  k.q_off_forward = q.forward.off_target;
  k.q_on_backward = q.backward.on_target;
  k.q_off_backward = q.backward.off_target;
  k.z_loss_weight = static_cast<float>(c.loss.z_loss_weight);
  k.softcap = static_cast<float>(c.loss.softcap);
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
  };
  CudaCrossEntropyShard(StorageType type, const CrossEntropyConstants& k, const BugSwitches& bugs, bool whole_rows,
                        const Buffers& at, cudaStream_t stream)
      : type_(type), k_(k), bugs_(bugs), whole_rows_(whole_rows), at_(at), stream_(stream) {}

  bool fused_pass(std::span<float> max, std::span<float> log_sum, std::span<float> target_shifted,
                  std::span<float> sum_shifted) override {
    if (!whole_rows_) return false;
    cross_entropy_fused(type_, at_.grad, k_, at_.device_stats, stream_);
    LV_CUDA(cudaGetLastError());
    download_stats();
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

}  // namespace

bool built_with_cuda() { return true; }

int visible_devices() { return device_count(); }

void require_device(int device) {
  char reason[256] = {0};
  if (!device_available(device, reason, sizeof(reason))) {
    throw InternalError(std::string("--backend cuda: no usable CUDA device: ") + reason);
  }
}

RankOutput run_sharded_loss(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                            const BugSwitches& bugs, const CudaRankOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const double collectives_before =
      groups.tp.collective_seconds() + groups.batch.collective_seconds() + groups.dp.collective_seconds();
  LV_CUDA(cudaSetDevice(options.device));
  Stream stream;
  RankOutput out;
  out.assignment = std::move(assignment);
  out.dtype = c.inputs.dtype;
  const VocabRange vocab = out.assignment.vocab;  // the columns this rank outputs
  // The columns the kernels see: the shard, or the whole vocabulary under full-vocab-through-tp (a
  // gathered row fed to the vocab-parallel path; every rank believes its columns start at tp * V).
  const bool full_vocab = bugs.full_vocab_through_tp && c.loss.kind == LossKind::cross_entropy;
  const VocabRange work = full_vocab ? VocabRange{0, c.shape.vocab} : vocab;
  const std::int64_t rows = out.rows();
  const std::int64_t cols = work.size();
  const std::int64_t owner_base = full_vocab ? out.assignment.coordinates.tp * cols : work.begin;
  const StorageType type = storage_of(out.dtype);
  const std::size_t element = dtype_size(out.dtype);

  // The rank generates its shard on the device; hand-written rows are laid on top from the host.
  ShardInputs generated = generate_shard_inputs(c, inputs, out.assignment, work, stream.get());
  DeviceBytes d_logits = std::move(generated.student);
  DeviceBytes d_teacher = std::move(generated.teacher);
  const bool kd = c.loss.kind == LossKind::kd;
  // The code of the kernels this rank will launch, loaded while the inputs are generated (once per
  // process and device; otherwise the first launch of each pays for it inside the timed stages).
  // LOSSVERIFY_PRELOAD=off leaves the loading to the first launches (a benchmark knob).
  static const bool preload = [] {
    const char* e = std::getenv("LOSSVERIFY_PRELOAD");
    return e == nullptr || std::string_view(e) != "off";
  }();
  if (preload) {
    KernelChoice choice;
    choice.kd = kd;
    choice.whole_rows = groups.tp.size() == 1;
    choice.constants = constants_for(c, bugs, static_cast<float>(cols));
    choice.logits = d_logits.as<void>();
    choice.cols = cols;
    preload_kernels(type, choice);
  }
  // The rank's other buffers are set up while the GPU generates the inputs, where the host would wait:
  // the gradient, the per-row arrays and a page-locked copy of the row statistics.
  DeviceBytes d_grad(static_cast<std::size_t>(rows * cols) * element);
  const auto row_count = static_cast<std::size_t>(rows);
  DeviceBytes d_target(row_count * sizeof(std::int64_t));
  DeviceBytes d_active(row_count * sizeof(int));
  DeviceBytes d_valid(row_count * sizeof(int));
  DeviceBytes d_weight(row_count * sizeof(float));
  DeviceBytes d_stats(row_count * 4 * sizeof(float));
  DeviceBytes d_max(row_count * sizeof(float));
  DeviceBytes d_log_sum(row_count * sizeof(float));
  PinnedBytes h_stats(row_count * 4 * sizeof(float));
  stream.sync();
  out.generate_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  StageTrace trace("cuda compute");  // LOSSVERIFY_TRACE=1: the compute stage's parts
  trace.mark("plan");

  const RankPlan plan(c, inputs, out.assignment, groups, bugs);
  out.logged_valid_tokens = plan.logged_valid_tokens();
  std::vector<std::int64_t> target(static_cast<std::size_t>(rows), -1);
  std::vector<int> active(static_cast<std::size_t>(rows));
  std::vector<int> valid(static_cast<std::size_t>(rows));
  std::vector<float> weight(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) {
    const RowPlan& p = plan.row(i);
    const auto k = static_cast<std::size_t>(i);
    active[k] = p.active;
    valid[k] = p.valid;
    weight[k] = p.backward_weight;
    if (p.valid && p.label - owner_base >= 0 && p.label - owner_base < cols) target[k] = p.label - owner_base;
  }
  trace.mark("upload");
  copy_to_device(d_target, target, stream.get());
  copy_to_device(d_active, active, stream.get());
  copy_to_device(d_valid, valid, stream.get());
  copy_to_device(d_weight, weight, stream.get());
  const auto shard_width = static_cast<float>(cols);
  const CrossEntropyConstants k = constants_for(c, bugs, shard_width);
  out.token_loss.assign(static_cast<std::size_t>(rows), 0.0f);
  trace.mark("kernels");

  const auto& offsets = out.assignment.micro_batch_begin;
  for (std::size_t mb = 0; mb + 1 < offsets.size(); ++mb) {
    const std::int64_t b = offsets[mb];
    const std::int64_t n = offsets[mb + 1] - b;
    if (n == 0) continue;
    const std::size_t offset = static_cast<std::size_t>(b * cols) * element;
    if (kd) {
      const KdStatsArgs sa{d_logits.as<std::byte>() + offset,
                           d_teacher.as<std::byte>() + offset,
                           n,
                           cols,
                           d_active.as<int>() + b,
                           static_cast<float>(1.0 / c.loss.temperature)};
      CudaKdShard shard(type, sa, active.data() + b, d_grad.as<std::byte>() + offset, bugs, stream.get());
      kd_protocol(c, bugs, plan, groups, b, n, shard, out.token_loss);
      continue;
    }
    CudaCrossEntropyShard::Buffers at;
    at.grad = GradArgs{d_logits.as<std::byte>() + offset,
                       d_grad.as<std::byte>() + offset,
                       n,
                       cols,
                       d_target.as<std::int64_t>() + b,
                       d_active.as<int>() + b,
                       d_valid.as<int>() + b,
                       d_max.as<float>() + b,
                       d_log_sum.as<float>() + b,
                       d_weight.as<float>() + b};
    at.logits = d_logits.as<std::byte>() + offset;
    at.device_stats = d_stats.as<float>() + 4 * b;
    at.host_stats = h_stats.as<float>() + 4 * b;
    at.target = target.data() + b;
    at.active = active.data() + b;
    CudaCrossEntropyShard shard(type, k, bugs, groups.tp.size() == 1, at, stream.get());
    cross_entropy_protocol(c, bugs, plan, groups, b, n, cols, shard, out.token_loss);
  }
  trace.mark("hand over");
  if (full_vocab) {
    // Only the rank's own columns leave the kernel's rows.
    const std::int64_t out_cols = vocab.size();
    const std::size_t offset = static_cast<std::size_t>(vocab.begin - work.begin) * element;
    auto shard_columns = [&](const DeviceBytes& from) {
      DeviceBytes to(static_cast<std::size_t>(rows * out_cols) * element);
      if (rows > 0) {
        LV_CUDA(cudaMemcpy2DAsync(to.as<void>(), static_cast<std::size_t>(out_cols) * element,
                                  from.as<std::byte>() + offset, static_cast<std::size_t>(cols) * element,
                                  static_cast<std::size_t>(out_cols) * element, static_cast<std::size_t>(rows),
                                  cudaMemcpyDeviceToDevice, stream.get()));
      }
      return to;
    };
    d_grad = shard_columns(d_grad);
    stream.sync();
  }
  const std::int64_t out_cols = vocab.size();
  if (options.keep_on_device) {
    stream.sync();
    auto shard = std::make_shared<DeviceShard>();
    shard->device = options.device;
    shard->type = type;
    shard->rows = rows;
    shard->cols = out_cols;
    shard->begin = vocab.begin;
    shard->grad = std::move(d_grad);
    out.device_shard = std::move(shard);
  } else {
    out.grad.resize(static_cast<std::size_t>(rows * out_cols) * element);
    LV_CUDA(cudaMemcpyAsync(out.grad.data(), d_grad.as<void>(), out.grad.size(), cudaMemcpyDeviceToHost, stream.get()));
    stream.sync();
  }
  if (const auto logged = plan.logged_loss(out.token_loss, groups.batch)) {
    out.has_reduced_loss = true;
    out.reduced_loss = *logged;
  }
  out.collective_seconds = groups.tp.collective_seconds() + groups.batch.collective_seconds() +
                           groups.dp.collective_seconds() - collectives_before;
  out.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() -
                        out.generate_seconds - out.collective_seconds;
  return out;
}

}  // namespace lossverify::cuda
