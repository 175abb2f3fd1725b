// CUDA backend against the same oracle as the CPU (the ggml idiom): device inputs bit-identical to the
// CPU generator, the correct kernels passing every check at several TP layouts, and the kernel-level
// catalogued bugs failing with exactly the checks the CPU gate recorded in golden/.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "lossverify/comm/nccl_communicator.hpp"
#include "lossverify/core/build_info.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_kernels.hpp"
#include "lossverify/kinds/policy/policy_kernels.hpp"
#include "lossverify/oracle/cuda/reference_kernels.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

RunResult run_on_gpu(const Case& c, const std::string& impl) {
  RunOptions options;
  options.implementation = impl;
  options.threads = 2;
  options.device = RunOptions::Device::cuda;
  return run_case(c, options);
}

std::vector<std::string> failing(const RunResult& r) {
  std::vector<std::string> names;
  for (const auto& check : r.checks) {
    if (check.verdict == Verdict::fail) names.push_back(check.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The same failing checks and, check by check, the same verdict and margins equal to `margin_tolerance`
// (relative above 1); then more(a_check, b_check) for each pair.
template <class More>
void check_same_verdicts(const RunResult& a_run, const RunResult& b_run, double margin_tolerance, More&& more) {
  CHECK(failing(b_run) == failing(a_run));
  REQUIRE(b_run.checks.size() == a_run.checks.size());
  for (std::size_t k = 0; k < a_run.checks.size(); ++k) {
    const CheckResult& a = a_run.checks[k];
    const CheckResult& b = b_run.checks[k];
    CAPTURE(a.name);
    CHECK(a.verdict == b.verdict);
    if (std::isfinite(a.margin)) {
      CHECK(std::fabs(a.margin - b.margin) <= margin_tolerance * std::max(1.0, std::fabs(a.margin)));
    } else {
      CHECK(!std::isfinite(b.margin));
    }
    more(a, b);
  }
}

}  // namespace

TEST_CASE("device_generated_logits_are_bit_identical_to_the_cpu_generator") {
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    auto j = testing::case_json(37, 1001, 1, dtype);
    j["inputs"]["distribution"] = std::string(dtype) == "fp16" ? "uniform" : "normal";
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const std::int64_t begin = 123;  // an odd first column: the second half of a Philox pair
    const std::int64_t end = 990;
    const std::int64_t rows = 37;
    std::vector<std::int64_t> counters(rows);
    std::vector<int> padding(rows, 0);
    for (std::int64_t i = 0; i < rows; ++i) counters[static_cast<std::size_t>(i)] = i;
    padding[5] = 1;  // one CP padding row
    counters[5] = (std::int64_t{3} << 32) + 17;
    const std::size_t element = dtype_size(c.inputs.dtype);
    const std::size_t bytes = static_cast<std::size_t>(rows * (end - begin)) * element;
    void *d_out = nullptr, *d_counters = nullptr, *d_padding = nullptr;
    REQUIRE(cudaMalloc(&d_out, bytes) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_counters, counters.size() * 8) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_padding, padding.size() * 4) == cudaSuccess);
    cudaMemcpy(d_counters, counters.data(), counters.size() * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(d_padding, padding.data(), padding.size() * 4, cudaMemcpyHostToDevice);
    const cuda::StorageType type = c.inputs.dtype == DType::bf16   ? cuda::StorageType::bf16
                                   : c.inputs.dtype == DType::fp16 ? cuda::StorageType::fp16
                                                                   : cuda::StorageType::fp32;
    cuda::GenerateArgs g{c.inputs.seed,
                         static_cast<int>(InputStream::student_logits),
                         static_cast<std::int64_t*>(d_counters),
                         static_cast<int*>(d_padding),
                         rows,
                         begin,
                         end,
                         static_cast<int>(c.inputs.distribution),
                         c.inputs.mean,
                         c.inputs.scale,
                         c.inputs.mean,
                         c.inputs.scale};
    cuda::generate_logits(type, g, d_out, nullptr);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<std::byte> device(bytes), host(static_cast<std::size_t>(end - begin) * element);
    cudaMemcpy(device.data(), d_out, bytes, cudaMemcpyDeviceToHost);
    for (std::int64_t i = 0; i < rows; ++i) {
      dispatch_dtype(c.inputs.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (i == 5) {
          inputs.padding_logits(3, 17, begin, end, reinterpret_cast<T*>(host.data()));
        } else {
          inputs.logits(i, begin, end, reinterpret_cast<T*>(host.data()));
        }
      });
      CAPTURE(dtype);
      CAPTURE(i);
      CHECK(std::memcmp(host.data(), device.data() + static_cast<std::size_t>(i) * host.size(), host.size()) == 0);
    }
    cudaFree(d_out);
    cudaFree(d_counters);
    cudaFree(d_padding);
  }
}

TEST_CASE("cuda_correct_implementation_passes_every_check_at_several_tp") {
  const char* cases[] = {"smoothing-pytorch", "smoothing-megatron",      "uneven-shards-v507-tp4",
                         "zloss-ignored",     "reduction-none-upstream", "softcap-gemma",
                         "underflow-gap-240", "cp-zigzag-packed",        "ga-unequal-microbatches",
                         "full-4d-layout",    "kd-tp4-temperature2",     "kd-student-equals-teacher"};
  for (const char* name : cases) {
    for (int tp : {1, 2, 4}) {
      Case c = load_case_file(std::string("cases/") + name + ".json");
      c.layout.tp = tp;
      const RunResult r = run_on_gpu(c, "correct");
      const std::string case_name = name;  // a string, so that a failure prints it
      CAPTURE(case_name);
      CAPTURE(tp);
      for (const auto& check : r.checks) {
        CAPTURE(check.name);
        CHECK(check.verdict != Verdict::fail);
        CHECK(check.margin < 0.51);
      }
    }
  }
}

