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
#include "lossverify/impl/cuda/devices.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify::cuda {

bool built_with_cuda() { return true; }

int visible_devices() { return device_count(); }

bool runs_kind(std::string_view kind_name) { return cuda_kind_factory(kind_name) != nullptr; }

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
  const LossKind& kind = kind_of(c.loss);
  const VocabRange work = kind.kernel_columns(bugs, vocab, c.shape.vocab);
  const bool full_vocab = work.size() != vocab.size();
  const std::int64_t rows = out.rows();
  const std::int64_t cols = work.size();
  const std::int64_t owner_base = full_vocab ? out.assignment.coordinates.tp * cols : work.begin;
  const StorageType type = storage_of(out.dtype);
  const std::size_t element = dtype_size(out.dtype);

  // The rank generates its shard on the device; hand-written rows are laid on top from the host.
  ShardInputs generated = generate_shard_inputs(c, inputs, out.assignment, work, stream.get());
  DeviceBytes d_logits = std::move(generated.student);
  DeviceBytes d_teacher = std::move(generated.teacher);
  // Zero-filled, as every backend hands a kind its gradient (the CPU backend's vectors, the plugin ABI's buffers):
  // a kernel may leave a masked row alone, and memory a freed allocation of an earlier run returns to the pool
  // must never reach a report.
  DeviceBytes d_grad(static_cast<std::size_t>(rows * cols) * element);
  if (d_grad.size() > 0) LV_CUDA(cudaMemsetAsync(d_grad.as<void>(), 0, d_grad.size(), stream.get()));
  // The kind's part: it loads its kernels' code and makes its buffers while the inputs are generated (once
  // per process and device; otherwise the first launch of each pays for it inside the timed stages).
  // LOSSVERIFY_PRELOAD=off leaves the loading to the first launches (a benchmark knob).
  static const bool preload = [] {
    const char* e = std::getenv("LOSSVERIFY_PRELOAD");
    return e == nullptr || std::string_view(e) != "off";
  }();
  const CudaKindFactory make_kind_rank = cuda_kind_factory(kind.name());
  if (make_kind_rank == nullptr) {
    throw CaseError(c.source + ": loss kind " + std::string(kind.name()) + " has no CUDA implementation");
  }
  const std::unique_ptr<CudaKindRank> kind_rank = make_kind_rank(
      CudaRankSetup{c, bugs, type, element, rows, cols, owner_base, d_logits.as<std::byte>(), d_teacher.as<std::byte>(),
                    d_grad.as<std::byte>(), groups.tp.size() == 1, preload, stream.get(), &out.assignment});
  // The rank's other buffers are set up while the GPU generates the inputs, where the host would wait:
  // the per-row arrays.
  const auto row_count = static_cast<std::size_t>(rows);
  DeviceBytes d_target(row_count * sizeof(std::int64_t));
  DeviceBytes d_active(row_count * sizeof(int));
  DeviceBytes d_valid(row_count * sizeof(int));
  DeviceBytes d_weight(row_count * sizeof(float));
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
  out.token_loss.assign(static_cast<std::size_t>(rows), 0.0f);
  out.logged_token_loss.assign(plan.kind_plan().separate_logged_loss ? static_cast<std::size_t>(rows) : 0, 0.0f);
  out.token_values.assign(static_cast<std::size_t>(rows) * kind.token_quantities().size(), 0.0f);
  out.logged_stats.assign(kind.logged_statistics(c.loss).size(), 0.0);
  out.scope_values.assign(static_cast<std::size_t>(c.layout.ga * kind.scope_values_width(c)), 0.0);
  KindOutputs kind_outputs{out.token_loss, out.logged_token_loss, out.token_values, out.logged_stats, out.scope_values};
  trace.mark("kernels");

  const CudaRows row_arrays{d_target.as<std::int64_t>(), d_active.as<int>(), d_valid.as<int>(),
                            d_weight.as<float>(),        target.data(),      active.data()};
  const auto& offsets = out.assignment.micro_batch_begin;
  for (std::size_t mb = 0; mb + 1 < offsets.size(); ++mb) {
    const std::int64_t b = offsets[mb];
    const std::int64_t n = offsets[mb + 1] - b;
    if (n == 0 && kind.columns_split_by_tp()) continue;
    kind_rank->micro_batch(plan, groups, row_arrays, b, n, kind_outputs);
  }
  if (!out.logged_stats.empty()) groups.batch.allreduce_sum(std::span<double>(out.logged_stats));
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
  if (const auto logged = plan.logged_loss(out, groups)) {
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
