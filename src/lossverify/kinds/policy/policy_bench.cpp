// `lossverify bench --loss policy`: the policy kind's CUDA kernels on a trainer's log-prob and entropy pass
// (objective logprob, l = -lambda - 0.01 H, token-mean), forward and backward, against the memory floor of
// the bytes they move: the statistics pass reads the logits, the gradient pass reads them again and writes
// the gradient (3 x the element size per logit). Checked on sampled rows against the float64 reference.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/bench_check.hpp"
#include "lossverify/impl/cuda/bench_timing.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/policy/policy_kernels.hpp"
#include "lossverify/kinds/policy/policy_protocol.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify::cuda {

using bench_timing::Buffer;
using bench_timing::time_ms;

nlohmann::json bench_policy(const BenchOptions& o) {
  const bench_timing::BenchDevice gpu(o.device);
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  const std::int64_t rows = o.tokens, cols = o.vocab;
  const std::size_t element = dtype_size(o.dtype);
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * element;
  const StorageType type = storage_of(o.dtype);
  const double copy_tb_s = bench_timing::copy_bandwidth_tb_per_s(o.repeats, stream);

  constexpr double kEntropyCoef = 0.01;
  const nlohmann::json case_json = {
      {"name", "bench-policy"},
      {"shape", {{"tokens", rows}, {"vocab", cols}}},
      {"loss", {{"kind", "policy"}, {"objective", "logprob"}, {"entropy_coef", kEntropyCoef}}},
      {"inputs", {{"seed", 7}, {"dtype", std::string(to_string(o.dtype))}, {"scale", 2.0}}}};
  const Case c = parse_case(case_json, "<bench>");
  const InputSource inputs(c);
  std::vector<std::int64_t> target(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) target[static_cast<std::size_t>(i)] = inputs.label(i);
  const std::vector<int> ones(static_cast<std::size_t>(rows), 1);
  Buffer d_one(ones.size() * 4), d_target(target.size() * 8), grad(bytes);
  LV_CUDA(cudaMemcpy(d_one.p, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  LV_CUDA(cudaMemcpy(d_target.p, target.data(), target.size() * 8, cudaMemcpyHostToDevice));
  const bench_timing::BenchLogits logits(type, rows, cols, element, stream);
  auto args_for = [&](int i) {
    PolicyKernelArgs a;
    a.logits = logits.at(i);
    a.grad = grad.p;
    a.rows = rows;
    a.cols = cols;
    a.active = d_one.as<int>();
    a.target = d_target.as<std::int64_t>();
    a.inverse_temperature = 1.0f;
    return a;
  };
  // The gradient rows of set a, as the protocol makes them for objective logprob: a = -1, c = c_H, shift = H.
  Buffer d_stats(static_cast<std::size_t>(rows) * PolicyLocalStats::kFloats * 4);
  Buffer d_rows(static_cast<std::size_t>(rows) * PolicyGradRow::kFloats * 4);
  policy_local_stats(type, args_for(0), d_stats.as<float>(), stream);
  std::vector<float> stats(static_cast<std::size_t>(rows) * PolicyLocalStats::kFloats);
  LV_CUDA(cudaMemcpy(stats.data(), d_stats.p, stats.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<float> grad_rows(static_cast<std::size_t>(rows) * PolicyGradRow::kFloats);
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* s = &stats[static_cast<std::size_t>(i) * PolicyLocalStats::kFloats];
    const float log_s = std::log(s[1]);
    const float entropy = log_s - s[2] / s[1];
    const float row[PolicyGradRow::kFloats] = {s[0],
                                               log_s,
                                               -1.0f,
                                               0.0f,
                                               static_cast<float>(kEntropyCoef),
                                               entropy,
                                               1.0f / static_cast<float>(rows),
                                               static_cast<float>(target[static_cast<std::size_t>(i)]),
                                               -1.0f};
    std::copy(row, row + PolicyGradRow::kFloats, grad_rows.begin() + i * PolicyGradRow::kFloats);
  }
  LV_CUDA(cudaMemcpy(d_rows.p, grad_rows.data(), grad_rows.size() * 4, cudaMemcpyHostToDevice));

  const double kernel_ms = time_ms(o.repeats, stream, [&](int i) {
    const PolicyKernelArgs a = args_for(i);
    policy_local_stats(type, a, d_stats.as<float>(), stream);
    policy_gradient(type, a, d_rows.as<float>(), stream);
  });
  const double floor_bytes_per_logit = 3.0 * static_cast<double>(element);
  const double floor_ms = floor_bytes_per_logit * static_cast<double>(rows * cols) / (copy_tb_s * 1e12) * 1e3;

  // Correctness of set a's gradient on sampled rows against the float64 reference (token weight 1/rows).
  policy_gradient(type, args_for(0), d_rows.as<float>(), stream);
  LV_CUDA(cudaStreamSynchronize(stream));
  const LossReference reference(c, inputs);
  const double worst_ulp = bench_check::worst_ulp_beyond_floor(
      grad.p, rows, cols, o.dtype, inputs, reference, [&](std::int64_t row, const ReferenceToken& token) {
        return 1e-6 * token.weight * reference.row().gradient_scale(row, token.stats).value_or(1.0);
      });
  const nlohmann::json result = {{"device", prop.name},
                                 {"multiprocessors", prop.multiProcessorCount},
                                 {"loss", "policy (objective logprob: log-prob and entropy, forward and backward)"},
                                 {"shape", {{"tokens", rows}, {"vocab_per_rank", cols}}},
                                 {"dtype", std::string(to_string(o.dtype))},
                                 {"tp", o.tp},
                                 {"copy_tb_per_s", copy_tb_s},
                                 {"floor_bytes_per_logit", floor_bytes_per_logit},
                                 {"floor_ms", floor_ms},
                                 {"kernel", "statistics (one online pass) + gradient"},
                                 {"kernel_ms", kernel_ms},
                                 {"percent_of_floor", 100.0 * floor_ms / kernel_ms},
                                 {"check",
                                  {{"rows_sampled", bench_check::kSampledRows},
                                   {"worst_ulp_beyond_atol", worst_ulp},
                                   {"pass", worst_ulp <= 1.0}}}};
  return result;
}

}  // namespace lossverify::cuda