TEST_CASE("cuda_kernel_bugs_fail_with_the_checks_golden_records_for_the_cpu") {
  const std::pair<const char*, const char*> runs[] = {{"smoothing-pytorch", "smoothing-partition-vocab"},
                                                      {"smoothing-pytorch", "smoothing-local-sum"},
                                                      {"uneven-shards-v507-tp4", "smoothing-backward-partition"},
                                                      {"uneven-shards-v507-tp4", "smoothing-convention-swap"},
                                                      {"large-logits-no-max-shift", "no-max-shift"},
                                                      {"bf16-upstream-rounding", "grad-rounded-early"},
                                                      {"uneven-shards-v507-tp4", "zloss-grad-after-smoothing"},
                                                      {"zloss-ignored", "zloss-on-ignored"},
                                                      {"cp-zigzag-packed", "cp-roll-after-split"},
                                                      {"dp-unequal-tokens", "dp-local-mean"},
                                                      {"kd-tp4-temperature2", "kd-no-t2"},
                                                      {"kd-tp4-temperature2", "kd-double-t2"},
                                                      {"kd-tp4-temperature2", "kd-local-softmax"},
                                                      {"kd-tp4-temperature2", "kd-untracked-allreduce"},
                                                      {"kd-student-equals-teacher", "kd-cross-entropy-value"},
                                                      {"kd-student-equals-teacher", "kd-untracked-allreduce"},
                                                      {"kd-tp2-dp2-unequal", "kd-tp-grad-sum"},
                                                      {"kd-tp2-dp2-unequal", "correct"},
                                                      {"smoothing-pytorch", "overwrites-input"},
                                                      {"uneven-shards-v507-tp4", "overwrites-input"},
                                                      {"underflow-gap-240", "smoothing-log-after-exp"},
                                                      {"smoothing-pytorch", "smoothing-log-after-exp"},
                                                      {"uneven-shards-v507-tp4", "smoothing-log-after-exp"},
                                                      {"smoothing-pytorch", "full-vocab-through-tp"},
                                                      {"uneven-shards-v507-tp4", "full-vocab-through-tp"},
                                                      {"cp-zigzag-packed", "full-vocab-through-tp"},
                                                      {"softcap-gemma", "full-vocab-through-tp"}};
  for (const auto& [name, impl] : runs) {
    const Case c = load_case_file(std::string("cases/") + name + ".json");
    std::ifstream golden_file(std::string("golden/") + name + ".json");
    const nlohmann::json golden = nlohmann::json::parse(golden_file)["outcomes"][impl];
    const RunResult r = run_on_gpu(c, impl);
    const std::string case_name = name, impl_name = impl;  // strings, so that a failure prints them
    CAPTURE(case_name);
    CAPTURE(impl_name);
    CHECK(std::string(to_string(r.verdict)) == golden["verdict"].get<std::string>());
    CHECK(failing(r) == golden["failing_checks"].get<std::vector<std::string>>());
  }
}

TEST_CASE("policy_kernels_give_the_golden_outcomes_of_every_rl_case_and_implementation") {
  for (const char* name :
       {"rl-grpo-tp2-dp2-ga2", "rl-drgrpo-cp2-whiten", "rl-logprob-entropy-tp4", "rl-gspo-cp2-tp2"}) {
    const Case c = load_case_file(std::string("cases/") + name + ".json");
    std::ifstream golden_file(std::string("golden/") + name + ".json");
    const nlohmann::json outcomes = nlohmann::json::parse(golden_file)["outcomes"];
    int compared = 0;
    for (const auto& [impl, golden] : outcomes.items()) {
      if (golden["verdict"] == "not_applicable") continue;
      const RunResult r = run_on_gpu(c, impl);
      const std::string case_name = name;
      CAPTURE(case_name);
      CAPTURE(impl);
      CHECK(std::string(to_string(r.verdict)) == golden["verdict"].get<std::string>());
      CHECK(failing(r) == golden["failing_checks"].get<std::vector<std::string>>());
      ++compared;
    }
    CHECK(compared > 12);
  }
}

// A GPU buffer holds whatever a freed allocation of an earlier run left in the pool: the policy kernel writes a
// masked row's zeros itself (before, it skipped the row, and a second run in one process read stale bytes).
TEST_CASE("policy_gradient_kernel_writes_zeros_on_masked_rows_of_a_dirty_buffer") {
  for (const cuda::StorageType type : {cuda::StorageType::fp32, cuda::StorageType::bf16, cuda::StorageType::fp16}) {
    CAPTURE(static_cast<int>(type));
    const std::int64_t rows = 4, cols = 256;
    const std::size_t element = type == cuda::StorageType::fp32 ? 4 : 2;
    const std::size_t bytes = static_cast<std::size_t>(rows * cols) * element;
    cuda::Stream stream;
    cuda::DeviceBytes logits(bytes), grad(bytes);
    LV_CUDA(cudaMemsetAsync(logits.as<void>(), 0, bytes, stream.get()));
    LV_CUDA(cudaMemsetAsync(grad.as<void>(), 0xFF, bytes, stream.get()));  // NaN in every storage type
    const std::vector<int> active = {1, 0, 1, 0};
    const std::vector<std::int64_t> target = {3, -1, 7, -1};
    // Per row: max, log_sum, a, bonus, c, shift, scale, target, argmax (PolicyGradRow).
    std::vector<float> grad_rows;
    for (std::int64_t r = 0; r < rows; ++r) {
      const float row[9] = {0.0f, std::log(256.0f), 1.0f, 0.0f, 0.0f, 0.0f, 1.0f, static_cast<float>(target[r]), 0.0f};
      grad_rows.insert(grad_rows.end(), row, row + 9);
    }
    const cuda::DeviceBytes d_active = cuda::upload(active, stream.get());
    const cuda::DeviceBytes d_target = cuda::upload(target, stream.get());
    const cuda::DeviceBytes d_rows = cuda::upload(grad_rows, stream.get());
    cuda::PolicyKernelArgs args;
    args.logits = logits.as<void>();
    args.grad = grad.as<void>();
    args.rows = rows;
    args.cols = cols;
    args.active = d_active.as<int>();
    args.target = d_target.as<std::int64_t>();
    cuda::policy_gradient(type, args, d_rows.as<float>(), stream.get());
    std::vector<unsigned char> host(bytes);
    LV_CUDA(cudaMemcpyAsync(host.data(), grad.as<void>(), bytes, cudaMemcpyDeviceToHost, stream.get()));
    stream.sync();
    const std::size_t row_bytes = static_cast<std::size_t>(cols) * element;
    for (std::int64_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      const auto begin = host.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * row_bytes);
      const auto zero_bytes = std::count(begin, begin + static_cast<std::ptrdiff_t>(row_bytes), 0);
      if (active[static_cast<std::size_t>(r)] == 0) {
        CHECK(static_cast<std::size_t>(zero_bytes) == row_bytes);  // every element +0
      } else {
        CHECK(static_cast<std::size_t>(std::count(begin, begin + static_cast<std::ptrdiff_t>(row_bytes), 0xFF)) <
              row_bytes / 2);  // written: no NaN pattern left
      }
    }
  }
}

