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
#include "lossverify/impl/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/device_buffer.hpp"
#include "lossverify/impl/cuda/kernels.hpp"
#include "lossverify/impl/cuda/shard_inputs.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/impl/row_loss.hpp"
#include "lossverify/math/kd_math.hpp"

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

// One KD micro-batch: pass 1 on the device, the CPU kernel's collectives on per-row sums, pass 2.
void kd_micro_batch(const Case& c, const BugSwitches& bugs, RankGroups& groups, const RankPlan& plan, std::int64_t b,
                    std::int64_t n, std::int64_t cols, StorageType type, std::size_t element, const DeviceBytes& student,
                    const DeviceBytes& teacher, const DeviceBytes& active, std::vector<float>& token_loss, const DeviceBytes& grad, cudaStream_t stream) {
  const LossSpec& loss = c.loss;
  const auto inverse_t = static_cast<float>(1.0 / loss.temperature);
  const KdScales scales = kd_scales(loss, bugs, c.layout.tp);
  const float loss_scale = scales.loss;
  const float grad_scale = scales.grad;
  const std::size_t offset = static_cast<std::size_t>(b * cols) * element;
  DeviceBytes d_stats(static_cast<std::size_t>(n) * 8 * sizeof(float));
  KdStatsArgs sa{student.as<std::byte>() + offset, teacher.as<std::byte>() + offset, n, cols, active.as<int>() + b,
                 inverse_t};
  kd_stats(type, sa, d_stats.as<float>(), stream);
  LV_CUDA(cudaGetLastError());
  std::vector<float> stats(static_cast<std::size_t>(n) * 8);
  LV_CUDA(cudaMemcpyAsync(stats.data(), d_stats.as<void>(), stats.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  LV_CUDA(cudaStreamSynchronize(stream));
  auto at = [&](std::int64_t i, int j) { return stats[static_cast<std::size_t>(8 * i + j)]; };
  const bool local_softmax = bugs.kd_local_softmax;
  const bool cross_entropy_value = bugs.kd_cross_entropy_value;
  std::vector<float> maxima(static_cast<std::size_t>(2 * n), -INFINITY);
  for (std::int64_t i = 0; i < n; ++i) {
    if (!plan.row(b + i).active) continue;
    maxima[static_cast<std::size_t>(i)] = at(i, 0);
    maxima[static_cast<std::size_t>(n + i)] = at(i, 2);
  }
  if (!local_softmax) groups.tp.allreduce_max(maxima);
  const int width = cross_entropy_value ? 4 : 3;
  std::vector<float> packed(static_cast<std::size_t>(width * n), 0.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    if (!plan.row(b + i).active) continue;
    const float ma = maxima[static_cast<std::size_t>(i)], mb = maxima[static_cast<std::size_t>(n + i)];
    const float fa = std::exp(at(i, 0) - ma), fb = std::exp(at(i, 2) - mb);
    packed[static_cast<std::size_t>(i)] = at(i, 1) * fa;
    packed[static_cast<std::size_t>(n + i)] = at(i, 3) * fb;
    packed[static_cast<std::size_t>(2 * n + i)] = at(i, 4) * fb;
    if (cross_entropy_value) packed[static_cast<std::size_t>(3 * n + i)] = fb * (at(i, 5) + (at(i, 0) - ma) * at(i, 3));
  }
  std::vector<float> divergence(static_cast<std::size_t>(n), 0.0f);
  if (local_softmax) {
    for (std::int64_t i = 0; i < n; ++i) {
      if (!plan.row(b + i).active) continue;
      divergence[static_cast<std::size_t>(i)] =
          kl_from_sums(packed[static_cast<std::size_t>(i)], packed[static_cast<std::size_t>(n + i)],
                       packed[static_cast<std::size_t>(2 * n + i)], maxima[static_cast<std::size_t>(i)],
                       maxima[static_cast<std::size_t>(n + i)]);
    }
    groups.tp.allreduce_sum(divergence);
  } else {
    groups.tp.allreduce_sum(packed);
  }
  std::vector<float> lse_a(static_cast<std::size_t>(n), 0.0f), lse_b(static_cast<std::size_t>(n), 0.0f);
  std::vector<float> grad_weight(static_cast<std::size_t>(n), 0.0f), argmax(static_cast<std::size_t>(n), 0.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const RowPlan& p = plan.row(b + i);
    if (!p.active) continue;
    lse_a[k] = maxima[k] + std::log(packed[k]);
    lse_b[k] = maxima[static_cast<std::size_t>(n + i)] + std::log(packed[static_cast<std::size_t>(n + i)]);
    const float value = kd_row_value(packed[k], packed[static_cast<std::size_t>(n + i)],
                                     packed[static_cast<std::size_t>(2 * n + i)],
                                     cross_entropy_value ? packed[static_cast<std::size_t>(3 * n + i)] : 0.0f, maxima[k],
                                     maxima[static_cast<std::size_t>(n + i)], divergence[k], bugs);
    token_loss[static_cast<std::size_t>(b + i)] = loss_scale * value;
    grad_weight[k] = p.backward_weight * grad_scale;
    argmax[k] = at(i, 6);
  }
  DeviceBytes d_lse_a = upload(lse_a, stream), d_lse_b = upload(lse_b, stream), d_w = upload(grad_weight, stream),
              d_arg = upload(argmax, stream);
  KdGradArgs ga{student.as<std::byte>() + offset,
                teacher.as<std::byte>() + offset,
                grad.as<std::byte>() + offset,
                n,
                cols,
                active.as<int>() + b,
                d_lse_a.as<float>(),
                d_lse_b.as<float>(),
                d_w.as<float>(),
                d_arg.as<float>(),
                inverse_t,
                bugs.kd_untracked_allreduce};
  kd_grad(type, ga, stream);
  LV_CUDA(cudaGetLastError());
  LV_CUDA(cudaStreamSynchronize(stream));  // the uploads above are freed on return
}

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
  const SmoothingPair smoothing_pair = smoothing_for(c, bugs, shard_width);
  const bool smoothing = c.loss.label_smoothing > 0.0;
  const auto z_weight = static_cast<float>(c.loss.z_loss_weight);
  out.token_loss.assign(static_cast<std::size_t>(rows), 0.0f);
  float* const stats = h_stats.as<float>();  // the kernels' row statistics, 4 per row
  trace.mark("kernels");

  const auto& offsets = out.assignment.micro_batch_begin;
  for (std::size_t mb = 0; mb + 1 < offsets.size(); ++mb) {
    const std::int64_t b = offsets[mb];
    const std::int64_t n = offsets[mb + 1] - b;
    if (n == 0) continue;
    GradArgs ga{d_logits.as<std::byte>() + static_cast<std::size_t>(b * cols) * element,
                d_grad.as<std::byte>() + static_cast<std::size_t>(b * cols) * element,
                n,
                cols,
                d_target.as<std::int64_t>() + b,
                d_active.as<int>() + b,
                d_valid.as<int>() + b,
                d_max.as<float>() + b,
                d_log_sum.as<float>() + b,
                d_weight.as<float>() + b};
    if (kd) {
      kd_micro_batch(c, bugs, groups, plan, b, n, cols, type, element, d_logits, d_teacher, d_active, out.token_loss, d_grad, stream.get());
      continue;
    }
    float* stats_out = d_stats.as<float>() + 4 * b;
    std::vector<float> row_max(static_cast<std::size_t>(n));
    std::vector<float> log_sum(static_cast<std::size_t>(n), 0.0f);
    std::vector<float> target_shifted(static_cast<std::size_t>(n), 0.0f);
    std::vector<float> sum_shifted(static_cast<std::size_t>(n), 0.0f);
    std::vector<float> local_sum_shifted(static_cast<std::size_t>(n), 0.0f);
    if (groups.tp.size() == 1) {
      // Whole rows on this rank: both passes in one kernel, no host round trip.
      cross_entropy_fused(type, ga, k, stats_out, stream.get());
      LV_CUDA(cudaGetLastError());
      LV_CUDA(cudaMemcpyAsync(stats + 4 * b, stats_out, static_cast<std::size_t>(n) * 4 * sizeof(float),
                              cudaMemcpyDeviceToHost, stream.get()));
      stream.sync();
      for (std::int64_t i = 0; i < n; ++i) {
        const float* s = stats + 4 * (b + i);
        const auto j = static_cast<std::size_t>(i);
        row_max[j] = s[0];
        log_sum[j] = s[1];
        sum_shifted[j] = s[2] - shard_width * s[0];
        local_sum_shifted[j] = sum_shifted[j];
        if (target[static_cast<std::size_t>(b + i)] >= 0) target_shifted[j] = s[3] - s[0];
      }
    } else {
      // Pass 1, then the docs/spec.md §5 collectives on per-row statistics, then pass 2.
      StatsArgs sa{ga.logits, n, cols, ga.target_column, ga.active};
      cross_entropy_stats(type, sa, k, stats_out, stream.get());
      LV_CUDA(cudaGetLastError());
      LV_CUDA(cudaMemcpyAsync(stats + 4 * b, stats_out, static_cast<std::size_t>(n) * 4 * sizeof(float),
                              cudaMemcpyDeviceToHost, stream.get()));
      stream.sync();
      std::vector<float> local_max(static_cast<std::size_t>(n), -INFINITY);
      for (std::int64_t i = 0; i < n; ++i) {
        if (active[static_cast<std::size_t>(b + i)]) local_max[static_cast<std::size_t>(i)] = stats[static_cast<std::size_t>(4 * (b + i))];
      }
      row_max = local_max;
      if (!bugs.no_max_shift) groups.tp.allreduce_max(row_max);
      const int width = smoothing ? 3 : 2;
      std::vector<float> packed(static_cast<std::size_t>(width * n), 0.0f);
      for (std::int64_t i = 0; i < n; ++i) {
        const auto j = static_cast<std::size_t>(i);
        if (!active[static_cast<std::size_t>(b + i)]) continue;
        const float* s = stats + 4 * (b + i);
        const float m = bugs.no_max_shift ? 0.0f : row_max[j];
        row_max[j] = m;
        packed[j] = s[1] * std::exp(local_max[j] - m);
        if (target[static_cast<std::size_t>(b + i)] >= 0) packed[static_cast<std::size_t>(n + i)] = s[3] - m;
        local_sum_shifted[j] = s[2] - shard_width * m;
        if (smoothing) packed[static_cast<std::size_t>(2 * n + i)] = local_sum_shifted[j];
      }
      groups.tp.allreduce_sum(packed);
      for (std::int64_t i = 0; i < n; ++i) {
        const auto j = static_cast<std::size_t>(i);
        if (!active[static_cast<std::size_t>(b + i)]) continue;
        log_sum[j] = std::log(packed[j]);
        target_shifted[j] = packed[static_cast<std::size_t>(n + i)];
        if (smoothing) sum_shifted[j] = packed[static_cast<std::size_t>(2 * n + i)];
      }
      LV_CUDA(cudaMemcpyAsync(d_max.as<float>() + b, row_max.data(), row_max.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream.get()));
      LV_CUDA(cudaMemcpyAsync(d_log_sum.as<float>() + b, log_sum.data(), log_sum.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream.get()));
      cross_entropy_grad(type, ga, k, stream.get());
      LV_CUDA(cudaGetLastError());
    }
    std::vector<float> log_after_exp;
    if (smoothing && bugs.smoothing_log_after_exp) {
      // The bug's third pass: sum_v log(exp(x_v - M) / S) with the global M and S.
      std::vector<float> sum_exp(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) sum_exp[static_cast<std::size_t>(i)] = std::exp(log_sum[static_cast<std::size_t>(i)]);
      DeviceBytes d_row_max = upload(row_max, stream.get()), d_sum_exp = upload(sum_exp, stream.get());
      DeviceBytes d_sum_log_p(static_cast<std::size_t>(n) * sizeof(float));
      SumLogProbArgs la{ga.logits, n, cols, ga.active, d_row_max.as<float>(), d_sum_exp.as<float>()};
      cross_entropy_sum_log_p(type, la, k, d_sum_log_p.as<float>(), stream.get());
      LV_CUDA(cudaGetLastError());
      log_after_exp.resize(static_cast<std::size_t>(n));
      LV_CUDA(cudaMemcpyAsync(log_after_exp.data(), d_sum_log_p.as<void>(), log_after_exp.size() * sizeof(float),
                              cudaMemcpyDeviceToHost, stream.get()));
      stream.sync();
      if (!bugs.smoothing_sum_local_forward) groups.tp.allreduce_sum(log_after_exp);
      const auto terms = static_cast<float>(bugs.smoothing_sum_local_forward ? cols : c.shape.vocab);
      for (std::int64_t i = 0; i < n; ++i) {
        const auto j = static_cast<std::size_t>(i);
        log_after_exp[j] += terms * log_sum[j];
      }
    }
    if (bugs.overwrites_input) {
      // The softmax over the kernel's own logits, and that buffer handed over as the gradient.
      LV_CUDA(cudaMemcpyAsync(d_max.as<float>() + b, row_max.data(), row_max.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream.get()));
      LV_CUDA(cudaMemcpyAsync(d_log_sum.as<float>() + b, log_sum.data(), log_sum.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream.get()));
      const SoftmaxInPlaceArgs sa{d_logits.as<std::byte>() + static_cast<std::size_t>(b * cols) * element, ga.grad, n,
                                  cols, ga.active, ga.row_max, ga.log_sum};
      cross_entropy_softmax_in_place(type, sa, k.softcap, stream.get());
      LV_CUDA(cudaGetLastError());
      stream.sync();  // the host vectors above go out of scope with this micro-batch
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const auto j = static_cast<std::size_t>(i);
      const RowPlan& p = plan.row(b + i);
      if (!p.active) continue;
      const float smoothing_sum = !log_after_exp.empty()           ? log_after_exp[j]
                                  : bugs.smoothing_sum_local_forward ? local_sum_shifted[j]
                                                                     : sum_shifted[j];
      out.token_loss[static_cast<std::size_t>(b + i)] =
          cross_entropy_row_loss(p, row_max[j], log_sum[j], target_shifted[j], smoothing ? smoothing_sum : 0.0f,
                                 local_sum_shifted[j], shard_width, smoothing_pair.forward, z_weight, bugs);
    }
  }
  trace.mark("hand over");
  if (full_vocab) {
    // Only the rank's own columns leave the kernel's rows.
    const std::int64_t out_cols = vocab.size();
    const std::size_t offset = static_cast<std::size_t>(vocab.begin - work.begin) * element;
    auto shard_columns = [&](const DeviceBytes& from) {
      DeviceBytes to(static_cast<std::size_t>(rows * out_cols) * element);
      if (rows > 0) {
        LV_CUDA(cudaMemcpy2DAsync(to.as<void>(), static_cast<std::size_t>(out_cols) * element, from.as<std::byte>() + offset,
                                  static_cast<std::size_t>(cols) * element, static_cast<std::size_t>(out_cols) * element,
                                  static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice, stream.get()));
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
  out.collective_seconds =
      groups.tp.collective_seconds() + groups.batch.collective_seconds() + groups.dp.collective_seconds() -
      collectives_before;
  out.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() -
                        out.generate_seconds - out.collective_seconds;
  return out;
}

}  // namespace lossverify::cuda
