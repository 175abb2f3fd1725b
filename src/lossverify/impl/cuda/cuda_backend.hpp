#pragma once
// The CUDA backend, host side: one rank's sharded loss on a GPU. Inputs are generated on the device
// from the same Philox streams as the CPU (bit-identical), the rank plan (labels, counts, framework
// weights) is the CPU's, the collectives between TP ranks go through the rank's Communicator on small
// per-row statistics, and the outputs land in a RankOutput that the same verification checks.
// Without the CUDA toolkit at build time every entry point says so (exit code 3).
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/cpu/sharded_loss.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::cuda {

bool built_with_cuda();
// Throws InternalError naming why the device cannot be used (no driver, no GPU, not built with CUDA).
void require_device(int device);
int visible_devices();
// Whether a loss kind has a CUDA implementation (kinds/cuda_kind.hpp); a stage (kind_api/cuda_stage.hpp).
bool runs_kind(std::string_view kind_name);
bool runs_stage(std::string_view stage_name);

struct CudaRankOptions {
  int device = 0;
  // Leave the inputs and the gradient on the GPU (RankOutput::device_shard) for the GPU reference.
  bool keep_on_device = false;
};
RankOutput run_sharded_loss(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                            const BugSwitches& bugs, const CudaRankOptions& options);

// `lossverify bench --backend cuda`: a device-to-device copy for the bandwidth ceiling, then the fused
// forward+backward cross-entropy (TP = 1) or the two kernels around the all-reduce (TP > 1) on fresh
// random inputs, checked against the float64 reference on sampled rows, timed with events.
struct BenchOptions {
  std::int64_t tokens = 16384;
  std::int64_t vocab = 128256;
  DType dtype = DType::bf16;
  int tp = 1;
  double label_smoothing = 0.1;
  int repeats = 20;
  int device = 0;
  int hidden = 4096;  // bench_head: H, and the head's chunks of the tokens
  int chunks = 4;
};
nlohmann::json bench(const BenchOptions& options);
// The LM head in front of cross-entropy (kinds/lm_head/lm_head_bench.cpp): the CUDA backend's head, forward and
// backward, against the three plain cuBLAS products of the same shapes; its memory beyond the inputs; sampled tokens
// checked in float64.
nlohmann::json bench_head(const BenchOptions& options);
// The same for the policy kind's kernels (kinds/policy/policy_bench.cpp): a log-prob and entropy pass.
nlohmann::json bench_policy(const BenchOptions& options);
// The router kind's kernels (kinds/router/router_bench.cpp): one scope of N tokens x V experts, fp32, top-8.
nlohmann::json bench_router(const BenchOptions& options);

// `lossverify bench --gpus N`: the TP-sharded step on N GPUs (one thread rank each) with the NCCL collectives
// between them: the kernels against their floor, the collectives against a latency + size/bandwidth model
// fitted to a message-size sweep, the whole step against the sum; checked on sampled rows.
struct MultiGpuBenchOptions {
  std::int64_t tokens = 16384;
  std::int64_t vocab = 128256;  // the global vocabulary, split over the GPUs
  DType dtype = DType::bf16;
  int gpus = 2;
  double label_smoothing = 0.1;
  int repeats = 20;
};
nlohmann::json bench_multi_gpu(const MultiGpuBenchOptions& options);

}  // namespace lossverify::cuda
