#include "lossverify/impl/cuda/gpu_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/cuda/device_buffer.hpp"

namespace lossverify::cuda {

namespace {

// Target weights of SPEC 3, as the CPU reference writes them: q_v = (1 - a) [v = l] + a / n (pytorch) or
// (1 - a) [v = l] + a / (n - 1) [v != l] (megatron).
void target_weights(const Case& c, double& on, double& off) {
  const double n = static_cast<double>(c.shape.vocab);
  const double alpha = c.loss.label_smoothing;
  if (c.loss.convention == SmoothingConvention::pytorch) {
    on = (1.0 - alpha) * 1.0 + alpha / n;
    off = (1.0 - alpha) * 0.0 + alpha / n;
  } else {
    on = (1.0 - alpha) * 1.0 + alpha / (n - 1.0) * (1.0 - 1.0);
    off = (1.0 - alpha) * 0.0 + alpha / (n - 1.0) * (1.0 - 0.0);
  }
}

template <class T>
std::vector<T> download(const DeviceBytes& d, std::size_t count, cudaStream_t stream) {
  std::vector<T> host(count);
  if (count > 0) LV_CUDA(cudaMemcpyAsync(host.data(), d.as<void>(), count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  LV_CUDA(cudaStreamSynchronize(stream));
  return host;
}

// Where each per-row array sits in the workspace's input buffers (16-byte aligned).
struct InputLayout {
  std::size_t flags = 0, labels = 0, lse = 0, teacher_lse = 0, weight = 0, bytes = 0;
  explicit InputLayout(std::int64_t rows) {
    const auto n = static_cast<std::size_t>(rows);
    auto next = [](std::size_t at, std::size_t size) { return (at + size + 15) / 16 * 16; };
    labels = next(flags, n * sizeof(int));
    lse = next(labels, n * sizeof(std::int64_t));
    teacher_lse = next(lse, n * sizeof(double));
    weight = next(teacher_lse, n * sizeof(double));
    bytes = next(weight, n * sizeof(double));
  }
};
// The partials' own inputs (valid flags, then labels) and outputs: the comparison may be queued before the
// partials have run, so the two share no buffer.
std::size_t partials_labels_at(std::int64_t rows) {
  return (static_cast<std::size_t>(rows) * sizeof(int) + 15) / 16 * 16;
}
std::size_t partials_input_bytes(std::int64_t rows) {
  return partials_labels_at(rows) + static_cast<std::size_t>(rows) * sizeof(std::int64_t);
}
std::size_t partials_output_bytes(std::int64_t rows) { return static_cast<std::size_t>(rows) * 8 * sizeof(double); }
std::size_t output_bytes(std::int64_t rows) { return static_cast<std::size_t>(rows) * sizeof(RowComparison); }

}  // namespace

struct ReferenceWorkspace {
  explicit ReferenceWorkspace(std::int64_t rows_in)
      : rows(rows_in),
        layout(rows_in),
        d_in(layout.bytes),
        d_out(output_bytes(rows_in)),
        d_partials_in(partials_input_bytes(rows_in)),
        d_partials(partials_output_bytes(rows_in)),
        h_in(layout.bytes),
        h_out(output_bytes(rows_in)),
        h_partials_in(partials_input_bytes(rows_in)),
        h_partials(partials_output_bytes(rows_in)) {}
  std::int64_t rows;
  InputLayout layout;
  Stream stream;
  Event partials_start, partials_end, compare_start, compare_end;  // LOSSVERIFY_TRACE: the kernels' own times
  Event partials_done;  // the partials are on the host
  Event after;          // gpu_reference_partials_start: the work the partials wait for
  // Partials in flight, and the inputs they were launched with.
  bool partials_pending = false;
  bool partials_ready = false;  // waited for: their values are on the device and the host
  bool compare_pending = false;
  std::vector<std::int64_t> pending_labels;
  std::vector<int> pending_valid;
  DeviceBytes d_in, d_out, d_partials_in, d_partials;
  PinnedBytes h_in, h_out, h_partials_in, h_partials;
  template <class T>
  T* host_in(std::size_t at) const {
    return reinterpret_cast<T*>(h_in.as<std::byte>() + at);
  }
  template <class T>
  T* device_in(std::size_t at) const {
    return reinterpret_cast<T*>(d_in.as<std::byte>() + at);
  }
  // The first `bytes` of the input buffers to the device, on the workspace's stream.
  void upload_inputs(std::size_t bytes) const {
    LV_CUDA(cudaMemcpyAsync(d_in.as<void>(), h_in.as<void>(), bytes, cudaMemcpyHostToDevice, stream.get()));
  }
  void download_outputs(std::size_t bytes) const {
    LV_CUDA(cudaMemcpyAsync(h_out.as<void>(), d_out.as<void>(), bytes, cudaMemcpyDeviceToHost, stream.get()));
  }
  // Once `end` has passed: the time between the two events, on stderr.
  static void trace_kernel(const char* who, const Event& start, const Event& end) {
    float ms = 0.0f;
    LV_CUDA(cudaEventElapsedTime(&ms, start.get(), end.get()));
    std::fprintf(stderr, "lossverify trace: %s kernel (events) %9.3f ms\n", who, static_cast<double>(ms));
  }
};

std::shared_ptr<ReferenceWorkspace> make_reference_workspace(int device, std::int64_t rows) {
  LV_CUDA(cudaSetDevice(device));
  return std::make_shared<ReferenceWorkspace>(rows);
}

namespace {

ReferenceWorkspace& workspace_of(const DeviceShard& shard) {
  if (!shard.workspace || shard.workspace->rows < shard.rows)
    shard.workspace = make_reference_workspace(shard.device, shard.rows);
  return *shard.workspace;
}

void launch_partials(ReferenceWorkspace& ws, const ShardView& shard, const Case& c,
                     std::span<const std::int64_t> labels, std::span<const int> valid) {
  const auto rows = static_cast<std::size_t>(shard.rows);
  if (labels.size() != rows || valid.size() != rows) {
    throw InternalError("gpu reference partials: per-row arrays do not match the shard's rows");
  }
  const std::size_t labels_at = partials_labels_at(shard.rows);
  std::memcpy(ws.h_partials_in.as<std::byte>(), valid.data(), rows * sizeof(int));
  std::memcpy(ws.h_partials_in.as<std::byte>() + labels_at, labels.data(), rows * sizeof(std::int64_t));
  LV_CUDA(cudaMemcpyAsync(ws.d_partials_in.as<void>(), ws.h_partials_in.as<void>(), ws.h_partials_in.size(),
                          cudaMemcpyHostToDevice, ws.stream.get()));
  ReferencePartialArgs a{};
  a.student = shard.student;
  a.teacher = shard.teacher;
  a.rows = shard.rows;
  a.cols = shard.cols;
  a.begin = shard.begin;
  a.valid = ws.d_partials_in.as<int>();
  a.label = reinterpret_cast<const std::int64_t*>(ws.d_partials_in.as<std::byte>() + labels_at);
  a.kd = c.loss.kind == LossKind::kd;
  a.inverse_temperature = 1.0 / c.loss.temperature;
  a.softcap = c.loss.softcap;
  target_weights(c, a.q_on, a.q_off);
  ws.partials_start.record(ws.stream.get());
  reference_partials(shard.type, a, ws.d_partials.as<double>(), ws.stream.get());
  LV_CUDA(cudaGetLastError());
  ws.partials_end.record(ws.stream.get());
  LV_CUDA(cudaMemcpyAsync(ws.h_partials.as<void>(), ws.d_partials.as<void>(), ws.h_partials.size(),
                          cudaMemcpyDeviceToHost, ws.stream.get()));
  ws.partials_done.record(ws.stream.get());
  ws.partials_pending = true;
  ws.partials_ready = false;
}

ShardView view_of(const DeviceShard& shard) {
  return {shard.device, shard.type, shard.student.as<void>(), shard.teacher.as<void>(), shard.rows, shard.cols,
          shard.begin};
}

}  // namespace

void gpu_reference_partials_start(ReferenceWorkspace& ws, const ShardView& shard, const Case& c,
                                  std::vector<std::int64_t> labels, std::vector<int> valid, void* after) {
  LV_CUDA(cudaSetDevice(shard.device));
  if (ws.rows < shard.rows) throw InternalError("gpu reference partials: the workspace is smaller than the shard");
  ws.after.record(static_cast<cudaStream_t>(after));
  LV_CUDA(cudaStreamWaitEvent(ws.stream.get(), ws.after.get(), 0));
  launch_partials(ws, shard, c, labels, valid);
  ws.pending_labels = std::move(labels);
  ws.pending_valid = std::move(valid);
}

void gpu_reference_partials_launch(const DeviceShard& shard, const Case& c, std::span<const std::int64_t> labels,
                                   std::span<const int> valid) {
  LV_CUDA(cudaSetDevice(shard.device));
  ReferenceWorkspace& ws = workspace_of(shard);
  if (ws.partials_pending) {
    if (std::equal(labels.begin(), labels.end(), ws.pending_labels.begin(), ws.pending_labels.end()) &&
        std::equal(valid.begin(), valid.end(), ws.pending_valid.begin(), ws.pending_valid.end())) {
      return;  // started by the backend with these very inputs
    }
    LV_CUDA(cudaEventSynchronize(ws.partials_done.get()));  // a stale start: let it finish, then launch anew
  }
  launch_partials(ws, view_of(shard), c, labels, valid);
}

void gpu_reference_partials_wait(const DeviceShard& shard, std::span<double> out) {
  LV_CUDA(cudaSetDevice(shard.device));
  ReferenceWorkspace& ws = workspace_of(shard);
  const auto rows = static_cast<std::size_t>(shard.rows);
  if (out.size() != rows * 8) throw InternalError("gpu reference partials: the output does not match the shard's rows");
  if (!ws.partials_pending) throw InternalError("gpu reference partials: waited for before they were launched");
  LV_CUDA(cudaEventSynchronize(ws.partials_done.get()));  // (a comparison queued behind them may still run)
  ws.partials_pending = false;
  ws.partials_ready = true;
  if (std::getenv("LOSSVERIFY_TRACE") != nullptr) {
    ReferenceWorkspace::trace_kernel("gpu reference partials", ws.partials_start, ws.partials_end);
  }
  std::memcpy(out.data(), ws.h_partials.as<double>(), rows * 8 * sizeof(double));
}

std::vector<double> gpu_reference_kl(const DeviceShard& shard, const Case& c, const std::vector<double>& lse,
                                     const std::vector<double>& teacher_lse, const std::vector<int>& valid) {
  LV_CUDA(cudaSetDevice(shard.device));
  Stream stream;
  DeviceBytes d_valid = upload(valid, stream.get());
  DeviceBytes d_lse = upload(lse, stream.get());
  DeviceBytes d_teacher_lse = upload(teacher_lse, stream.get());
  const std::vector<double> zeros(static_cast<std::size_t>(2 * shard.rows), 0.0);
  DeviceBytes d_out = upload(zeros, stream.get());
  ReferenceKlArgs a{shard.student.as<void>(), shard.teacher.as<void>(), shard.rows, shard.cols, d_valid.as<int>(),
                    d_lse.as<double>(), d_teacher_lse.as<double>(), 1.0 / c.loss.temperature};
  reference_kl(shard.type, a, d_out.as<double>(), stream.get());
  LV_CUDA(cudaGetLastError());
  return download<double>(d_out, zeros.size(), stream.get());
}

void gpu_reference_compare_launch(const DeviceShard& shard, const Case& c, const GpuCompareInputs& in,
                                  bool lse_from_partials) {
  LV_CUDA(cudaSetDevice(shard.device));
  ReferenceWorkspace& ws = workspace_of(shard);
  if (lse_from_partials && !(ws.partials_pending || ws.partials_ready)) {
    throw InternalError("gpu reference compare: the lse from partials that were never launched");
  }
  if (!lse_from_partials && ws.partials_pending) {
    throw InternalError("gpu reference compare: the host's lse while the partials are in flight");
  }
  const auto rows = static_cast<std::size_t>(shard.rows);
  if (in.kind.size() != rows || in.labels.size() != rows || in.lse.size() != rows ||
      in.teacher_lse.size() != rows || in.weight.size() != rows) {
    throw InternalError("gpu reference compare: per-row arrays do not match the shard's rows");
  }
  std::memcpy(ws.host_in<int>(ws.layout.flags), in.kind.data(), rows * sizeof(int));
  std::memcpy(ws.host_in<std::int64_t>(ws.layout.labels), in.labels.data(), rows * sizeof(std::int64_t));
  std::memcpy(ws.host_in<double>(ws.layout.lse), in.lse.data(), rows * sizeof(double));
  std::memcpy(ws.host_in<double>(ws.layout.teacher_lse), in.teacher_lse.data(), rows * sizeof(double));
  std::memcpy(ws.host_in<double>(ws.layout.weight), in.weight.data(), rows * sizeof(double));
  ws.upload_inputs(ws.layout.bytes);
  ReferenceCompareArgs a{};
  a.student = shard.student.as<void>();
  a.teacher = shard.teacher.as<void>();
  a.grad = shard.grad.as<void>();
  a.rows = shard.rows;
  a.cols = shard.cols;
  a.begin = shard.begin;
  a.kind = ws.device_in<int>(ws.layout.flags);
  a.label = ws.device_in<std::int64_t>(ws.layout.labels);
  a.lse = ws.device_in<double>(ws.layout.lse);
  a.teacher_lse = ws.device_in<double>(ws.layout.teacher_lse);
  a.weight = ws.device_in<double>(ws.layout.weight);
  a.partials = lse_from_partials ? ws.d_partials.as<double>() : nullptr;
  a.kd = c.loss.kind == LossKind::kd;
  a.temperature = c.loss.temperature;
  a.inverse_temperature = 1.0 / c.loss.temperature;
  a.kd_grad_scale = std::pow(c.loss.temperature, (c.loss.t2_scaling ? 2.0 : 0.0) - 1.0);
  a.softcap = c.loss.softcap;
  a.z_loss_weight = c.loss.z_loss_weight;
  target_weights(c, a.q_on, a.q_off);
  a.atol = in.atol;
  a.rtol = in.rtol;
  a.max_ulp = in.max_ulp;
  a.dtype = static_cast<int>(shard.type);
  a.framework_scale = in.framework_scale;
  a.quantum = in.quantum;
  a.grad_scale = in.grad_scale;
  a.smallest_normal = in.smallest_normal;
  ws.compare_start.record(ws.stream.get());
  reference_compare(shard.type, a, ws.d_out.as<RowComparison>(), ws.stream.get());
  LV_CUDA(cudaGetLastError());
  ws.compare_end.record(ws.stream.get());
  ws.download_outputs(rows * sizeof(RowComparison));
  ws.compare_pending = true;
}

std::span<const RowComparison> gpu_reference_compare_wait(const DeviceShard& shard) {
  LV_CUDA(cudaSetDevice(shard.device));
  ReferenceWorkspace& ws = workspace_of(shard);
  if (!ws.compare_pending) throw InternalError("gpu reference compare: waited for before it was launched");
  ws.stream.sync();
  ws.compare_pending = false;
  if (std::getenv("LOSSVERIFY_TRACE") != nullptr) {
    ReferenceWorkspace::trace_kernel("gpu reference compare", ws.compare_start, ws.compare_end);
  }
  return {ws.h_out.as<const RowComparison>(), static_cast<std::size_t>(shard.rows)};
}

}  // namespace lossverify::cuda
