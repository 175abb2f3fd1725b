// `lossverify bench --loss head`: lossverify's own LM head and cross-entropy (the CUDA backend's code, chunk by
// chunk, kind_api/cuda_stage.hpp) at N x H x V, forward and backward, timed with events, beside the three plain
// cuBLAS products of the same shapes (bf16 in, float32 accumulation) timed in the same process: the rate counts
// 6 N H V flops whatever the design. The device memory it holds beyond its inputs h and W is measured against one
// chunk's logits plus float32 dh and dW, and dh and the loss of sampled tokens are checked against float64 sums
// written from the definitions here (the whole problem is too large for the host oracle).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/checks/oracle.hpp"
#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/bench_timing.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/impl/cuda/cuda_rank_run.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"
#include "lossverify/kinds/lm_head/lm_head_cublas.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify::cuda {

namespace {

using bench_timing::Buffer;
using bench_timing::fill_normal;
using bench_timing::time_ms;

Case head_bench_case(const BenchOptions& o) {
  const nlohmann::json case_json = {
      {"name", "bench-head"},
      {"shape", {{"tokens", o.tokens}, {"vocab", o.vocab}}},
      {"loss", {{"label_smoothing", o.label_smoothing}}},
      {"stage", {{"kind", "lm_head"}, {"hidden", o.hidden}, {"chunks", o.chunks}}},
      {"inputs", {{"seed", 7}, {"dtype", std::string(to_string(o.dtype))}, {"scale", 2.0}}}};
  return parse_case(case_json, "<bench --loss head>");
}

// The three products of the head alone, each timed: u = h W^T (dtype out), dh = g W (dtype out), dW = g^T h
// (float32 out), float32 accumulation, on buffers of their own.
nlohmann::json time_products(const BenchOptions& o, cudaStream_t stream) {
  const std::int64_t n = o.tokens, h = o.hidden, v = o.vocab;
  const cudaDataType t = o.dtype == DType::fp32 ? CUDA_R_32F : o.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const StorageType type = storage_of(o.dtype);
  const std::size_t e = dtype_size(o.dtype);
  Buffer hidden(static_cast<std::size_t>(n * h) * e), weight(static_cast<std::size_t>(v * h) * e);
  Buffer logits(static_cast<std::size_t>(n * v) * e), dh(static_cast<std::size_t>(n * h) * e);
  Buffer dw(static_cast<std::size_t>(v * h) * sizeof(float));
  fill_normal(hidden.p, type, n, h, 11, 1.0, stream);
  fill_normal(weight.p, type, v, h, 12, 2.0 / std::sqrt(static_cast<double>(h)), stream);
  fill_normal(logits.p, type, n, v, 13, 1e-5, stream);  // g: gradients are small
  const CublasHandle cublas(stream);
  const cublasHandle_t handle = cublas.get();
  const float one = 1.0f, zero = 0.0f;
  const auto gemm = [&](cublasOperation_t a_op, cublasOperation_t b_op, std::int64_t m, std::int64_t nn, std::int64_t k,
                        const void* a, std::int64_t lda, const void* b, std::int64_t ldb, void* c, cudaDataType c_type,
                        std::int64_t ldc) {
    check_cublas(
        cublas_library().gemm_ex(handle, a_op, b_op, static_cast<int>(m), static_cast<int>(nn), static_cast<int>(k),
                                 &one, a, t, static_cast<int>(lda), b, t, static_cast<int>(ldb), &zero, c, c_type,
                                 static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  };
  nlohmann::json r;
  r["forward_ms"] = time_ms(o.repeats, stream, [&](int) {
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, weight.p, h, hidden.p, h, logits.p, t, v);
  });
  r["dh_ms"] = time_ms(o.repeats, stream,
                       [&](int) { gemm(CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, weight.p, h, logits.p, v, dh.p, t, h); });
  r["dw_ms"] = time_ms(o.repeats, stream, [&](int) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, hidden.p, h, logits.p, v, dw.p, CUDA_R_32F, h);
  });
  r["ms"] = r["forward_ms"].get<double>() + r["dh_ms"].get<double>() + r["dw_ms"].get<double>();
  return r;
}

std::size_t local_row(const RankOutput& out, std::int64_t token) {
  for (std::size_t i = 0; i < out.assignment.rows.size(); ++i) {
    if (out.assignment.rows[i].token == token) return i;
  }
  throw InternalError("bench --loss head: token " + std::to_string(token) + " is not among the rank's rows");
}

double widened(const std::vector<std::byte>& values, DType dtype, std::size_t at) {
  double x = 0.0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    x = static_cast<double>(static_cast<float>(reinterpret_cast<const T*>(values.data())[at]));
  });
  return x;
}