TEST_CASE("long_rows_take_the_row_resident_kernel_and_give_the_cpu_verdicts") {
  // Which kernel serves a row width is a host-side decision; aligned stand-in pointers suffice.
  void* aligned = reinterpret_cast<void*>(std::uintptr_t{1} << 20);
  void* misaligned = reinterpret_cast<void*>((std::uintptr_t{1} << 20) + 2);
  const cuda::CrossEntropyConstants plain{0.9f, 1e-6f, 0.9f, 1e-6f, 0.0f, 0.0f, 0, 0, 0};
  cuda::CrossEntropyConstants capped = plain;
  capped.softcap = 30.0f;
  CHECK(cuda::fused_cluster_size(cuda::StorageType::bf16, plain, aligned, aligned, 128256) == 8);
  CHECK(cuda::fused_cluster_size(cuda::StorageType::bf16, capped, aligned, aligned, 128256) == 8);
  CHECK(cuda::fused_cluster_size(cuda::StorageType::bf16, plain, aligned, aligned, 40000) == 4);
  CHECK(cuda::fused_cluster_size(cuda::StorageType::fp32, plain, aligned, aligned, 40000) == 8);
  CHECK(cuda::fused_cluster_size(cuda::StorageType::bf16, plain, aligned, aligned, 32768) == 0);   // 64 KB rows
  CHECK(cuda::fused_cluster_size(cuda::StorageType::bf16, plain, aligned, aligned, 100003) == 0);  // no 16-byte vectors
  CHECK(cuda::fused_cluster_size(cuda::StorageType::bf16, plain, misaligned, aligned, 128256) == 0);
  CHECK(cuda::fused_cluster_size(cuda::StorageType::fp32, plain, aligned, aligned, 131080) == 0);  // beyond 8 CTAs

  // The kernel on those widths, plain and generic instantiations, whole rows (TP = 1): the CPU run of the
  // same case is the oracle, and each bug must fail there, so a match is not two passes of nothing.
  struct Long {
    const char* name;
    const char* impl;
    std::vector<std::string> set;  // through the parser, as `--set` does: the shape determines derived parts
  };
  const auto shape = [](std::int64_t vocab, std::int64_t tokens) {
    return std::vector<std::string>{"shape.vocab=" + std::to_string(vocab), "shape.tokens=" + std::to_string(tokens),
                                    "layout.tp=1"};
  };
  const auto with = [](std::vector<std::string> a, const std::string& b) {
    a.push_back(b);
    return a;
  };
  const std::vector<std::string> dp_bf16 = {"shape.vocab=40000", "inputs.dtype=bf16", "layout.tp=1"};
  const Long runs[] = {{"smoothing-pytorch", "correct", with(shape(128256, 24), "inputs.dtype=bf16")},
                       {"smoothing-pytorch", "correct", shape(40000, 64)},
                       {"zloss-ignored", "correct", shape(100000, 48)},
                       {"softcap-gemma", "correct", shape(100000, 32)},
                       {"reduction-none-upstream", "correct", shape(40000, 40)},
                       {"bf16-upstream-rounding", "correct", shape(100000, 64)},
                       {"dp-unequal-tokens", "correct", dp_bf16},
                       {"dp-unequal-tokens", "dp-local-mean", dp_bf16},
                       {"large-logits-no-max-shift", "no-max-shift", shape(40000, 32)},
                       // fp32 logits near 95 (lse near 100): the plain path's exponent is taken from x - M, exact
                       // near the max (an FFMA of x log2 e - lse log2 e lost |lse| 2^-24 per element)
                       {"large-logits-no-max-shift", "correct", shape(40000, 32)},
                       {"bf16-upstream-rounding", "grad-rounded-early", shape(100000, 64)},
                       {"uneven-shards-v507-tp4", "zloss-grad-after-smoothing", shape(40000, 32)},
                       {"zloss-ignored", "zloss-on-ignored", shape(100000, 48)},
                       {"smoothing-pytorch", "smoothing-log-after-exp", shape(128256, 16)}};
  for (const Long& run : runs) {
    const Case c = load_case_file(std::string("cases/") + run.name + ".json", run.set);
    RunOptions cpu;
    cpu.implementation = run.impl;
    cpu.threads = 2;
    const RunResult expected = run_case(c, cpu);
    const RunResult r = run_on_gpu(c, run.impl);
    const std::string name = run.name, impl = run.impl;  // strings, so that a failure prints them
    CAPTURE(name);
    CAPTURE(impl);
    CAPTURE(c.shape.vocab);
    CHECK(r.verdict == expected.verdict);
    CHECK(failing(r) == failing(expected));
    if (std::string_view(run.impl) == "correct") {
      CHECK(r.verdict == Verdict::pass);
      for (const auto& check : r.checks) {
        CAPTURE(check.name);
        CHECK(check.margin < 0.51);
      }
    } else if (std::string_view(run.impl) != "smoothing-log-after-exp") {  // no underflow at these widths
      CHECK(expected.verdict == Verdict::fail);
    }
  }
}

