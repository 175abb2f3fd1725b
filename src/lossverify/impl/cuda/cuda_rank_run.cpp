#include "lossverify/impl/cuda/cuda_rank_run.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/shard_inputs.hpp"
#include "lossverify/impl/kind_case.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify::cuda {

namespace {

// The rows the kind's logits and gradient buffers hold at once: every row of the rank; behind a stage, the stage's
// chunk, or a whole micro-batch for a kind whose rows depend on one another (LossKind::rows_independent).
std::int64_t buffer_rows(const Case& c, const RankAssignment& assignment) {
  const auto rows = static_cast<std::int64_t>(assignment.rows.size());
  if (c.loss.stage == nullptr) return rows;
  std::int64_t largest = 0;
  const auto& offsets = assignment.micro_batch_begin;
  for (std::size_t mb = 0; mb + 1 < offsets.size(); ++mb) largest = std::max(largest, offsets[mb + 1] - offsets[mb]);
  if (!kind_of(c.loss).rows_independent()) return largest;
  return std::min(largest, c.loss.stage->chunk_rows(c, rows));
}

}  // namespace

// The plan's per-row arrays, on the host and the device.
struct RowArrays {
  std::vector<std::int64_t> target;
  std::vector<int> active, valid;
  std::vector<float> weight;
  DeviceBytes d_target{0}, d_active{0}, d_valid{0}, d_weight{0};

  RowArrays(const RankPlan& plan, std::int64_t rows, std::int64_t owner_base, std::int64_t cols, cudaStream_t stream)
      : target(static_cast<std::size_t>(rows), -1),
        active(static_cast<std::size_t>(rows)),
        valid(static_cast<std::size_t>(rows)),
        weight(static_cast<std::size_t>(rows)) {
    for (std::int64_t i = 0; i < rows; ++i) {
      const RowPlan& p = plan.row(i);
      const auto k = static_cast<std::size_t>(i);
      active[k] = p.active;
      valid[k] = p.valid;
      weight[k] = p.backward_weight;
      if (p.valid && p.label - owner_base >= 0 && p.label - owner_base < cols) target[k] = p.label - owner_base;
    }
    d_target = upload(target, stream);
    d_active = upload(active, stream);
    d_valid = upload(valid, stream);
    d_weight = upload(weight, stream);
  }
  CudaRows view() const {
    return {d_target.as<std::int64_t>(), d_active.as<int>(), d_valid.as<int>(),
            d_weight.as<float>(),        target.data(),      active.data()};
  }
};

// The stage's backward of the current chunk, enqueued as soon as the kind says its gradient is (it then runs while
// the kind finishes on the host), or once the kind returns.
class ChunkBackward final : public GradientListener {
 public:
  ChunkBackward(CudaStageRank& stage, RankGroups& groups) : stage_(stage), groups_(groups) {}
  void arm(std::int64_t first, std::int64_t n) {
    first_ = first;
    n_ = n;
    done_ = false;
  }
  void gradient_enqueued() override {
    if (done_) return;
    done_ = true;
    stage_.backward(first_, n_, groups_);
  }

 private:
  CudaStageRank& stage_;
  RankGroups& groups_;
  std::int64_t first_ = 0, n_ = 0;
  bool done_ = true;
};

