#include "lossverify/impl/cuda/gpu_reference.hpp"

#include <cmath>

#include "lossverify/core/stage_trace.hpp"
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

}  // namespace

std::vector<double> gpu_reference_partials(const DeviceShard& shard, const Case& c, const std::vector<std::int64_t>& labels,
                                           const std::vector<int>& valid) {
  StageTrace trace("gpu reference partials");
  trace.mark("upload");
  LV_CUDA(cudaSetDevice(shard.device));
  Stream stream;
  DeviceBytes d_valid = upload(valid, stream.get());
  DeviceBytes d_labels = upload(labels, stream.get());
  DeviceBytes d_out(static_cast<std::size_t>(shard.rows) * 8 * sizeof(double));  // the kernel writes every row
  ReferencePartialArgs a{};
  a.student = shard.student.as<void>();
  a.teacher = shard.teacher.as<void>();
  a.rows = shard.rows;
  a.cols = shard.cols;
  a.begin = shard.begin;
  a.valid = d_valid.as<int>();
  a.label = d_labels.as<std::int64_t>();
  a.kd = c.loss.kind == LossKind::kd;
  a.inverse_temperature = 1.0 / c.loss.temperature;
  a.softcap = c.loss.softcap;
  target_weights(c, a.q_on, a.q_off);
  trace.mark("kernel");
  reference_partials(shard.type, a, d_out.as<double>(), stream.get());
  LV_CUDA(cudaGetLastError());
  if (trace.enabled()) stream.sync();  // the kernel's own time
  trace.mark("download");
  std::vector<double> partials = download<double>(d_out, static_cast<std::size_t>(shard.rows) * 8, stream.get());
  trace.mark("free");
  return partials;
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

std::vector<RowComparison> gpu_reference_compare(const DeviceShard& shard, const Case& c, const GpuCompareInputs& in) {
  StageTrace trace("gpu reference compare");
  trace.mark("upload");
  LV_CUDA(cudaSetDevice(shard.device));
  Stream stream;
  DeviceBytes d_kind = upload(in.kind, stream.get());
  DeviceBytes d_labels = upload(in.labels, stream.get());
  DeviceBytes d_lse = upload(in.lse, stream.get());
  DeviceBytes d_teacher_lse = upload(in.teacher_lse, stream.get());
  DeviceBytes d_weight = upload(in.weight, stream.get());
  DeviceBytes d_out(static_cast<std::size_t>(shard.rows) * sizeof(RowComparison));
  ReferenceCompareArgs a{};
  a.student = shard.student.as<void>();
  a.teacher = shard.teacher.as<void>();
  a.grad = shard.grad.as<void>();
  a.rows = shard.rows;
  a.cols = shard.cols;
  a.begin = shard.begin;
  a.kind = d_kind.as<int>();
  a.label = d_labels.as<std::int64_t>();
  a.lse = d_lse.as<double>();
  a.teacher_lse = d_teacher_lse.as<double>();
  a.weight = d_weight.as<double>();
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
  trace.mark("kernel");
  reference_compare(shard.type, a, d_out.as<RowComparison>(), stream.get());
  LV_CUDA(cudaGetLastError());
  if (trace.enabled()) stream.sync();  // the kernel's own time
  trace.mark("download");
  std::vector<RowComparison> rows = download<RowComparison>(d_out, static_cast<std::size_t>(shard.rows), stream.get());
  trace.mark("free");
  return rows;
}

}  // namespace lossverify::cuda