TEST_CASE("nccl_one_gpu_per_rank_matches_host_collectives_bitwise_and_the_cpu_verdicts") {
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2 || !build_info::have_nccl) {
    MESSAGE("skipped: needs 2 GPUs and an NCCL build (GPUs: " << gpus << ")");
    return;
  }
  // Two-rank layouts (TP, CP, DP) over two GPUs, the correct kernels and bugs that live in the
  // collectives' inputs and in the normalisation.
  const std::tuple<const char*, const char*, const char*> runs[] = {
      {"smoothing-pytorch", "layout.tp", "correct"},
      {"smoothing-pytorch", "layout.tp", "smoothing-local-sum"},
      {"uneven-shards-v507-tp4", "layout.tp", "correct"},
      {"uneven-shards-v507-tp4", "layout.tp", "smoothing-partition-vocab"},
      {"kd-tp4-temperature2", "layout.tp", "correct"},
      {"kd-tp4-temperature2", "layout.tp", "kd-local-softmax"},
      {"cp-zigzag-packed", "layout.cp", "correct"},
      {"cp-zigzag-packed", "layout.cp", "cp-roll-after-split"},
      {"dp-unequal-tokens", "layout.dp", "correct"},
      {"dp-unequal-tokens", "layout.dp", "dp-local-mean"},
      {"large-logits-no-max-shift", "layout.tp", "no-max-shift"}};
  for (const auto& [name, dimension, impl] : runs) {
    Case c = load_case_file(std::string("cases/") + name + ".json", {"layout.tp=1", "layout.cp=1", "layout.dp=1",
                                                                     "layout.ga=1", std::string(dimension) + "=2"});
    const std::string case_name = name, impl_name = impl;  // strings, so that a failure prints them
    CAPTURE(case_name);
    CAPTURE(impl_name);
    RunOptions options;
    options.implementation = impl;
    options.threads = 2;
    const RunResult cpu = run_case(c, options);
    options.device = RunOptions::Device::cuda;
    options.gpus = 2;
    options.collectives = RunOptions::Collectives::host;
    const RunResult host = run_case(c, options);
    options.collectives = RunOptions::Collectives::nccl;
    const RunResult nccl = run_case(c, options);
    CHECK(nccl.execution.collectives == "nccl");
    CHECK(nccl.execution.gpus == 2);
    CHECK(host.execution.collectives == "host");
    CHECK(failing(nccl) == failing(cpu));
    CHECK(nccl.verdict == cpu.verdict);
    REQUIRE(nccl.checks.size() == host.checks.size());
    for (std::size_t k = 0; k < nccl.checks.size(); ++k) {
      CAPTURE(nccl.checks[k].name);
      // Same kernels, same reductions in rank order: NCCL only moved the bytes.
      CHECK(nccl.checks[k].metrics.dump() == host.checks[k].metrics.dump());
      CHECK((nccl.checks[k].margin == host.checks[k].margin ||
             (std::isnan(nccl.checks[k].margin) && std::isnan(host.checks[k].margin))));
    }
  }
}

TEST_CASE("nccl_endpoints_are_set_up_once_per_group_and_never_reused_after_a_failed_run") {
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2 || !build_info::have_nccl) {
    MESSAGE("skipped: needs 2 GPUs and an NCCL build (GPUs: " << gpus << ")");
    return;
  }
  cuda::release_nccl_endpoints();  // whatever earlier tests kept
  const Case c = load_case_file("cases/smoothing-pytorch.json", {"layout.tp=2", "layout.cp=1", "layout.dp=1"});
  RunOptions options;
  options.threads = 2;
  options.device = RunOptions::Device::cuda;
  options.gpus = 2;
  options.collectives = RunOptions::Collectives::nccl;
  // Two ranks: their TP group over NCCL (one endpoint each); the batch and DP groups of one stay on the host.
  const std::int64_t before = cuda::nccl_endpoints_created();
  const RunResult first = run_case(c, options);
  CHECK(cuda::nccl_endpoints_created() - before == 2);
  CHECK(cuda::nccl_endpoints_kept() == 2);
  const RunResult second = run_case(c, options);
  CHECK(cuda::nccl_endpoints_created() - before == 2);  // the second run created none
  REQUIRE(first.checks.size() == second.checks.size());
  for (std::size_t k = 0; k < first.checks.size(); ++k) {
    CAPTURE(first.checks[k].name);
    CHECK(first.checks[k].metrics.dump() == second.checks[k].metrics.dump());
  }
  // A rank that fails after its groups are set up (the kept endpoints taken again): the run ends with the
  // error and none of its endpoints goes back, so the next run sets up both again and passes as before.
  RunOptions faulty = options;
  faulty.fault = parse_fault("late-throw@1");
  CHECK_THROWS_AS(run_case(c, faulty), Error);
  CHECK(cuda::nccl_endpoints_kept() == 0);
  const std::int64_t after_fault = cuda::nccl_endpoints_created();
  const RunResult third = run_case(c, options);
  CHECK(cuda::nccl_endpoints_created() - after_fault == 2);
  CHECK(third.verdict == Verdict::pass);
  CHECK(failing(third) == failing(first));
  // A layout whose batch and DP groups have the same members keeps one endpoint per role.
  const Case dp =
      load_case_file("cases/dp-unequal-tokens.json", {"layout.tp=1", "layout.cp=1", "layout.dp=2", "layout.ga=1"});
  const std::int64_t before_dp = cuda::nccl_endpoints_created();
  const RunResult dp_first = run_case(dp, options);
  CHECK(cuda::nccl_endpoints_created() - before_dp == 4);  // batch {0,1} and DP {0,1}, on both ranks
  const RunResult dp_second = run_case(dp, options);
  CHECK(cuda::nccl_endpoints_created() - before_dp == 4);
  CHECK(dp_second.verdict == dp_first.verdict);
  cuda::release_nccl_endpoints();
  CHECK(cuda::nccl_endpoints_kept() == 0);
}

TEST_CASE("nccl_is_refused_where_ranks_would_share_a_gpu") {
  Case c = load_case_file("cases/smoothing-pytorch.json", {"layout.tp=4"});
  RunOptions options;
  options.device = RunOptions::Device::cuda;
  options.gpus = 1;
  options.collectives = RunOptions::Collectives::nccl;
  CHECK_THROWS_AS(run_case(c, options), Error);
}