namespace {

// The kind's gradient rows handed over: only the rank's own columns (the kernel's may be wider), on the device for
// the GPU reference or on the host.
void hand_over_gradient(DeviceBytes d_grad, VocabRange vocab, VocabRange work, std::int64_t rows, std::size_t element,
                        StorageType type, const CudaRankOptions& options, cudaStream_t stream, RankOutput& out) {
  const std::int64_t cols = work.size();
  const std::int64_t out_cols = vocab.size();
  if (cols != out_cols) {
    DeviceBytes to(static_cast<std::size_t>(rows * out_cols) * element);
    const std::size_t offset = static_cast<std::size_t>(vocab.begin - work.begin) * element;
    if (rows > 0) {
      LV_CUDA(cudaMemcpy2DAsync(to.as<void>(), static_cast<std::size_t>(out_cols) * element,
                                d_grad.as<std::byte>() + offset, static_cast<std::size_t>(cols) * element,
                                static_cast<std::size_t>(out_cols) * element, static_cast<std::size_t>(rows),
                                cudaMemcpyDeviceToDevice, stream));
    }
    d_grad = std::move(to);
  }
  if (options.keep_on_device) {
    LV_CUDA(cudaStreamSynchronize(stream));
    auto shard = std::make_shared<DeviceShard>();
    shard->device = options.device;
    shard->type = type;
    shard->rows = rows;
    shard->cols = out_cols;
    shard->begin = vocab.begin;
    shard->grad = std::move(d_grad);
    out.device_shard = std::move(shard);
    return;
  }
  out.grad.resize(static_cast<std::size_t>(rows * out_cols) * element);
  if (!out.grad.empty()) {
    LV_CUDA(cudaMemcpyAsync(out.grad.data(), d_grad.as<void>(), out.grad.size(), cudaMemcpyDeviceToHost, stream));
  }
  LV_CUDA(cudaStreamSynchronize(stream));
}

// The rank's GPU made current for this thread: its stream, events and buffers are created on it.
int current_device(int device) {
  LV_CUDA(cudaSetDevice(device));
  return device;
}

bool preload_kernels() {
  // LOSSVERIFY_PRELOAD=off leaves the loading to the first launches (a benchmark knob).
  static const bool preload = [] {
    const char* e = std::getenv("LOSSVERIFY_PRELOAD");
    return e == nullptr || std::string_view(e) != "off";
  }();
  return preload;
}

}  // namespace

