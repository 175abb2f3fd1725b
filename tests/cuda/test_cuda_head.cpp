// The LM head stage on the CUDA backend: the golden outcomes of every head case and catalogued bug (as the CPU gives
// them), and the device memory it holds beyond its inputs: one chunk's logits, never the whole rank's.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
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