TEST_CASE("gpu_float64_reference_agrees_with_the_cpu_reference") {
  // Same CUDA kernels, the reference once on the host and once where the shard lives: the same verdicts,
  // the same counts and worst elements, margins equal to float64 rounding.
  const std::pair<const char*, const char*> runs[] = {{"smoothing-pytorch", "correct"},
                                                      {"smoothing-megatron", "correct"},
                                                      {"uneven-shards-v507-tp4", "correct"},
                                                      {"zloss-ignored", "correct"},
                                                      {"reduction-none-upstream", "correct"},
                                                      {"softcap-gemma", "correct"},
                                                      {"underflow-gap-240", "correct"},
                                                      {"cp-zigzag-packed", "correct"},
                                                      {"full-4d-layout", "correct"},
                                                      {"kd-tp4-temperature2", "correct"},
                                                      {"kd-student-equals-teacher", "correct"},
                                                      {"smoothing-pytorch", "smoothing-partition-vocab"},
                                                      {"bf16-upstream-rounding", "grad-rounded-early"},
                                                      {"zloss-ignored", "zloss-on-ignored"},
                                                      {"cp-zigzag-packed", "cp-roll-after-split"},
                                                      {"kd-tp4-temperature2", "kd-untracked-allreduce"},
                                                      {"large-logits-no-max-shift", "no-max-shift"},
                                                      {"uneven-shards-v507-tp4", "full-vocab-through-tp"},
                                                      {"rl-grpo-tp2-dp2-ga2", "correct"},
                                                      {"rl-drgrpo-cp2-whiten", "correct"},
                                                      {"rl-logprob-entropy-tp4", "correct"},
                                                      {"rl-gspo-cp2-tp2", "correct"},
                                                      {"rl-grpo-tp2-dp2-ga2", "rl-kl-no-grad"},
                                                      {"rl-logprob-entropy-tp4", "rl-entropy-untracked-allreduce"},
                                                      {"rl-gspo-cp2-tp2", "rl-gspo-cp-local-ratio"}};
  // At TP = 1 (whole rows of cross-entropy) the comparison takes each row's lse from the partials on the
  // device instead of the host's combine: the same pairs, one shard per token.
  const std::pair<const char*, const char*> whole_rows[] = {{"smoothing-pytorch", "correct"},
                                                            {"zloss-ignored", "zloss-on-ignored"},
                                                            {"softcap-gemma", "correct"},
                                                            {"cp-zigzag-packed", "cp-roll-after-split"},
                                                            {"large-logits-no-max-shift", "no-max-shift"},
                                                            {"reduction-none-upstream", "correct"},
                                                            {"rl-grpo-tp2-dp2-ga2", "correct"},
                                                            {"rl-drgrpo-cp2-whiten", "rl-cp-extra-scale"}};
  std::vector<std::tuple<const char*, const char*, std::vector<std::string>>> all;
  for (const auto& [name, impl] : runs) all.emplace_back(name, impl, std::vector<std::string>{});
  for (const auto& [name, impl] : whole_rows) all.emplace_back(name, impl, std::vector<std::string>{"layout.tp=1"});
  for (const auto& [name, impl, sets] : all) {
    const Case c = load_case_file(std::string("cases/") + name + ".json", sets);
    const std::string case_name = name, impl_name = impl;  // strings, so that a failure prints them
    CAPTURE(case_name);
    CAPTURE(impl_name);
    CAPTURE(sets.size());
    RunOptions options;
    options.implementation = impl;
    options.threads = 2;
    options.device = RunOptions::Device::cuda;
    options.reference = RunOptions::Reference::cpu;
    const RunResult host = run_case(c, options);
    options.reference = RunOptions::Reference::gpu;
    const RunResult gpu = run_case(c, options);
    CHECK(host.execution.reference == "cpu");
    CHECK(gpu.execution.reference == "gpu");
    check_same_verdicts(host, gpu, 1e-6, [](const CheckResult& a, const CheckResult& b) {
      if (a.name == "grad" || a.name == "loss") {
        for (const char* key : {"compared", "mismatches"}) {
          const auto& ma = a.name == "grad" ? a.metrics : a.metrics["per_token"];
          const auto& mb = b.name == "grad" ? b.metrics : b.metrics["per_token"];
          CHECK(ma[key] == mb[key]);
        }
        if (a.worst && b.worst && a.margin > 0.01) {
          CHECK(a.worst->token == b.worst->token);
          CHECK(a.worst->column == b.worst->column);
        }
      }
    });
  }
}

TEST_CASE("the_gpu_oracle_judges_a_token_at_a_clip_edge_by_either_reading_as_the_host_does") {
  // Three tokens placed exactly on the edges that decide their branch (1 + eps_high with A > 0, 1 - eps_low
  // and the dual clip with A < 0), their lambda from the host reference: the GPU oracle compares their rows
  // a second time with the other reading and keeps the closer one, as the host oracle does.
  nlohmann::json j = {{"name", "edges"},
                      {"shape", {{"vocab", 300}}},
                      {"batch", {{"sequence_lengths", {21, 9, 30, 12}}}},
                      {"loss",
                       {{"kind", "policy"},
                        {"temperature", 0.7},
                        {"clip_low", 0.2},
                        {"clip_high", 0.28},
                        {"dual_clip", 3.0},
                        {"kl_penalty", "k3"},
                        {"kl_coef", 0.05},
                        {"entropy_coef", 0.01}}},
                      {"inputs", {{"seed", 17}, {"scale", 2.0}, {"ignore_fraction", 0.2}}},
                      {"layout", {{"tp", 2}, {"cp", 1}, {"dp", 1}, {"ga", 1}}},
                      {"timeout_seconds", 60.0}};
  const Case plain = testing::make_case(j);
  const InputSource plain_inputs(plain);
  const LossReference plain_reference(plain, plain_inputs);
  std::vector<double> row(static_cast<std::size_t>(plain.shape.vocab)), grad(row.size());
  const double edges[] = {1.28, 0.8, 3.0};
  const double advantages[] = {1.0, -1.0, -1.0};
  nlohmann::json overrides = nlohmann::json::array();
  for (std::int64_t t = 0, k = 0; t < plain.shape.tokens && k < 3; ++t) {
    if (!plain_inputs.is_valid(t)) continue;
    plain_inputs.logits(t, 0, plain.shape.vocab, row.data());
    std::vector<double> values(2);
    plain_reference.row().token_values(t, plain_reference.evaluate(t, row, {}, grad).stats, values);
    overrides.push_back({{"token", t}, {"old_logprob", values[0] - std::log(edges[k])}, {"advantages", advantages[k]}});
    ++k;
  }
  j["inputs"]["overrides"] = overrides;
  const Case c = testing::make_case(j);
  for (const char* impl : {"correct", "rl-kl-no-grad"}) {
    const std::string impl_name = impl;
    CAPTURE(impl_name);
    RunOptions options;
    options.implementation = impl;
    options.threads = 2;
    options.device = RunOptions::Device::cuda;
    options.reference = RunOptions::Reference::cpu;
    const RunResult host = run_case(c, options);
    options.reference = RunOptions::Reference::gpu;
    const RunResult gpu = run_case(c, options);
    CHECK(gpu.execution.reference == "gpu");
    CHECK(gpu.verdict == (impl_name == "correct" ? Verdict::pass : Verdict::fail));
    check_same_verdicts(host, gpu, 1e-6, [](const CheckResult& a, const CheckResult& b) {
      if (a.name == "grad")
        CHECK(a.metrics.value("either_branch_tokens", 0) == b.metrics.value("either_branch_tokens", 0));
    });
    for (const CheckResult& check : gpu.checks) {
      if (check.name == "grad" && impl_name == "correct") CHECK(check.metrics.value("either_branch_tokens", 0) == 3);
    }
  }
}