// dh and the loss of a few tokens in float64 from the definitions: u = h W^T over the whole row, g = (softmax(u) -
// q) / valid tokens with q the smoothed target (PyTorch's convention, alpha), dh = g W; W regenerated row by row.
nlohmann::json check_sampled_tokens(const Case& c, const InputSource& inputs, const RankOutput& out, double alpha) {
  const HeadOptions& o = head_options(c.loss);
  const std::int64_t h = o.hidden, v = c.shape.vocab;
  const auto hs = static_cast<std::size_t>(h), vs = static_cast<std::size_t>(v);
  std::vector<std::int64_t> tokens;
  for (const std::int64_t t : {std::int64_t{0}, c.shape.tokens / 3, 2 * c.shape.tokens / 3, c.shape.tokens - 1}) {
    if (inputs.is_valid(t)) tokens.push_back(t);
  }
  const std::size_t k = tokens.size();
  std::vector<double> x(k * hs), u(k * vs), dh(k * hs, 0.0);
  for (std::size_t j = 0; j < k; ++j) {
    inputs.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(tokens[j]), 0, h, o.hidden_scale,
                        &x[j * hs]);
  }
  const double w_scale = head_weight_scale(c);
  const auto each_weight_row = [&](auto&& use) {
#pragma omp parallel
    {
      std::vector<double> w(hs);
#pragma omp for schedule(static)
      for (std::int64_t col = 0; col < v; ++col) {
        inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(col), 0, h, w_scale, w.data());
        use(static_cast<std::size_t>(col), w);
      }
    }
  };
  each_weight_row([&](std::size_t col, const std::vector<double>& w) {
    for (std::size_t j = 0; j < k; ++j) {
      double s = 0.0;
      for (std::size_t i = 0; i < hs; ++i) s += x[j * hs + i] * w[i];
      u[j * vs + col] = s;
    }
  });
  // u becomes g, row by row; the loss of each row on the way.
  const double weight = 1.0 / static_cast<double>(inputs.valid_tokens());
  double worst_loss = 0.0;
  for (std::size_t j = 0; j < k; ++j) {
    double* row = &u[j * vs];
    double m = -INFINITY, sum = 0.0, mean = 0.0;
    for (std::size_t col = 0; col < vs; ++col) m = std::max(m, row[col]);
    for (std::size_t col = 0; col < vs; ++col) sum += std::exp(row[col] - m), mean += row[col] / static_cast<double>(v);
    const double lse = m + std::log(sum);
    const auto y = static_cast<std::size_t>(inputs.label(tokens[j]));
    const double loss = lse - (1.0 - alpha) * row[y] - alpha * mean;
    const double got = out.token_loss[local_row(out, tokens[j])];
    worst_loss = std::max(worst_loss, std::fabs(got - loss) / std::fabs(loss));
    for (std::size_t col = 0; col < vs; ++col) {
      const double q = alpha / static_cast<double>(v) + (col == y ? 1.0 - alpha : 0.0);
      row[col] = (std::exp(row[col] - lse) - q) * weight;
    }
  }
#pragma omp parallel
  {
    std::vector<double> w(hs), mine(k * hs, 0.0);
#pragma omp for schedule(static)
    for (std::int64_t col = 0; col < v; ++col) {
      inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(col), 0, h, w_scale, w.data());
      for (std::size_t j = 0; j < k; ++j) {
        const double g = u[j * vs + static_cast<std::size_t>(col)];
        for (std::size_t i = 0; i < hs; ++i) mine[j * hs + i] += g * w[i];
      }
    }
#pragma omp critical
    for (std::size_t i = 0; i < mine.size(); ++i) dh[i] += mine[i];
  }
  double diff = 0.0, norm = 0.0;
  for (std::size_t j = 0; j < k; ++j) {
    const std::size_t local = local_row(out, tokens[j]);
    for (std::size_t i = 0; i < hs; ++i) {
      const double got = widened(out.stage_grads[0], out.dtype, local * hs + i);
      diff += (got - dh[j * hs + i]) * (got - dh[j * hs + i]);
      norm += dh[j * hs + i] * dh[j * hs + i];
    }
  }
  const double relative = std::sqrt(diff / norm);
  // bf16 operands land between 1e-3 and 1e-2 in this norm (the head rounds g and dh to the dtype).
  return {{"tokens_sampled", k},
          {"dh_relative_l2", relative},
          {"loss_worst_relative", worst_loss},
          {"pass", relative < 2e-2 && worst_loss < 1e-2}};
}