CudaRankRun::CudaRankRun(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                         const BugSwitches& bugs, const CudaRankOptions& options)
    : start_(std::chrono::steady_clock::now()),
      c_(c),
      kind_case_(kind_case_of(c, bugs)),
      groups_(groups),
      options_(options),
      device_(current_device(options.device)) {
  collectives_before_ =
      groups_.tp.collective_seconds() + groups_.batch.collective_seconds() + groups_.dp.collective_seconds();
  out_.assignment = std::move(assignment);
  out_.dtype = c.inputs.dtype;
  const Stage* stage = c.loss.stage;
  vocab_ = out_.assignment.vocab;  // the columns this rank outputs
  // The columns the kernels see: the shard, or the whole vocabulary under full-vocab-through-tp (a
  // gathered row fed to the vocab-parallel path; every rank believes its columns start at tp * V).
  const LossKind& kind = kind_of(c.loss);
  work_ = kind.kernel_columns(bugs, vocab_, c.shape.vocab);
  const std::int64_t rows = out_.rows();
  const std::int64_t cols = work_.size();
  const std::int64_t owner_base = work_.size() != vocab_.size() ? out_.assignment.coordinates.tp * cols : work_.begin;
  const StorageType type = storage_of(out_.dtype);
  const std::size_t element = dtype_size(out_.dtype);
  held_rows_ = buffer_rows(c, out_.assignment);

  // The rank generates its shard on the device; hand-written rows are laid on top from the host. Behind a stage the
  // kind's buffers hold a chunk of rows, which the stage fills.
  ShardInputs generated =
      generate_shard_inputs(c, inputs, out_.assignment, work_, stream_.get(), /*student=*/stage == nullptr);
  d_logits_ = stage == nullptr ? std::move(generated.student)
                               : DeviceBytes(static_cast<std::size_t>(held_rows_ * cols) * element);
  d_teacher_ = std::move(generated.teacher);
  // Zero-filled, as every backend hands a kind its gradient (the CPU backend's vectors, the plugin ABI's buffers):
  // a kernel may leave a masked row alone, and memory a freed allocation of an earlier run returns to the pool
  // must never reach a report.
  // Behind a stage, a kind whose kernels may overwrite their logits (LossKind::gradient_in_place) writes its gradient
  // there: one chunk's buffer.
  grad_in_place_ = stage != nullptr && kind.gradient_in_place();
  d_grad_ = DeviceBytes(grad_in_place_ ? 0 : static_cast<std::size_t>(held_rows_ * cols) * element);
  if (d_grad_.size() > 0) LV_CUDA(cudaMemsetAsync(d_grad_.as<void>(), 0, d_grad_.size(), stream_.get()));
  std::byte* const grad = grad_in_place_ ? d_logits_.as<std::byte>() : d_grad_.as<std::byte>();
  // The kind's part: it loads its kernels' code and makes its buffers while the inputs are generated (once
  // per process and device; otherwise the first launch of each pays for it inside the timed stages).
  const CudaKindFactory make_kind_rank = cuda_kind_factory(kind.name());
  if (make_kind_rank == nullptr) {
    throw CaseError(c.source + ": loss kind " + std::string(kind.name()) + " has no CUDA implementation");
  }
  if (stage != nullptr) {
    const CudaStageFactory make_stage_rank = cuda_stage_factory(stage->name());
    if (make_stage_rank == nullptr) {
      throw CaseError(c.source + ": the stage " + std::string(stage->name()) + " has no CUDA implementation");
    }
    stage_rank_ = make_stage_rank(CudaStageSetup{c, bugs, inputs, out_.assignment, type, work_.begin, cols, held_rows_,
                                                 groups.tp.size(), stage->chunk_rows(c, rows),
                                                 d_logits_.as<std::byte>(), grad, stream_.get()});
    chunk_backward_ = std::make_unique<ChunkBackward>(*stage_rank_, groups_);
  }
  kind_rank_ =
      make_kind_rank(CudaRankSetup{kind_case_, bugs, type, element, rows, cols, owner_base, d_logits_.as<std::byte>(),
                                   d_teacher_.as<std::byte>(), grad, groups.tp.size() == 1, preload_kernels(),
                                   stream_.get(), &out_.assignment, &window_, chunk_backward_.get()});
  stream_.sync();
  out_.generate_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  plan_.emplace(kind_case_, inputs, out_.assignment, groups_, bugs);
  out_.logged_valid_tokens = plan_->logged_valid_tokens();
  row_arrays_ = std::make_unique<RowArrays>(*plan_, rows, owner_base, cols, stream_.get());
  if (stage_rank_ != nullptr) stage_rank_->row_weights(row_arrays_->weight);
  out_.token_loss.assign(static_cast<std::size_t>(rows), 0.0f);
  out_.logged_token_loss.assign(plan_->kind_plan().separate_logged_loss ? static_cast<std::size_t>(rows) : 0, 0.0f);
  out_.token_values.assign(static_cast<std::size_t>(rows) * kind.token_quantities().size(), 0.0f);
  out_.logged_stats.assign(kind.logged_statistics(c.loss).size(), 0.0);
  out_.scope_values.assign(static_cast<std::size_t>(c.layout.ga * kind.scope_values_width(c)), 0.0);
  kind_outputs_ = std::make_unique<KindOutputs>(
      KindOutputs{out_.token_loss, out_.logged_token_loss, out_.token_values, out_.logged_stats, out_.scope_values});
}

CudaRankRun::~CudaRankRun() = default;

