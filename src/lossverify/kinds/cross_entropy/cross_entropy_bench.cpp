#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/bench_check.hpp"
#include "lossverify/impl/cuda/bench_timing.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_kernels.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify::cuda {

using bench_timing::Buffer;
using bench_timing::time_ms;

nlohmann::json bench(const BenchOptions& o) {
  const bench_timing::BenchDevice gpu(o.device);
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  const std::int64_t rows = o.tokens;
  const std::int64_t cols = o.vocab;  // the rank's shard width
  const std::size_t element = dtype_size(o.dtype);
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * element;
  const StorageType type = storage_of(o.dtype);

  // 1. The bandwidth ceiling: a device-to-device copy, bytes read plus bytes written.
  const double copy_tb_s = bench_timing::copy_bandwidth_tb_per_s(o.repeats, stream);

  // 2. Inputs: two sets from different seeds (rotated, so L2 never holds the next launch's input).
  nlohmann::json case_json = {{"name", "bench"},
                              {"shape", {{"tokens", rows}, {"vocab", cols}}},
                              {"loss", {{"label_smoothing", o.label_smoothing}}},
                              {"inputs", {{"seed", 7}, {"dtype", std::string(to_string(o.dtype))}, {"scale", 2.0}}}};
  const Case c = parse_case(case_json, "<bench>");
  const std::vector<int> ones(static_cast<std::size_t>(rows), 1);
  Buffer d_one(ones.size() * 4), grad(bytes);
  LV_CUDA(cudaMemcpy(d_one.p, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  const bench_timing::BenchLogits logits(type, rows, cols, element, stream);
  const InputSource inputs(c);
  std::vector<std::int64_t> target(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) target[static_cast<std::size_t>(i)] = inputs.label(i);
  std::vector<float> weight(static_cast<std::size_t>(rows), 1.0f / static_cast<float>(rows));
  Buffer d_target(target.size() * 8), d_weight(weight.size() * 4), d_stats(static_cast<std::size_t>(rows) * 16),
      d_max(static_cast<std::size_t>(rows) * 4), d_log_sum(static_cast<std::size_t>(rows) * 4);
  LV_CUDA(cudaMemcpy(d_target.p, target.data(), target.size() * 8, cudaMemcpyHostToDevice));
  LV_CUDA(cudaMemcpy(d_weight.p, weight.data(), weight.size() * 4, cudaMemcpyHostToDevice));
  const float alpha = static_cast<float>(o.label_smoothing);
  const float v = static_cast<float>(c.shape.vocab);
  CrossEntropyConstants k{
      1.0f - alpha + alpha / v, alpha / v, 1.0f - alpha + alpha / v, alpha / v, 0.0f, 0.0f, 0, 0, 0};
  auto args_for = [&](int i) {
    return GradArgs{logits.at(i),
                    grad.p,
                    rows,
                    cols,
                    static_cast<std::int64_t*>(d_target.p),
                    static_cast<int*>(d_one.p),
                    static_cast<int*>(d_one.p),
                    static_cast<float*>(d_max.p),
                    static_cast<float*>(d_log_sum.p),
                    static_cast<float*>(d_weight.p)};
  };

  // 3. The kernels.
  nlohmann::json result;
  double kernel_ms = 0.0;
  double floor_bytes_per_logit = 4.0 / 2.0 * static_cast<double>(element);  // read once, write once
  std::string kernel_name = "stats + grad (two kernels around the all-reduce)";
  if (o.tp == 1) {
    const int cluster = fused_cluster_size(type, k, logits.at(0), grad.p, cols);
    kernel_name = cluster > 0 ? "fused, row-resident (clusters of " + std::to_string(cluster) + " CTAs)"
                              : "fused, two passes (the row kept in L2)";
    kernel_ms = time_ms(o.repeats, stream, [&](int i) {
      cross_entropy_fused(type, args_for(i), k, static_cast<float*>(d_stats.p), stream);
    });
  } else {
    // The two kernels around the all-reduce; the all-reduce itself is not timed here. The grad kernel
    // takes the statistics pass 1 wrote (the row max and log-sum of a TP=1 run are a stand-in of the
    // same cost).
    floor_bytes_per_logit = 3.0 * static_cast<double>(element);
    kernel_ms = time_ms(o.repeats, stream, [&](int i) {
      GradArgs a = args_for(i);
      StatsArgs s{a.logits, rows, cols, a.target_column, a.active};
      cross_entropy_stats(type, s, k, static_cast<float*>(d_stats.p), stream);
      cross_entropy_grad(type, a, k, stream);
    });
  }
  const double floor_ms = floor_bytes_per_logit * static_cast<double>(rows * cols) / (copy_tb_s * 1e12) * 1e3;

  // 4. Correctness of the timed kernel on fresh inputs: sampled rows against the float64 reference.
  cross_entropy_fused(type, args_for(0), k, static_cast<float*>(d_stats.p), stream);
  LV_CUDA(cudaStreamSynchronize(stream));
  const LossReference reference(c, inputs);
  // The kernel's weight is 1/rows; the reference's 1/N_v with N_v = rows (no ignored tokens).
  const double worst_ulp = bench_check::worst_ulp_beyond_floor(
      grad.p, rows, cols, o.dtype, inputs, reference,
      [&](std::int64_t, const ReferenceToken&) { return 1e-6 / static_cast<double>(rows); });

  result = {{"device", prop.name},
            {"multiprocessors", prop.multiProcessorCount},
            {"shape", {{"tokens", rows}, {"vocab_per_rank", cols}}},
            {"dtype", std::string(to_string(o.dtype))},
            {"tp", o.tp},
            {"label_smoothing", o.label_smoothing},
            {"copy_tb_per_s", copy_tb_s},
            {"floor_bytes_per_logit", floor_bytes_per_logit},
            {"floor_ms", floor_ms},
            {"kernel", kernel_name},
            {"kernel_ms", kernel_ms},
            {"percent_of_floor", 100.0 * floor_ms / kernel_ms},
            {"check",
             {{"rows_sampled", bench_check::kSampledRows},
              {"worst_ulp_beyond_atol", worst_ulp},
              {"pass", worst_ulp <= 1.0}}}};
  return result;
}

}  // namespace lossverify::cuda
