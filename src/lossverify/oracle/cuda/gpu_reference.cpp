#include "lossverify/oracle/cuda/gpu_reference.hpp"

#include "lossverify/kind_api/loss_kind.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/shard_inputs.hpp"

namespace lossverify::cuda {

namespace {

// Target weights of docs/spec.md §3, as the CPU reference writes them: q_v = (1 - a) [v = l] + a / n (pytorch) or
// (1 - a) [v = l] + a / (n - 1) [v != l] (megatron).
// The case's row model (its kind's); the runner uses this oracle only for kinds that have one.
DeviceRowModel row_model(const Case& c) {
  const std::optional<DeviceRowModel> m = kind_of(c.loss).device_row_model(c);
  if (!m) throw InternalError("the GPU oracle cannot evaluate loss kind " + std::string(kind_of(c.loss).name()));
  return *m;
}

// Where each per-row array sits in the workspace's input buffers (16-byte aligned).
struct InputLayout {
  std::size_t flags = 0, labels = 0, lse = 0, teacher_lse = 0, weight = 0, coef_a = 0, coef_b = 0, row_scale = 0;
  std::size_t bytes = 0;
  explicit InputLayout(std::int64_t rows) {
    const auto n = static_cast<std::size_t>(rows);
    auto next = [](std::size_t at, std::size_t size) { return (at + size + 15) / 16 * 16; };
    labels = next(flags, n * sizeof(int));
    lse = next(labels, n * sizeof(std::int64_t));
    teacher_lse = next(lse, n * sizeof(double));
    weight = next(teacher_lse, n * sizeof(double));
    coef_a = next(weight, n * sizeof(double));
    coef_b = next(coef_a, n * sizeof(double));
    row_scale = next(coef_b, n * sizeof(double));
    bytes = next(row_scale, n * sizeof(double));
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
  Event partials_done;                                             // the partials are on the host
  bool partials_pending = false;
  bool partials_ready = false;  // waited for: their values are on the device and the host
  bool compare_pending = false;
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

struct OracleShard {
  OracleShard(int device_in, StorageType type_in, std::int64_t rows_in, std::int64_t cols_in, std::int64_t begin_in)
      : device(device_in), type(type_in), rows(rows_in), cols(cols_in), begin(begin_in), workspace(rows_in) {}
  int device;
  StorageType type;
  std::int64_t rows, cols, begin;
  ReferenceWorkspace workspace;
  ShardInputs inputs;  // the oracle's own: no implementation has their address
};

std::shared_ptr<OracleShard> make_oracle_shard(const Case& c, const InputSource& inputs,
                                               const RankAssignment& assignment, int device) {
  LV_CUDA(cudaSetDevice(device));
  const VocabRange columns = assignment.vocab;
  auto oracle =
      std::make_shared<OracleShard>(device, storage_of(c.inputs.dtype),
                                    static_cast<std::int64_t>(assignment.rows.size()), columns.size(), columns.begin);
  oracle->inputs = generate_shard_inputs(c, inputs, assignment, columns, oracle->workspace.stream.get());
  // The reference kernels' code, loaded while the inputs are generated (once per process and device); a kind with its
  // own GPU oracle evaluates its rows itself.
  if (const std::optional<DeviceRowModel> model = kind_of(c.loss).device_row_model(c)) {
    preload_reference_kernels(oracle->type, model->teacher || model->row_coefficients, model->softcap,
                              oracle->inputs.student.as<void>(), oracle->cols);
  }
  return oracle;
}

const void* oracle_shard_logits(const OracleShard& oracle) { return oracle.inputs.student.as<void>(); }
void* oracle_shard_stream(OracleShard& oracle) { return oracle.workspace.stream.get(); }

namespace {

void launch_partials(OracleShard& oracle, const Case& c, std::span<const std::int64_t> labels,
                     std::span<const int> valid) {
  ReferenceWorkspace& ws = oracle.workspace;
  const auto rows = static_cast<std::size_t>(oracle.rows);
  if (labels.size() != rows || valid.size() != rows) {
    throw InternalError("gpu reference partials: per-row arrays do not match the shard's rows");
  }
  const std::size_t labels_at = partials_labels_at(oracle.rows);
  std::memcpy(ws.h_partials_in.as<std::byte>(), valid.data(), rows * sizeof(int));
  std::memcpy(ws.h_partials_in.as<std::byte>() + labels_at, labels.data(), rows * sizeof(std::int64_t));
  LV_CUDA(cudaMemcpyAsync(ws.d_partials_in.as<void>(), ws.h_partials_in.as<void>(), ws.h_partials_in.size(),
                          cudaMemcpyHostToDevice, ws.stream.get()));
  ReferencePartialArgs a{};
  a.student = oracle.inputs.student.as<void>();
  a.teacher = oracle.inputs.teacher.as<void>();
  a.rows = oracle.rows;
  a.cols = oracle.cols;
  a.begin = oracle.begin;
  a.valid = ws.d_partials_in.as<int>();
  a.label = reinterpret_cast<const std::int64_t*>(ws.d_partials_in.as<std::byte>() + labels_at);
  const DeviceRowModel model = row_model(c);
  a.kd = model.teacher;
  a.row_coefficients = model.row_coefficients;
  a.inverse_temperature = 1.0 / model.temperature;
  a.softcap = model.softcap;
  a.q_on = model.q_on;
  a.q_off = model.q_off;
  ws.partials_start.record(ws.stream.get());
  reference_partials(oracle.type, a, ws.d_partials.as<double>(), ws.stream.get());
  LV_CUDA(cudaGetLastError());
  ws.partials_end.record(ws.stream.get());
  LV_CUDA(cudaMemcpyAsync(ws.h_partials.as<void>(), ws.d_partials.as<void>(), ws.h_partials.size(),
                          cudaMemcpyDeviceToHost, ws.stream.get()));
  ws.partials_done.record(ws.stream.get());
  ws.partials_pending = true;
  ws.partials_ready = false;
}

}  // namespace

void gpu_reference_partials_launch(OracleShard& oracle, const Case& c, std::span<const std::int64_t> labels,
                                   std::span<const int> valid) {
  LV_CUDA(cudaSetDevice(oracle.device));
  if (oracle.workspace.partials_pending) LV_CUDA(cudaEventSynchronize(oracle.workspace.partials_done.get()));
  launch_partials(oracle, c, labels, valid);
}

void gpu_reference_partials_wait(OracleShard& oracle, std::span<double> out) {
  LV_CUDA(cudaSetDevice(oracle.device));
  ReferenceWorkspace& ws = oracle.workspace;
  const auto rows = static_cast<std::size_t>(oracle.rows);
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

std::vector<double> gpu_reference_kl(OracleShard& oracle, const Case& c, const std::vector<double>& lse,
                                     const std::vector<double>& teacher_lse, const std::vector<int>& valid) {
  LV_CUDA(cudaSetDevice(oracle.device));
  const Stream& stream = oracle.workspace.stream;  // behind the oracle's generation
  DeviceBytes d_valid = upload(valid, stream.get());
  DeviceBytes d_lse = upload(lse, stream.get());
  DeviceBytes d_teacher_lse = upload(teacher_lse, stream.get());
  const std::vector<double> zeros(static_cast<std::size_t>(2 * oracle.rows), 0.0);
  DeviceBytes d_out = upload(zeros, stream.get());
  ReferenceKlArgs a{oracle.inputs.student.as<void>(),
                    oracle.inputs.teacher.as<void>(),
                    oracle.rows,
                    oracle.cols,
                    d_valid.as<int>(),
                    d_lse.as<double>(),
                    d_teacher_lse.as<double>(),
                    1.0 / row_model(c).temperature,
                    row_model(c).row_coefficients ? 1 : 0};
  reference_kl(oracle.type, a, d_out.as<double>(), stream.get());
  LV_CUDA(cudaGetLastError());
  return download<double>(d_out, zeros.size(), stream.get());
}

void gpu_reference_compare_launch(OracleShard& oracle, const DeviceShard& output, const Case& c,
                                  const GpuCompareInputs& in, bool lse_from_partials) {
  LV_CUDA(cudaSetDevice(oracle.device));
  if (output.device != oracle.device || output.rows != oracle.rows || output.cols != oracle.cols ||
      output.begin != oracle.begin || output.type != oracle.type) {
    throw InternalError("gpu reference compare: the rank's gradient does not match the oracle's shard");
  }
  ReferenceWorkspace& ws = oracle.workspace;
  if (lse_from_partials && !(ws.partials_pending || ws.partials_ready)) {
    throw InternalError("gpu reference compare: the lse from partials that were never launched");
  }
  if (!lse_from_partials && ws.partials_pending) {
    throw InternalError("gpu reference compare: the host's lse while the partials are in flight");
  }
  const auto rows = static_cast<std::size_t>(oracle.rows);
  if (in.kind.size() != rows || in.labels.size() != rows || in.lse.size() != rows || in.teacher_lse.size() != rows ||
      in.weight.size() != rows) {
    throw InternalError("gpu reference compare: per-row arrays do not match the shard's rows");
  }
  std::memcpy(ws.host_in<int>(ws.layout.flags), in.kind.data(), rows * sizeof(int));
  std::memcpy(ws.host_in<std::int64_t>(ws.layout.labels), in.labels.data(), rows * sizeof(std::int64_t));
  std::memcpy(ws.host_in<double>(ws.layout.lse), in.lse.data(), rows * sizeof(double));
  std::memcpy(ws.host_in<double>(ws.layout.teacher_lse), in.teacher_lse.data(), rows * sizeof(double));
  std::memcpy(ws.host_in<double>(ws.layout.weight), in.weight.data(), rows * sizeof(double));
  const DeviceRowModel model = in.expected != nullptr ? DeviceRowModel{} : row_model(c);
  if (model.row_coefficients) {
    if (in.coef_a.size() != rows || in.coef_b.size() != rows || in.row_scale.size() != rows) {
      throw InternalError("gpu reference compare: per-row coefficients do not match the shard's rows");
    }
    std::memcpy(ws.host_in<double>(ws.layout.coef_a), in.coef_a.data(), rows * sizeof(double));
    std::memcpy(ws.host_in<double>(ws.layout.coef_b), in.coef_b.data(), rows * sizeof(double));
    std::memcpy(ws.host_in<double>(ws.layout.row_scale), in.row_scale.data(), rows * sizeof(double));
  }
  ws.upload_inputs(ws.layout.bytes);
  ReferenceCompareArgs a{};
  a.student = oracle.inputs.student.as<void>();
  a.teacher = oracle.inputs.teacher.as<void>();
  a.grad = output.grad.as<void>();
  a.rows = oracle.rows;
  a.cols = oracle.cols;
  a.begin = oracle.begin;
  a.kind = ws.device_in<int>(ws.layout.flags);
  a.label = ws.device_in<std::int64_t>(ws.layout.labels);
  a.lse = ws.device_in<double>(ws.layout.lse);
  a.teacher_lse = ws.device_in<double>(ws.layout.teacher_lse);
  a.weight = ws.device_in<double>(ws.layout.weight);
  a.partials = lse_from_partials ? ws.d_partials.as<double>() : nullptr;
  a.kd = model.teacher;
  a.row_coefficients = model.row_coefficients;
  if (model.row_coefficients) {
    a.coef_a = ws.device_in<double>(ws.layout.coef_a);
    a.coef_b = ws.device_in<double>(ws.layout.coef_b);
    a.row_scale = ws.device_in<double>(ws.layout.row_scale);
    a.entropy_coef = model.entropy_coef;
  }
  a.temperature = model.temperature;
  a.inverse_temperature = 1.0 / model.temperature;
  a.kd_grad_scale = model.teacher_grad_scale;
  a.softcap = model.softcap;
  a.z_loss_weight = model.z_loss_weight;
  a.q_on = model.q_on;
  a.q_off = model.q_off;
  a.atol = in.atol;
  a.rtol = in.rtol;
  a.max_ulp = in.max_ulp;
  a.dtype = static_cast<int>(oracle.type);
  a.framework_scale = in.framework_scale;
  a.quantum = in.quantum;
  a.grad_scale = in.grad_scale;
  a.smallest_normal = in.smallest_normal;
  a.expected = in.expected;
  a.slack = in.slack;
  ws.compare_start.record(ws.stream.get());
  reference_compare(oracle.type, a, ws.d_out.as<RowComparison>(), ws.stream.get());
  LV_CUDA(cudaGetLastError());
  ws.compare_end.record(ws.stream.get());
  ws.download_outputs(rows * sizeof(RowComparison));
  ws.compare_pending = true;
}

std::span<const RowComparison> gpu_reference_compare_wait(OracleShard& oracle) {
  LV_CUDA(cudaSetDevice(oracle.device));
  ReferenceWorkspace& ws = oracle.workspace;
  if (!ws.compare_pending) throw InternalError("gpu reference compare: waited for before it was launched");
  ws.stream.sync();
  ws.compare_pending = false;
  if (std::getenv("LOSSVERIFY_TRACE") != nullptr) {
    ReferenceWorkspace::trace_kernel("gpu reference compare", ws.compare_start, ws.compare_end);
  }
  return {ws.h_out.as<const RowComparison>(), static_cast<std::size_t>(oracle.rows)};
}

}  // namespace lossverify::cuda