namespace {

// Events around each part of each chunk, read once the chunks are done.
class PartEvents {
 public:
  explicit PartEvents(ChunkPartTimes* times) : times_(times) {}
  ~PartEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  PartEvents(const PartEvents&) = delete;
  PartEvents& operator=(const PartEvents&) = delete;
  void mark(cudaStream_t stream) {
    if (times_ == nullptr) return;
    cudaEvent_t e = nullptr;
    LV_CUDA(cudaEventCreate(&e));
    LV_CUDA(cudaEventRecord(e, stream));
    events_.push_back(e);
  }
  // Four marks per chunk: before the forward, after it, after the kind, after the backward.
  void read() {
    if (times_ == nullptr || events_.empty()) return;
    LV_CUDA(cudaEventSynchronize(events_.back()));
    double* part[3] = {&times_->forward_ms, &times_->kind_ms, &times_->backward_ms};
    for (std::size_t i = 0; i + 3 < events_.size(); i += 4) {
      for (std::size_t k = 0; k < 3; ++k) {
        float ms = 0.0f;
        LV_CUDA(cudaEventElapsedTime(&ms, events_[i + k], events_[i + k + 1]));
        *part[k] += ms;
      }
    }
  }

 private:
  ChunkPartTimes* times_;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

void CudaRankRun::compute(ChunkPartTimes* times) {
  // Each call is one whole step (a benchmark calls it repeatedly): what the kinds and the stage accumulate starts over.
  std::fill(out_.logged_stats.begin(), out_.logged_stats.end(), 0.0);
  std::fill(out_.scope_values.begin(), out_.scope_values.end(), 0.0);
  if (stage_rank_ != nullptr) stage_rank_->start_step();
  PartEvents events(times);
  const LossKind& kind = kind_of(c_.loss);
  const CudaRows rows = row_arrays_->view();
  const std::size_t row_bytes = static_cast<std::size_t>(work_.size()) * dtype_size(out_.dtype);
  const auto& offsets = out_.assignment.micro_batch_begin;
  for (std::size_t mb = 0; mb + 1 < offsets.size(); ++mb) {
    const std::int64_t b = offsets[mb];
    const std::int64_t n = offsets[mb + 1] - b;
    if (n == 0 && kind.columns_split_by_tp()) continue;
    if (stage_rank_ == nullptr) {
      kind_rank_->micro_batch(*plan_, groups_, rows, b, n, *kind_outputs_);
      continue;
    }
    // Chunk by chunk: the stage's logits, the kind's gradient of them in place of its own, the stage's gradients.
    for (std::int64_t first = b; first < b + n; first += held_rows_) {
      const std::int64_t m = std::min(held_rows_, b + n - first);
      window_.first = first;
      events.mark(stream_.get());
      if (!grad_in_place_) {
        LV_CUDA(cudaMemsetAsync(d_grad_.as<void>(), 0, static_cast<std::size_t>(m) * row_bytes, stream_.get()));
      }
      stage_rank_->forward(first, m);
      events.mark(stream_.get());
      chunk_backward_->arm(first, m);
      kind_rank_->micro_batch(*plan_, groups_, rows, first, m, *kind_outputs_);
      events.mark(stream_.get());
      chunk_backward_->gradient_enqueued();  // where the kind did not say so
      events.mark(stream_.get());
    }
  }
  events.read();
}

RankOutput CudaRankRun::finish() {
  if (!out_.logged_stats.empty()) groups_.batch.allreduce_sum(std::span<double>(out_.logged_stats));
  if (stage_rank_ != nullptr) {
    stage_rank_->finish(out_);  // the kind's gradient stayed inside the stage
  } else {
    hand_over_gradient(std::move(d_grad_), vocab_, work_, out_.rows(), dtype_size(out_.dtype), storage_of(out_.dtype),
                       options_, stream_.get(), out_);
  }
  if (const auto logged = plan_->logged_loss(out_, groups_)) {
    out_.has_reduced_loss = true;
    out_.reduced_loss = *logged;
  }
  out_.collective_seconds = groups_.tp.collective_seconds() + groups_.batch.collective_seconds() +
                            groups_.dp.collective_seconds() - collectives_before_;
  out_.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() -
                         out_.generate_seconds - out_.collective_seconds;
  return std::move(out_);
}

}  // namespace lossverify::cuda
