// `lossverify bench --loss router`: the router kind's CUDA kernels on one scope of T tokens x E experts (float32
// logits, top-8, aux 0.01, z-loss 0.001): pass 1 routes and counts, pass 2 writes the loss terms and the gradient,
// against the memory floor of the bytes they must move, 12 T E (the logits read twice, since the counts must exist
// before any gradient, and the gradient written). The counts' trip to the host between the passes (an all-reduce
// in a run) is not timed. Checked on sampled rows against the float64 definitions (router_definitions.hpp), with
// counts the check routes itself from its own reading of the logits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/bench_timing.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_kernels.hpp"

namespace lossverify::cuda {

namespace {

constexpr int kTopK = 8;
constexpr double kAux = 0.01, kZ = 0.001;

// The float64 scope of the check: counts c_e of the top-8 over every token, from its own reading, and the tokens
// whose 8th and 9th scores lie within 1e-6 of each other (MOE.md section 3: either routing is right for them).
struct CheckScope {
  std::vector<double> counts;
  std::int64_t ties = 0;
};
CheckScope route_for_check(const InputSource& inputs, std::int64_t rows, std::int64_t experts) {
  CheckScope scope{std::vector<double>(static_cast<std::size_t>(experts), 0.0), 0};
  std::vector<double> z(static_cast<std::size_t>(experts)), s(z.size());
  for (std::int64_t t = 0; t < rows; ++t) {
    inputs.logits(t, 0, experts, z.data());
    router::scores(router::Score::softmax, z, s);
    const router::TopK top = router::top_k(s, kTopK);
    for (int e : top.experts) scope.counts[static_cast<std::size_t>(e)] += 1.0;
    if (router::ties(top)) ++scope.ties;
  }
  return scope;
}

}  // namespace

nlohmann::json bench_router(const BenchOptions& o) {
  const bench_timing::BenchDevice gpu(o.device);
  const cudaDeviceProp& prop = gpu.prop;
  cudaStream_t stream = gpu.stream;
  const std::int64_t rows = o.tokens, experts = o.vocab;
  const auto width = static_cast<std::size_t>(experts) + 1;
  const double copy_tb_s = bench_timing::copy_bandwidth_tb_per_s(o.repeats, stream);
  const nlohmann::json case_json = {{"name", "bench-router"},
                                    {"shape", {{"tokens", rows}, {"vocab", experts}}},
                                    {"inputs", {{"seed", 7}, {"dtype", "fp32"}, {"scale", 2.0}}}};
  const Case c = parse_case(case_json, "<bench>");  // the generator's case (cross-entropy's: the same logits)
  const InputSource inputs(c);
  const bench_timing::BenchLogits logits(StorageType::fp32, rows, experts, 4, stream);
  const std::vector<int> ones(static_cast<std::size_t>(rows), 1), zeros(static_cast<std::size_t>(rows), 0);
  const std::vector<float> unit(static_cast<std::size_t>(rows), 1.0f);
  bench_timing::Buffer d_one(ones.size() * 4), d_zero(zeros.size() * 4), d_unit(unit.size() * 4);
  bench_timing::Buffer grad(static_cast<std::size_t>(rows * experts) * 4), d_scope(width * 4);
  bench_timing::Buffer d_weights(static_cast<std::size_t>(experts) * 4), d_none(static_cast<std::size_t>(experts) * 4);
  bench_timing::Buffer d_terms(static_cast<std::size_t>(rows) * 2 * 4);
  LV_CUDA(cudaMemcpy(d_one.p, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  LV_CUDA(cudaMemcpy(d_zero.p, zeros.data(), zeros.size() * 4, cudaMemcpyHostToDevice));
  LV_CUDA(cudaMemcpy(d_unit.p, unit.data(), unit.size() * 4, cudaMemcpyHostToDevice));
  LV_CUDA(cudaMemset(d_none.p, 0, static_cast<std::size_t>(experts) * 4));
  auto route = [&](int i) {
    LV_CUDA(cudaMemsetAsync(d_scope.p, 0, width * 4, stream));
    router_route(RouterRouteArgs{static_cast<const float*>(logits.at(i)), rows, 1, static_cast<int>(experts), kTopK,
                                 d_one.as<int>(), nullptr, d_scope.as<float>(), nullptr},
                 stream);
  };
  // The weights a c_e from set 0's counts (every set gets them: the timing does not depend on their values).
  route(0);
  std::vector<float> scope(width);
  LV_CUDA(cudaMemcpy(scope.data(), d_scope.p, width * 4, cudaMemcpyDeviceToHost));
  const auto tokens = static_cast<float>(rows);
  const float aux_scale = static_cast<float>(kAux) * static_cast<float>(experts) / (kTopK * tokens * tokens);
  std::vector<float> weights(static_cast<std::size_t>(experts));
  for (std::size_t e = 0; e < weights.size(); ++e) weights[e] = aux_scale * scope[e];
  LV_CUDA(cudaMemcpy(d_weights.p, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
  auto gradient = [&](int i) {
    router_grad(
        RouterGradArgs{static_cast<const float*>(logits.at(i)), grad.as<float>(), rows, 1, static_cast<int>(experts), 0,
                       d_one.as<int>(), d_unit.as<float>(), d_zero.as<int>(), d_weights.as<float>(), d_none.as<float>(),
                       static_cast<float>(kZ) / tokens, 1.0f, 1.0f, 1.0f, d_terms.as<float>()},
        stream);
  };
  const double kernel_ms = bench_timing::time_ms(o.repeats, stream, [&](int i) {
    route(i);
    gradient(i);
  });
  const double route_ms = bench_timing::time_ms(o.repeats, stream, [&](int i) { route(i); });
  const double gradient_ms = bench_timing::time_ms(o.repeats, stream, [&](int i) { gradient(i); });
  const double floor_bytes_per_logit = 12.0;
  const double floor_ms = floor_bytes_per_logit * static_cast<double>(rows * experts) / (copy_tb_s * 1e12) * 1e3;

  // Correctness of set 0's gradient on sampled rows: the float64 definitions with the check's own counts; a tie
  // token may move one count between its 8th and 9th experts (MOE.md section 3), which widens every element by
  // a p (2 + 2 p) per tie at most (|dc| has two ones).
  gradient(0);
  LV_CUDA(cudaStreamSynchronize(stream));
  const CheckScope check = route_for_check(inputs, rows, experts);
  const double a =
      kAux * static_cast<double>(experts) / (kTopK * static_cast<double>(rows) * static_cast<double>(rows));
  std::vector<double> z(static_cast<std::size_t>(experts)), expected(z.size()), z_grad(z.size()), p(z.size());
  std::vector<float> got(z.size());
  double worst = 0.0;
  std::int64_t sampled = 0;
  for (std::int64_t t = 0; t < rows; t += std::max<std::int64_t>(rows / 64, 1), ++sampled) {
    inputs.logits(t, 0, experts, z.data());
    LV_CUDA(cudaMemcpy(got.data(), grad.as<float>() + t * experts, got.size() * 4, cudaMemcpyDeviceToHost));
    router::aux_gradient(router::Score::softmax, z, check.counts, a, expected);
    router::z_loss_gradient(z, kZ / static_cast<double>(rows), z_grad);
    router::scores(router::Score::softmax, z, p);
    double largest = 0.0;
    for (std::size_t e = 0; e < z.size(); ++e) largest = std::max(largest, std::fabs(expected[e] + z_grad[e]));
    for (std::size_t e = 0; e < z.size(); ++e) {
      const double tolerance = 1e-5 * largest + static_cast<double>(check.ties) * a * p[e] * (2.0 + 2.0 * p[e]);
      worst = std::max(worst, std::fabs(static_cast<double>(got[e]) - (expected[e] + z_grad[e])) / tolerance);
    }
  }
  const nlohmann::json result = {{"device", prop.name},
                                 {"multiprocessors", prop.multiProcessorCount},
                                 {"loss", "router (aux 0.01, top-8, z-loss 0.001, one scope), forward and backward"},
                                 {"shape", {{"tokens", rows}, {"experts", experts}}},
                                 {"dtype", "fp32"},
                                 {"tp", 1},
                                 {"copy_tb_per_s", copy_tb_s},
                                 {"floor_bytes_per_logit", floor_bytes_per_logit},
                                 {"floor_ms", floor_ms},
                                 {"kernel", "route and count + loss terms and gradient"},
                                 {"kernel_ms", kernel_ms},
                                 {"route_ms", route_ms},
                                 {"gradient_ms", gradient_ms},
                                 {"percent_of_floor", 100.0 * floor_ms / kernel_ms},
                                 {"check",
                                  {{"rows_sampled", sampled},
                                   {"tie_tokens", check.ties},
                                   {"worst_error_over_tolerance", worst},
                                   {"pass", worst <= 1.0}}}};
  return result;
}

}  // namespace lossverify::cuda