TEST_CASE("the_gpu_oracle_owns_its_inputs_an_implementation_that_overwrites_its_own_does_not_move_its_figures") {
  // overwrites-input writes its softmax over its logits on the device and hands that over as the gradient.
  // Its losses are the correct run's, so an oracle that owns its inputs reports the same loss check, to the
  // bit; one that read the implementation's logits would judge against the softmax. The gradient fails.
  for (const char* sets : {"layout.tp=1", "layout.tp=4"}) {
    CAPTURE(sets);
    const Case c = load_case_file("cases/smoothing-pytorch.json", {sets});
    RunOptions options;
    options.threads = 2;
    options.device = RunOptions::Device::cuda;
    options.reference = RunOptions::Reference::gpu;
    options.implementation = "correct";
    const RunResult right = run_case(c, options);
    options.implementation = "overwrites-input";
    const RunResult scribbled = run_case(c, options);
    REQUIRE(right.checks.size() == scribbled.checks.size());
    for (std::size_t k = 0; k < right.checks.size(); ++k) {
      CAPTURE(right.checks[k].name);
      if (right.checks[k].name == "loss" || right.checks[k].name == "rank_agreement") {
        CHECK(scribbled.checks[k].metrics.dump() == right.checks[k].metrics.dump());
        CHECK(scribbled.checks[k].verdict == right.checks[k].verdict);  // rank_agreement: n/a at tp = 1
        CHECK(scribbled.checks[k].verdict != Verdict::fail);
      }
      if (right.checks[k].name == "grad" || right.checks[k].name == "row_sum") {
        CHECK(right.checks[k].verdict == Verdict::pass);
        CHECK(scribbled.checks[k].verdict == Verdict::fail);
      }
    }
  }
}

TEST_CASE("gpu_reference_exp_is_within_2_ulp_of_the_host_exp") {
  // The GPU reference's table-method exp against the host's (glibc's, correctly rounded in practice) on a
  // dense grid of [-745, 0] and at the edges of its fast path; positive, -inf and NaN inputs take the
  // library's exp. The distance is counted in units in the last place of the host value.
  std::vector<double> in;
  for (int i = 0; i <= 2000000; ++i) in.push_back(-745.0 * i / 2000000.0);
  for (double d :
       {0.0, -0.0, -1e-300, -5e-324, -1e-17, -0.0108304, -707.0, -707.0000001, -708.39, -744.4, -745.2, -800.0, 1e-300,
        0.5, 700.0, -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity(), std::nan("")}) {
    in.push_back(d);
  }
  std::vector<double> out(in.size());
  cuda::reference_exp_values(in.data(), out.data(), in.size());
  const auto ordered = [](double x) {
    std::int64_t b = 0;
    std::memcpy(&b, &x, sizeof b);
    return b < 0 ? std::numeric_limits<std::int64_t>::min() - b : b;
  };
  std::int64_t worst = 0;
  double worst_at = 0.0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const double want = std::exp(in[i]);
    if (std::isnan(want)) {
      CHECK(std::isnan(out[i]));
      continue;
    }
    const std::int64_t ulps = std::llabs(ordered(out[i]) - ordered(want));
    if (ulps > worst) {
      worst = ulps;
      worst_at = in[i];
    }
  }
  MESSAGE("largest distance from the host exp: " << worst << " ulp, at " << worst_at);
  CHECK(worst <= 2);
}

