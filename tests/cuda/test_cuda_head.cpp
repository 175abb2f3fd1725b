// The LM head stage on the CUDA backend: the golden outcomes of every head case and catalogued bug (as the CPU gives
// them), and the device memory it holds beyond its inputs: one chunk's logits, never the whole rank's.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/cuda/cuda_rank_run.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

std::vector<std::string> failing_checks(const RunResult& r) {
  std::vector<std::string> names;
  for (const auto& check : r.checks) {
    if (check.verdict == Verdict::fail) names.push_back(check.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("the_cuda_head_gives_the_golden_outcome_of_every_head_case_and_implementation") {
  for (const char* name : {"head-ce-tp2-dp2-ga2", "head-ce-bias-upstream-tp4-cp2", "head-kd-tp4-cp2-ga2"}) {
    const Case c = load_case_file(std::string("cases/") + name + ".json");
    std::ifstream golden_file(std::string("golden/") + name + ".json");
    const nlohmann::json outcomes = nlohmann::json::parse(golden_file)["outcomes"];
    int judged = 0;
    for (const auto& [impl, golden] : outcomes.items()) {
      if (golden.value("verdict", std::string()) == "not_applicable") continue;
      RunOptions options;
      options.implementation = impl;
      options.threads = 2;
      options.device = RunOptions::Device::cuda;
      RunResult r;
      try {
        r = run_case(c, options);
      } catch (const CaseError&) {
        continue;  // a bug of another kind: not applicable here, as the gate records it
      }
      const std::string case_name = name, impl_name = impl;
      CAPTURE(case_name);
      CAPTURE(impl_name);
      CHECK(std::string(to_string(r.verdict)) == golden["verdict"].get<std::string>());
      CHECK(failing_checks(r) == golden["failing_checks"].get<std::vector<std::string>>());
      ++judged;
    }
    CHECK(judged > 7);  // the correct head, its seven bugs, and the kind's bugs that apply
  }
}

// Memory beyond h and W while the rank computes, measured by the device's free memory around a second run (the first
// loads the kernels and sizes the library's workspaces): at most one chunk's logits, float32 dh and dW and a fixed
// allowance for cuBLAS's workspace and the rows' small arrays; far below the rank's whole logits.
TEST_CASE("the_cuda_head_holds_one_chunk_of_logits_beside_its_accumulators") {
  const nlohmann::json case_json = {{"name", "head-memory"},
                                    {"shape", {{"tokens", 8192}, {"vocab", 32768}}},
                                    {"stage", {{"kind", "lm_head"}, {"hidden", 512}, {"chunks", 8}}},
                                    {"inputs", {{"seed", 3}, {"dtype", "bf16"}, {"scale", 2.0}}}};
  const Case c = parse_case(case_json, "<test>");
  const InputSource inputs(c);
  const double n = 8192, v = 32768, h = 512, element = 2;
  const double whole_logits = n * v * element;
  const double one_chunk = (n / 8) * v * element;
  const double accumulators = 4.0 * (n * h + v * h);
  const double allowance = 64.0 * 1024 * 1024;
  ThreadWorldOptions world_options;
  run_thread_ranks(world_options, [&](Communicator& world) {
    OwnedRankGroups owned = make_rank_groups(world, c);
    cuda::CudaRankOptions options;
    for (int pass = 0; pass < 2; ++pass) {
      std::size_t free_before = 0, free_during = 0, total = 0;
      LV_CUDA(cudaDeviceSynchronize());
      LV_CUDA(cudaMemGetInfo(&free_before, &total));
      cuda::CudaRankRun run(c, inputs, assign_rank(c, inputs.batch(), 0), owned.view(), BugSwitches{}, options);
      run.compute();
      LV_CUDA(cudaDeviceSynchronize());
      LV_CUDA(cudaMemGetInfo(&free_during, &total));
      if (pass == 0) continue;
      const double held = static_cast<double>(free_before - free_during) - element * (n * h + v * h);
      CAPTURE(held);
      CHECK(static_cast<double>(run.chunk_logit_bytes()) == one_chunk);
      CHECK(run.logit_buffer_bytes() == run.chunk_logit_bytes());  // the gradient written over the logits
      CHECK(held <= one_chunk + accumulators + allowance);
      CHECK(held < whole_logits);
    }
  });
}

// The head's GPU oracle (kinds/lm_head/lm_head_oracle.cpp) against the host's, on the same CUDA head: the same failing
// checks and verdicts, the same element counts; the kind's own checks at margins equal to float64 rounding, and dh, dW
// and db (and the loss, whose tolerance takes the logits' error) at margins at most 2% apart (the GPU's bounds are
// products of magnitudes rounded up by their worst case: never below the host's exact sums of the same bounds, at most
// 2% above them, far less at these vocabularies). Every implementation of the cases' golden outcomes: each catalogued
// bug stays caught, the correct head passes.
TEST_CASE("the_head_gpu_oracle_gives_the_host_oracle_verdicts") {
  const std::vector<std::string> stage_checks = {"dh", "dW", "db"};
  for (const char* name : {"head-ce-tp2-dp2-ga2", "head-ce-bias-upstream-tp4-cp2", "head-kd-tp4-cp2-ga2",
                           "head-ce-confident-bf16-tp2", "head-ce-sp-tp4-cp2-ga2"}) {
    const Case c = load_case_file(std::string("cases/") + name + ".json");
    std::ifstream golden_file(std::string("golden/") + name + ".json");
    const nlohmann::json outcomes = nlohmann::json::parse(golden_file)["outcomes"];
    for (const auto& [impl, golden] : outcomes.items()) {
      if (golden.value("verdict", std::string()) == "not_applicable") continue;
      const std::string case_name = name, impl_name = impl;
      CAPTURE(case_name);
      CAPTURE(impl_name);
      RunOptions options;
      options.implementation = impl;
      options.threads = 2;
      options.device = RunOptions::Device::cuda;
      options.reference = RunOptions::Reference::cpu;
      RunResult host;
      try {
        host = run_case(c, options);
      } catch (const CaseError&) {
        continue;  // not applicable to the case's kind
      }
      options.reference = RunOptions::Reference::gpu;
      const RunResult gpu = run_case(c, options);
      CHECK(host.execution.reference == "cpu");
      CHECK(gpu.execution.reference == "gpu");
      CHECK(failing_checks(gpu) == failing_checks(host));
      REQUIRE(gpu.checks.size() == host.checks.size());
      for (std::size_t k = 0; k < host.checks.size(); ++k) {
        const CheckResult& a = host.checks[k];
        const CheckResult& b = gpu.checks[k];
        CAPTURE(a.name);
        CHECK(a.name == b.name);
        CHECK(a.verdict == b.verdict);
        const bool stage = std::find(stage_checks.begin(), stage_checks.end(), a.name) != stage_checks.end();
        if (stage) CHECK(a.metrics.value("compared", -1) == b.metrics.value("compared", -2));
        if (!std::isfinite(a.margin)) {
          CHECK(!std::isfinite(b.margin));
          continue;
        }
        // The loss's tolerance takes each row's largest logit error, whose sum of magnitudes the GPU rounds up too.
        const bool bounded = stage || a.name == "loss";
        const double allowed = (bounded ? 0.02 : 1e-6) * std::max(1.0, std::fabs(a.margin));
        CHECK(std::fabs(a.margin - b.margin) <= allowed);
      }
    }
  }
}

// A head in front of the policy kind: the GPU oracle has no row model for it, so `--reference gpu` is refused by name
// and the default reference is the host's.
TEST_CASE("the_head_gpu_oracle_refuses_the_policy_kind_and_the_default_falls_back_to_the_host") {
  const Case c = load_case_file("cases/head-policy-bf16-tp2-cp2-ga2.json");
  RunOptions options;
  options.threads = 2;
  options.device = RunOptions::Device::cuda;
  options.reference = RunOptions::Reference::gpu;
  CHECK_THROWS_WITH_AS(run_case(c, options), doctest::Contains("behind the stage lm_head"), CaseError);
  options.reference = RunOptions::Reference::automatic;
  const RunResult r = run_case(c, options);
  CHECK(r.execution.reference == "cpu");
  CHECK(r.verdict == Verdict::pass);
}

// Each compute() is a whole step: a rank that runs several (as the benchmark does) hands over the same dW, db and dh
// as one that runs one, bit for bit (dW was once zeroed only when the rank was made, and summed over the steps).
TEST_CASE("the_cuda_head_starts_every_step_from_zero") {
  const Case c = load_case_file("cases/head-ce-bias-upstream-tp4-cp2.json", {"layout.tp=1", "layout.cp=1"});
  const InputSource inputs(c);
  ThreadWorldOptions world_options;
  run_thread_ranks(world_options, [&](Communicator& world) {
    OwnedRankGroups owned = make_rank_groups(world, c);
    const auto outputs = [&](int steps) {
      cuda::CudaRankRun run(c, inputs, assign_rank(c, inputs.batch(), 0), owned.view(), BugSwitches{},
                            cuda::CudaRankOptions{});
      for (int k = 0; k < steps; ++k) run.compute();
      return run.finish();
    };
    const RankOutput once = outputs(1), thrice = outputs(3);
    REQUIRE(once.stage_params.size() == 2);
    CHECK(!once.stage_params[0].empty());
    CHECK(!once.stage_params[1].empty());
    CHECK(thrice.stage_params == once.stage_params);
    CHECK(thrice.stage_grads == once.stage_grads);
    CHECK(thrice.logged_stats == once.logged_stats);
  });
}

// The head's GPU oracle block by block of a few rows (dW and its bound summed over many products) judges as it does in
// one block: the same verdicts, margins equal to the float64 and float32 roundings of the sums' order.
TEST_CASE("the_head_gpu_oracle_judges_the_same_in_many_blocks") {
  const Case c = load_case_file("cases/head-ce-tp2-dp2-ga2.json");
  for (const char* impl : {"correct", "head-dw-16bit-accumulate", "head-dh-shard-partial"}) {
    const std::string impl_name = impl;
    CAPTURE(impl_name);
    RunOptions options;
    options.implementation = impl;
    options.threads = 2;
    options.device = RunOptions::Device::cuda;
    options.reference = RunOptions::Reference::gpu;
    const RunResult one_block = run_case(c, options);
    setenv("LOSSVERIFY_HEAD_ORACLE_BLOCK_ROWS", "7", 1);
    const RunResult blocks = run_case(c, options);
    unsetenv("LOSSVERIFY_HEAD_ORACLE_BLOCK_ROWS");
    CHECK(failing_checks(blocks) == failing_checks(one_block));
    REQUIRE(blocks.checks.size() == one_block.checks.size());
    for (std::size_t k = 0; k < blocks.checks.size(); ++k) {
      CAPTURE(blocks.checks[k].name);
      CHECK(blocks.checks[k].verdict == one_block.checks[k].verdict);
      CHECK(std::fabs(blocks.checks[k].margin - one_block.checks[k].margin) <=
            1e-5 * std::max(1.0, std::fabs(one_block.checks[k].margin)));
    }
  }
}