// The head's GPU oracle on the same outputs, every element of dh, dW and db and every check of the rank, timed from
// generating its own h and W to the last judgement (kinds/lm_head/lm_head_oracle.cpp): the goal is 2 s at
// N = 16384, H = 4096, V = 128256 on one H200.
nlohmann::json judge_on_the_gpu(const Case& c, const InputSource& inputs, const RankOutput& out, OwnedRankGroups& owned,
                                Communicator& world, int device) {
  const auto start = std::chrono::steady_clock::now();
  const CudaOracleFactory factory = cuda_stage_oracle_factory(c);
  if (factory == nullptr) throw InternalError("bench --loss head: the head has no GPU oracle for this kind");
  std::unique_ptr<CudaKindOracle> own = factory(c, inputs, out.assignment, device);
  LV_CUDA(cudaDeviceSynchronize());
  const auto generated = std::chrono::steady_clock::now();
  const std::unique_ptr<Oracle> oracle = own->judge(out, grad_judgement(c, inputs.valid_tokens(), out.dtype));
  RankGroups groups = owned.view();
  const std::vector<CheckResult> checks = verify_rank(c, out, *oracle, groups, world, nullptr, nullptr);
  const auto end = std::chrono::steady_clock::now();
  nlohmann::json verdicts = nlohmann::json::object();
  bool pass = true;
  for (const CheckResult& check : checks) {
    verdicts[check.name] = {{"verdict", std::string(to_string(check.verdict))}, {"margin", check.margin}};
    pass = pass && check.verdict != Verdict::fail;
  }
  const double seconds = std::chrono::duration<double>(end - start).count();
  return {{"seconds", seconds},
          {"generate_seconds", std::chrono::duration<double>(generated - start).count()},
          {"within_2_seconds", seconds <= 2.0},
          {"pass", pass},
          {"checks", verdicts}};
}

}  // namespace

nlohmann::json bench_head(const BenchOptions& o) {
  const bench_timing::BenchDevice gpu(o.device);
  const Case c = head_bench_case(o);
  const InputSource inputs(c);
  nlohmann::json r;
  r["device"] = gpu.prop.name;
  r["tokens"] = o.tokens;
  r["hidden"] = o.hidden;
  r["vocab"] = o.vocab;
  r["chunks"] = o.chunks;
  r["dtype"] = std::string(to_string(o.dtype));
  const double flops =
      6.0 * static_cast<double>(o.tokens) * static_cast<double>(o.hidden) * static_cast<double>(o.vocab);
  ThreadWorldOptions world_options;
  world_options.timeout_seconds = 600.0;
  run_thread_ranks(world_options, [&](Communicator& world) {
    OwnedRankGroups owned = make_rank_groups(world, c);
    std::size_t free_before = 0, free_after = 0, total = 0;
    LV_CUDA(cudaDeviceSynchronize());
    LV_CUDA(cudaMemGetInfo(&free_before, &total));
    CudaRankOptions options;
    options.device = o.device;
    CudaRankRun run(c, inputs, assign_rank(c, inputs.batch(), 0), owned.view(), BugSwitches{}, options);
    const double ms = time_ms(o.repeats, run.stream(), [&](int) { run.compute(); });
    ChunkPartTimes parts;
    run.compute(&parts);
    r["parts_ms"] = {
        {"forward_and_memset", parts.forward_ms}, {"kind", parts.kind_ms}, {"backward", parts.backward_ms}};
    LV_CUDA(cudaMemGetInfo(&free_after, &total));
    const double e = static_cast<double>(dtype_size(o.dtype));
    const double n = static_cast<double>(o.tokens), h = static_cast<double>(o.hidden), v = static_cast<double>(o.vocab);
    const double inputs_bytes = e * (n * h + v * h);
    const double chunk_logits = static_cast<double>(run.chunk_logit_bytes());
    const double held = static_cast<double>(free_before - free_after) - inputs_bytes;
    const double bound = chunk_logits + 4.0 * (n * h + v * h);
    r["head_ms"] = ms;
    r["head_tflops"] = flops / (ms * 1e-3) / 1e12;
    r["memory"] = {{"extra_bytes", held},
                   {"chunk_logits_bytes", chunk_logits},
                   {"logit_buffers_bytes", static_cast<double>(run.logit_buffer_bytes())},
                   {"bound_bytes", bound},
                   {"within_bound", held <= bound}};
    const RankOutput out = run.finish();
    r["check"] = check_sampled_tokens(c, inputs, out, o.label_smoothing);
    r["gpu_oracle"] = judge_on_the_gpu(c, inputs, out, owned, world, o.device);
  });
  r["products"] = time_products(o, gpu.stream);
  const double gemm_ms = r["products"]["ms"].get<double>();
  r["products"]["tflops"] = flops / (gemm_ms * 1e-3) / 1e12;
  r["percent_of_products"] = 100.0 * gemm_ms / r["head_ms"].get<double>();
  return r;
}

}  // namespace lossverify::cuda