TEST_CASE("gpu_reference_code_tables_judge_as_the_full_judgement") {
  // bf16 rows of the cross-entropy family: the GPU reference judges an element whose (logit, gradient)
  // codes match its row's table by a lookup (reference_kernels.cu). Against the same runs with the tables
  // off (every element judged in full): the same verdicts, counts and worst elements, and maxima equal to
  // float64 rounding (the table rows take the softmax as exp(x) exp(-lse), not exp(x - lse)). Covers
  // bugs that mismatch, masked rows, CP padding, z-loss, upstream weights, the absolute/relative
  // tolerance mode, codes outside the table and rows whose |lse| > 600 keep the full judgement; and rows
  // built so that the worst hit found in the pass needs its guards (shared table entries, the label).
  enum Lookups { some, none, any };  // any: a bug whose gradient may miss every code (judged in full)
  struct Run {
    const char* name;
    const char* impl;
    std::vector<std::string> set;
    Lookups lookups;
  };
  const std::vector<std::string> bf16 = {"inputs.dtype=bf16"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), bf16.begin(), bf16.end());
    return more;
  };
  const Run runs[] = {
      {"smoothing-pytorch", "correct", with({"shape.vocab=1024"}), some},
      {"smoothing-pytorch", "smoothing-partition-vocab", with({"shape.vocab=1024"}), some},
      {"smoothing-megatron", "correct", {}, some},
      {"smoothing-megatron", "correct", {"tolerances.grad.max_ulp=0", "tolerances.grad.rtol=0.004"}, some},
      {"smoothing-megatron", "correct", {"tolerances.grad.max_ulp=0"}, some},  // fails: atol only
      {"bf16-upstream-rounding", "correct", {}, some},
      {"bf16-upstream-rounding", "grad-rounded-early", {}, some},
      {"zloss-ignored", "correct", bf16, some},
      {"zloss-ignored", "zloss-on-ignored", bf16, some},
      {"cp-zigzag-packed", "correct", with({"shape.vocab=512"}), some},
      {"cp-zigzag-packed", "cp-roll-after-split", with({"shape.vocab=512"}), any},
      {"dp-unequal-tokens", "correct", bf16, some},
      {"dp-unequal-tokens", "dp-local-mean", bf16, any},
      {"realistic-bf16-n2048-v32000-tp8", "correct", {}, some},
      // rows of 4000 and 4096 columns whose every element misses: more misses than the block's list holds
      {"realistic-bf16-n2048-v32000-tp8", "smoothing-partition-vocab", {}, any},
      {"dp-unequal-tokens", "dp-local-mean", with({"shape.vocab=8192"}), any},
      {"large-logits-no-max-shift", "correct", bf16, none},                       // |x| > 64: outside
      {"large-logits-no-max-shift", "correct", with({"inputs.mean=650"}), none},  // |lse| > 600
  };
  ::unsetenv("LOSSVERIFY_REFERENCE_TABLES");
  REQUIRE(cuda::reference_code_tables_apply(cuda::StorageType::bf16, false, 0.0));
  REQUIRE_FALSE(cuda::reference_code_tables_apply(cuda::StorageType::fp16, false, 0.0));
  REQUIRE_FALSE(cuda::reference_code_tables_apply(cuda::StorageType::bf16, true, 0.0));
  REQUIRE_FALSE(cuda::reference_code_tables_apply(cuda::StorageType::bf16, false, 30.0));
  // The full judgement's grad check (tables off), after the same run with the tables on was checked against it.
  auto tables_judge_as_the_full_judgement = [](const Case& c, const std::string& case_name,
                                               const std::string& impl_name, Lookups expected_lookups) {
    CAPTURE(case_name);
    CAPTURE(impl_name);
    REQUIRE(c.inputs.dtype == DType::bf16);
    RunOptions options;
    options.implementation = impl_name;
    options.threads = 2;
    options.device = RunOptions::Device::cuda;
    options.reference = RunOptions::Reference::gpu;
    ::setenv("LOSSVERIFY_REFERENCE_TABLES", "off", 1);
    const RunResult full = run_case(c, options);
    ::unsetenv("LOSSVERIFY_REFERENCE_TABLES");
    const RunResult tables = run_case(c, options);
    // The two runs' partials kernels sum a row in different orders (512 threads with the tables), so their float64
    // lse may differ by a few ulps; at |lse| = 650 (the inputs.mean=650 run) an ulp is 1.1e-13, 4e-10 of that
    // case's loss tolerance (2.7e-4). 1e-8 allows 25 such ulps and still pins every margin to eight digits.
    check_same_verdicts(full, tables, 1e-8, [&](const CheckResult& a, const CheckResult& b) {
      if (a.name != "grad") return;
      CHECK(a.metrics["judged_by_lookup"] == 0);
      const std::int64_t lookups = b.metrics["judged_by_lookup"].get<std::int64_t>();
      const std::int64_t compared = b.metrics["compared"].get<std::int64_t>();
      MESSAGE(case_name << " / " << impl_name << ": " << lookups << " of " << compared << " elements judged by lookup");
      if (expected_lookups == some) CHECK(lookups > 0);
      if (expected_lookups == none) CHECK(lookups == 0);
      for (const char* key : {"compared", "mismatches", "max_ulp"}) {
        const std::string key_name = key;
        CAPTURE(key_name);
        CHECK(a.metrics.value(key, nlohmann::json()) == b.metrics.value(key, nlohmann::json()));
      }
      // The largest relative error sits where the expected value is smallest: under label smoothing an element
      // with p close to q, where p - q cancels and the two paths' p (exp(x) exp(-lse) against exp(x - lse),
      // a few ulps apart) differ relatively by that cancellation's factor. Seen: 1.2e-8 of 5.1e-3 on
      // smoothing-megatron once the kernels' bits moved. The absolute error is well conditioned.
      for (const auto& [key, tolerance] :
           {std::pair<const char*, double>{"max_abs_error", 1e-9}, {"max_rel_error", 1e-6}}) {
        const std::string key_name = key;  // a string, so that a failure prints it
        CAPTURE(key_name);
        if (!a.metrics[key].is_number() || !b.metrics[key].is_number()) {  // "Infinity", "NaN"
          CHECK(a.metrics[key] == b.metrics[key]);
          continue;
        }
        const double x = a.metrics[key].get<double>(), y = b.metrics[key].get<double>();
        CHECK(std::fabs(x - y) <= tolerance * std::fabs(x));
      }
      REQUIRE(a.worst.has_value() == b.worst.has_value());
      if (a.worst) {
        CHECK(a.worst->token == b.worst->token);
        CHECK(a.worst->column == b.worst->column);
        CHECK(std::fabs(a.worst->expected - b.worst->expected) <= 1e-12 * std::fabs(a.worst->expected));
        CHECK(a.worst->got == b.worst->got);
      }
    });
    return std::find_if(full.checks.begin(), full.checks.end(), [](const CheckResult& r) { return r.name == "grad"; })
        ->worst;
  };
  for (const Run& run : runs) {
    CAPTURE(run.set.size());
    tables_judge_as_the_full_judgement(load_case_file(std::string("cases/") + run.name + ".json", run.set), run.name,
                                       run.impl, run.lookups);
  }
  // Rows built so that the worst hit is hard to place: one logit of 4 (the label) and 1023 drawn from 41
  // codes in [-44, -34], where exp(x - lse) is below 1e-14 of the smoothing term. Those codes share their
  // likeliest gradient and their margins to 1e-13, so their table entries are equal; the largest margin
  // belongs to one of them, whose first column is not the first column of the entry. With 51 tokens the
  // bf16 rounding of that gradient is the worst of the case (margin near half a unit in the last place).
  {
    Case c = load_case_file("cases/smoothing-pytorch.json",
                            {"shape.tokens=51", "shape.vocab=1024", "inputs.dtype=bf16", "layout.tp=1"});
    std::uint32_t state = 12345;
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      RowOverride row;
      row.token = t;
      const std::int64_t top = (7 * t + 3) % c.shape.vocab;
      row.label = top;
      for (std::int64_t v = 0; v < c.shape.vocab; ++v) {
        state = (state * 1103515245u + 12345u) & 0x7fffffffu;
        row.logits.push_back(v == top ? 4.0 : -34.0 - 0.25 * static_cast<double>((state >> 8) % 41));
      }
      c.inputs.overrides.push_back(std::move(row));
    }
    const std::optional<ElementRecord> worst = tables_judge_as_the_full_judgement(c, "flat-codes-n51", "correct", some);
    // The premise: the worst element is one of those codes (its expected value is -w q_off), not its row's first.
    REQUIRE(worst.has_value());
    const double q_off = 0.1 / 1024.0;
    CHECK(std::fabs(worst->expected + q_off / 51.0) <= 1e-9 * q_off / 51.0);
    CHECK(worst->column > 0);
  }
  // Rows where the label's element holds its code's likeliest non-label gradient: smoothing 1 - 1e-6 puts
  // q_on within a quarter of a bf16 unit of q_off. Every column but one (a logit of 4) holds -40, the label
  // is column 0, and with 43 tokens the label's own margin is below the others': the worst hit is column 1,
  // though the pass meets the label's pair first.
  {
    Case c = load_case_file("cases/smoothing-pytorch.json", {"shape.tokens=43", "shape.vocab=1024", "inputs.dtype=bf16",
                                                             "layout.tp=1", "loss.label_smoothing=0.999999"});
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      RowOverride row;
      row.token = t;
      row.label = 0;
      row.logits.assign(static_cast<std::size_t>(c.shape.vocab), -40.0);
      row.logits[3] = 4.0;
      c.inputs.overrides.push_back(std::move(row));
    }
    const std::optional<ElementRecord> worst =
        tables_judge_as_the_full_judgement(c, "label-shares-entry-n43", "correct", some);
    REQUIRE(worst.has_value());  // the premise
    CHECK(worst->token == 0);
    CHECK(worst->column == 1);
  }
}

namespace {

std::vector<std::string> router_cases() {
  return {"moe-aux-sp-tp2-cp2",    "moe-aux-replicated-tp8-e6", "moe-per-token-sp-cp2-dp2",
          "moe-sigmoid-seq-aux",   "moe-global-aux-dp2-ga2",    "moe-pooled-transformers-dp2-ga2",
          "moe-routed-groups-bias"};
}

}  // namespace

TEST_CASE("router_kernels_judged_by_the_router_gpu_oracle_give_the_golden_outcomes_of_every_router_case") {
  for (const std::string& name : router_cases()) {
    const Case c = load_case_file("cases/" + name + ".json");
    std::ifstream golden_file("golden/" + name + ".json");
    const nlohmann::json outcomes = nlohmann::json::parse(golden_file)["outcomes"];
    int compared = 0;
    for (const auto& [impl, golden] : outcomes.items()) {
      if (golden["verdict"] == "not_applicable") continue;
      const RunResult r = run_on_gpu(c, impl);
      CAPTURE(name);
      CAPTURE(impl);
      CHECK(r.execution.reference == "gpu");
      CHECK(std::string(to_string(r.verdict)) == golden["verdict"].get<std::string>());
      CHECK(failing(r) == golden["failing_checks"].get<std::vector<std::string>>());
      ++compared;
    }
    CHECK(compared >= 15);
  }
}

TEST_CASE("the_router_gpu_oracle_agrees_with_the_host_oracle_and_owns_its_inputs") {
  // The router's own GPU oracle (kinds/router/router_oracle.cpp: routing and rows in float64 on the device) and the
  // host oracle judge the same CUDA run alike: verdicts, counts, worst elements, margins to float64 rounding.
  for (const std::string& name : router_cases()) {
    for (const char* impl : {"correct", "moe-aux-local-counts", "moe-aux-topk-squared", "moe-aux-no-grad"}) {
      const Case c = load_case_file("cases/" + name + ".json");
      CAPTURE(name);
      CAPTURE(impl);
      RunOptions options;
      options.implementation = impl;
      options.threads = 2;
      options.device = RunOptions::Device::cuda;
      options.reference = RunOptions::Reference::cpu;
      const RunResult host = run_case(c, options);
      options.reference = RunOptions::Reference::gpu;
      const RunResult gpu = run_case(c, options);
      CHECK(host.execution.reference == "cpu");
      CHECK(gpu.execution.reference == "gpu");
      check_same_verdicts(host, gpu, 1e-6, [](const CheckResult& a, const CheckResult& b) {
        if (a.name == "grad") {
          CHECK(a.metrics["compared"] == b.metrics["compared"]);
          CHECK(a.metrics["mismatches"] == b.metrics["mismatches"]);
          if (a.worst && b.worst && a.margin > 0.01) {
            CHECK(a.worst->token == b.worst->token);
            CHECK(a.worst->column == b.worst->column);
          }
        }
        if (a.name == "counts") CHECK(a.metrics["imbalance"] == b.metrics["imbalance"]);
      });
    }
  }
}

TEST_CASE("the_router_gpu_oracle_bounds_a_users_tie_tokens_as_the_host_does") {
  // Two of a user's rows whose 3rd and 4th logits lie 4.8e-7 apart: a float32 router may route them either way; the
  // GPU oracle finds the same tie tokens in its own float64 pass and widens the scope's tolerances alike.
  nlohmann::json doc = load_case_file("cases/moe-sigmoid-seq-aux.json").resolved();
  std::vector<double> near(24, -1.0);
  near[0] = 2.0, near[1] = 1.5, near[2] = 1.0, near[3] = 1.0 + 4.8e-7, near[4] = 0.5;
  doc["inputs"]["overrides"] = {{{"token", 3}, {"logits", near}}, {{"token", 40}, {"logits", near}}};
  doc["inputs"]["ignore_fraction"] = 0.0;
  const Case c = testing::make_case(doc);
  for (const char* impl : {"correct", "moe-aux-topk-squared"}) {
    CAPTURE(impl);
    RunOptions options;
    options.implementation = impl;
    options.threads = 2;
    options.device = RunOptions::Device::cuda;
    options.reference = RunOptions::Reference::cpu;
    const RunResult host = run_case(c, options);
    options.reference = RunOptions::Reference::gpu;
    const RunResult gpu = run_case(c, options);
    CHECK(gpu.execution.reference == "gpu");
    CHECK(testing::check_named(gpu, "grad").metrics["either_way_tokens"] == 2);
    check_same_verdicts(host, gpu, 1e-6, [](const CheckResult&, const CheckResult&) {});
  }
}
