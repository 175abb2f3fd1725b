// Example lossverify plugin, CUDA memory: one rank's vocabulary-parallel cross-entropy with real kernels.
//
//   lossverify run CASE.json --backend cuda --impl plugin:./libcuda_cross_entropy.so
//   lossverify run CASE.json --backend cuda --impl plugin:./libcuda_cross_entropy.so?bug=no-max-shift
//   lossverify run cases/head-ce-tp2-dp2-ga2.json --impl plugin:./libcuda_cross_entropy.so?bug=head-dh-shard-partial
//
// Per micro-batch, one block per row: a kernel takes the shard's row maxima, the TP group all-reduces them
// (M); a second kernel sums S = sum exp(x - M), x_l - M and Z = sum (x - M), which the TP group all-reduces
// in one packed call; a third writes each row's loss and the gradient of the shard's columns. The kernels
// run on the rank's own stream; the collectives take device pointers and copy through the host on the
// legacy default stream, so RankStream brackets each all-reduce (see there). The framework side (which rows
// count, N_v over DP x CP, the weights, the logged loss) runs on the host, from plugin_common.hpp. The LM head in front
// of it is cuda_lm_head.cuh.
#include <lossverify/plugin.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plugin_common.hpp"

namespace {

using namespace lossverify_example;

constexpr int kThreads = 256;  // per block; one block per row

// ---- Host side of CUDA --------------------------------------------------------------------------

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status));
  }
}

template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t count) {
    if (count > 0) check(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)), "cudaMalloc");
  }
  // Destructors cannot throw; a failing cudaFree means a broken context, seen by the next checked call.
  ~DeviceArray() { static_cast<void>(cudaFree(data_)); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& other) noexcept : data_(other.data_) { other.data_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(data_, other.data_);
    return *this;
  }
  T* get() const { return data_; }

 private:
  T* data_ = nullptr;
};

// The rank's own non-blocking stream: ranks sharing a GPU neither wait for one another nor for lossverify.
// lossverify moves data on the legacy default stream (the inputs before run_rank, each all-reduce's result
// on its way back), which such a stream does not wait for by itself, and a copy from pageable host memory
// may still be landing when cudaMemcpy returns: follow_legacy_stream() orders this stream behind it.
class RankStream {
 public:
  RankStream() {
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    const cudaError_t status = cudaEventCreateWithFlags(&legacy_done_, cudaEventDisableTiming);
    if (status != cudaSuccess) static_cast<void>(cudaStreamDestroy(stream_));
    check(status, "cudaEventCreateWithFlags");
  }
  ~RankStream() {
    static_cast<void>(cudaEventDestroy(legacy_done_));
    static_cast<void>(cudaStreamDestroy(stream_));
  }
  RankStream(const RankStream&) = delete;
  RankStream& operator=(const RankStream&) = delete;
  cudaStream_t get() const { return stream_; }

  // Work queued on this stream from now on starts after what the legacy default stream holds now.
  void follow_legacy_stream() const {
    check(cudaEventRecord(legacy_done_, cudaStreamLegacy), "cudaEventRecord (legacy stream)");
    check(cudaStreamWaitEvent(stream_, legacy_done_, 0), "cudaStreamWaitEvent (legacy stream)");
  }

  // A kernel fails at its launch (a bad configuration) or while it runs (a fault): both name it.
  void finish(const char* kernel) const {
    check(cudaGetLastError(), kernel);
    check(cudaStreamSynchronize(stream_), kernel);
  }

  template <class T>
  std::vector<T> download(const T* device, std::int64_t count, const char* what) const {
    std::vector<T> host(static_cast<std::size_t>(count));
    const std::size_t bytes = host.size() * sizeof(T);
    if (bytes > 0) check(cudaMemcpyAsync(host.data(), device, bytes, cudaMemcpyDeviceToHost, stream_), what);
    check(cudaStreamSynchronize(stream_), what);
    return host;
  }

  template <class T>
  void upload(T* device, const std::vector<T>& host, const char* what) const {
    const std::size_t bytes = host.size() * sizeof(T);
    if (bytes > 0) check(cudaMemcpyAsync(device, host.data(), bytes, cudaMemcpyHostToDevice, stream_), what);
    check(cudaStreamSynchronize(stream_), what);  // the caller may free `host` at once
  }

  // The collectives copy `data` through the host on the legacy default stream: the work that wrote it has
  // finished (finish() or a synchronous copy), and later work on this stream waits for the copy back.
  template <class T>
  void allreduce(const Collectives& comm, lv_group group, T* data, std::int64_t count, lv_reduce_op op) const {
    comm.allreduce(group, data, count, op);
    follow_legacy_stream();
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t legacy_done_ = nullptr;
};

// The collectives read and write device memory, so even one count travels through a device slot.
template <class V>
V sum_over_dp_cp(const RankStream& stream, const Collectives& comm, V value) {
  DeviceArray<V> slot(1);
  stream.upload(slot.get(), std::vector<V>{value}, "cudaMemcpyAsync (all-reduce slot)");
  stream.allreduce(comm, LV_GROUP_DP_CP, slot.get(), 1, LV_REDUCE_SUM);
  return stream.download(slot.get(), 1, "cudaMemcpyAsync (all-reduce slot)")[0];
}

// ---- Device helpers -----------------------------------------------------------------------------

__device__ float widen(float x) { return x; }
__device__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float widen(__half x) { return __half2float(x); }

template <class T>
__device__ T narrow(float x);
template <>
__device__ float narrow<float>(float x) {
  return x;
}
template <>
__device__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __half narrow<__half>(float x) {
  return __float2half_rn(x);
}

// The logit as the loss sees it (c tanh(x / c) under a softcap c > 0) and its derivative with respect to x.
struct Logit {
  float value;
  float slope;
};

__device__ Logit capped(float x, float cap) {
  if (cap <= 0.0f) return {x, 1.0f};
  const float t = tanhf(x / cap);
  return {cap * t, 1.0f - t * t};
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Reduces one value per thread over the block (blockDim.x a multiple of 32) in a fixed order, so a row's
// result does not change from run to run; every thread gets the result.
template <class Op>
__device__ float block_reduce(float value, Op op, float identity) {
  __shared__ float warp_results[32];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  if (lane == 0) warp_results[warp] = value;
  __syncthreads();
  value = lane < warps ? warp_results[lane] : identity;  // every warp reduces the partials itself
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // warp_results may be written again by the next call
  return value;
}

// What a kernel needs of a row besides its logits.
struct DeviceRow {
  std::int64_t target;    // the label's column in this shard, -1 when another rank owns it
  float backward_weight;  // scale of the row's gradient (plugin_common.hpp's framework model)
  int valid;              // 0: masked, ignored or CP padding: zero loss, zero gradient
};

// Everything a row's loss and gradient share.
struct LossConstants {
  float softcap;
  float z_loss_weight;
  float q_on_target;
  float q_off_target;
};

// ---- Kernels, one block per row of the micro-batch ----------------------------------------------

// Step 1: the shard's largest (capped) logit of each row; -inf on rows that do not count.
template <class T>
__global__ void row_max_kernel(const T* logits, std::int64_t width, const DeviceRow* rows, float softcap,
                               float* row_max) {
  const std::int64_t i = blockIdx.x;
  if (rows[i].valid == 0) {
    if (threadIdx.x == 0) row_max[i] = -INFINITY;
    return;
  }
  const T* x = logits + i * width;
  float max = -INFINITY;
  for (std::int64_t v = threadIdx.x; v < width; v += blockDim.x) max = fmaxf(max, capped(widen(x[v]), softcap).value);
  max = block_reduce(max, MaxOp{}, -INFINITY);
  if (threadIdx.x == 0) row_max[i] = max;
}

// Step 2: the shard's share of [S | x_l - M | Z] (n rows per part) relative to the all-reduced M.
template <class T>
__global__ void row_sums_kernel(const T* logits, std::int64_t width, const DeviceRow* rows, float softcap,
                                const float* row_max, std::int64_t n, float* packed) {
  const std::int64_t i = blockIdx.x;
  const DeviceRow row = rows[i];
  if (row.valid == 0) {
    if (threadIdx.x == 0) packed[i] = packed[n + i] = packed[2 * n + i] = 0.0f;
    return;
  }
  const T* x = logits + i * width;
  const float m = row_max[i];
  float sum_exp = 0.0f;
  float sum_shifted = 0.0f;
  for (std::int64_t v = threadIdx.x; v < width; v += blockDim.x) {
    const float shifted = capped(widen(x[v]), softcap).value - m;
    sum_exp += expf(shifted);
    sum_shifted += shifted;
  }
  sum_exp = block_reduce(sum_exp, SumOp{}, 0.0f);
  sum_shifted = block_reduce(sum_shifted, SumOp{}, 0.0f);
  if (threadIdx.x == 0) {
    packed[i] = sum_exp;
    packed[n + i] = row.target >= 0 ? capped(widen(x[row.target]), softcap).value - m : 0.0f;
    packed[2 * n + i] = sum_shifted;
  }
}

// Step 3 from the all-reduced sums, without taking log p:
//   l = log S - [q_off Z + (q_on - q_off)(x_l - M)] + w_z lse^2         (sum_v q_v = 1 cancels M)
//   dl/dx_v = [p_v (1 + 2 w_z lse) - q_v] (1 - tanh^2(x_v / c) under a softcap c), times the row's weight.
template <class T>
__global__ void loss_grad_kernel(const T* logits, std::int64_t width, const DeviceRow* rows, const float* row_max,
                                 const float* packed, std::int64_t n, LossConstants k, float* token_loss, T* grad) {
  const std::int64_t i = blockIdx.x;
  const DeviceRow row = rows[i];
  const T* x = logits + i * width;
  T* g = grad + i * width;
  if (row.valid == 0) {
    if (threadIdx.x == 0) token_loss[i] = 0.0f;
    for (std::int64_t v = threadIdx.x; v < width; v += blockDim.x) g[v] = narrow<T>(0.0f);
    return;
  }
  const float m = row_max[i];
  const float log_sum = logf(packed[i]);
  const float lse = m + log_sum;
  if (threadIdx.x == 0) {
    const float smoothing_term = k.q_off_target * packed[2 * n + i] + (k.q_on_target - k.q_off_target) * packed[n + i];
    token_loss[i] = log_sum - smoothing_term + k.z_loss_weight * lse * lse;
  }
  const float z_factor = 1.0f + 2.0f * k.z_loss_weight * lse;
  for (std::int64_t v = threadIdx.x; v < width; v += blockDim.x) {
    const Logit logit = capped(widen(x[v]), k.softcap);
    const float p = expf((logit.value - m) - log_sum);
    const float q = v == row.target ? k.q_on_target : k.q_off_target;
    g[v] = narrow<T>(row.backward_weight * ((p * z_factor - q) * logit.slope));
  }
}

}  // namespace

#include "cuda_lm_head.cuh"

namespace {

// ---- The rank -----------------------------------------------------------------------------------

constexpr std::string_view kNoMaxShift = "bug=no-max-shift";
constexpr std::string_view kHeadDhShardPartial = "bug=head-dh-shard-partial";
constexpr std::initializer_list<std::string_view> kParameters = {kNoMaxShift, kHeadDhShardPartial};

struct Options {
  // The textbook softmax: exp(x) with M = 0, no max all-reduce; inf/NaN once a logit exceeds ~88.7.
  bool no_max_shift = false;
  HeadBugs head;
};

Options parse_options(const char* params) {
  const std::vector<std::string_view> given = parse_bug_parameters(params == nullptr ? "" : params, kParameters);
  Options options;
  options.no_max_shift = has_parameter(given, kNoMaxShift);
  options.head.dh_shard_partial = has_parameter(given, kHeadDhShardPartial);
  return options;
}

// The rank's device side: its rows' descriptors, and scratch for the largest micro-batch.
struct Workspace {
  DeviceArray<DeviceRow> rows;
  DeviceArray<float> row_max;
  DeviceArray<float> packed;  // [S | x_l - M | Z]
};

std::int64_t largest_micro_batch(const lv_rank_inputs& in) {
  std::int64_t largest = 0;
  for (std::int32_t k = 0; k < in.ga; ++k) {
    largest = std::max(largest, in.micro_batch_begin[k + 1] - in.micro_batch_begin[k]);
  }
  return largest;
}

std::vector<DeviceRow> device_rows(const lv_rank_inputs& in, const BatchPlan& plan,
                                   const std::vector<std::int64_t>& labels) {
  std::vector<DeviceRow> rows(plan.rows.size());
  const std::int64_t width = in.vocab_end - in.vocab_begin;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::int64_t column = labels[i] - in.vocab_begin;
    const bool owned = column >= 0 && column < width;
    rows[i] = {owned ? column : -1, plan.rows[i].backward_weight, plan.rows[i].valid ? 1 : 0};
  }
  return rows;
}

LossConstants loss_constants(const lv_loss_config& loss, std::int64_t vocab) {
  const TargetWeights q = target_weights(loss, static_cast<double>(vocab));
  return {static_cast<float>(loss.softcap), static_cast<float>(loss.z_loss_weight), q.on_target, q.off_target};
}

template <class T>
void cross_entropy_micro_batch(const lv_rank_inputs& in, lv_rank_outputs& out, std::int64_t begin, std::int64_t end,
                               const Options& options, const Workspace& work, const RankStream& stream,
                               const Collectives& comm) {
  const std::int64_t width = in.vocab_end - in.vocab_begin;
  const std::int64_t n = end - begin;
  const T* logits = static_cast<const T*>(in.logits) + begin * width;
  const DeviceRow* rows = work.rows.get() + begin;
  const LossConstants k = loss_constants(in.loss, in.vocab_size);
  const auto blocks = static_cast<unsigned>(n);

  if (options.no_max_shift) {
    const auto bytes = static_cast<std::size_t>(n) * sizeof(float);
    check(cudaMemsetAsync(work.row_max.get(), 0, bytes, stream.get()), "cudaMemsetAsync (row_max = 0)");
  } else {
    row_max_kernel<T><<<blocks, kThreads, 0, stream.get()>>>(logits, width, rows, k.softcap, work.row_max.get());
    stream.finish("row_max_kernel");
    stream.allreduce(comm, LV_GROUP_TP, work.row_max.get(), n, LV_REDUCE_MAX);
  }
  row_sums_kernel<T>
      <<<blocks, kThreads, 0, stream.get()>>>(logits, width, rows, k.softcap, work.row_max.get(), n, work.packed.get());
  stream.finish("row_sums_kernel");
  stream.allreduce(comm, LV_GROUP_TP, work.packed.get(), 3 * n, LV_REDUCE_SUM);
  loss_grad_kernel<T><<<blocks, kThreads, 0, stream.get()>>>(logits, width, rows, work.row_max.get(), work.packed.get(),
                                                             n, k, out.token_loss + begin,
                                                             static_cast<T*>(out.grad) + begin * width);
  stream.finish("loss_grad_kernel");  // lossverify reads the outputs on the legacy stream
}

template <class T>
void run_typed(const lv_rank_inputs& in, lv_rank_outputs& out, const Options& options, const Collectives& comm) {
  const RankStream stream;
  stream.follow_legacy_stream();  // lossverify's copies of the inputs
  // The framework side reads a few numbers per row: bring them to the host.
  const std::vector<std::int64_t> labels = stream.download(in.labels, in.rows, "cudaMemcpyAsync (labels)");
  const std::vector<std::uint8_t> loss_mask = stream.download(in.loss_mask, in.rows, "cudaMemcpyAsync (loss_mask)");
  const std::vector<double> upstream =
      stream.download(in.upstream_weights, in.rows, "cudaMemcpyAsync (upstream_weights)");
  auto sum = [&stream, &comm](auto value) { return sum_over_dp_cp(stream, comm, value); };
  const BatchPlan plan = plan_batch(in, HostRows{labels.data(), loss_mask.data(), upstream.data()}, sum);

  const auto scratch = static_cast<std::size_t>(largest_micro_batch(in));
  const Workspace work{DeviceArray<DeviceRow>(plan.rows.size()), DeviceArray<float>(scratch),
                       DeviceArray<float>(3 * scratch)};
  stream.upload(work.rows.get(), device_rows(in, plan, labels), "cudaMemcpyAsync (row descriptors)");
  // Behind an LM head the kind reads the head's logits (one buffer of the rank's rows: an example, not a fused head).
  DeviceArray<T> head_u(0);
  lv_rank_inputs kind_in = in;
  if (has_head(in)) {
    head_u = head_logits<T>(in, stream);
    kind_in.logits = head_u.get();
  }
  for (std::int32_t k = 0; k < in.ga; ++k) {
    const std::int64_t begin = in.micro_batch_begin[k], end = in.micro_batch_begin[k + 1];
    // An empty micro-batch: the TP peers, holding the same rows, skip it too.
    if (end == begin) continue;
    cross_entropy_micro_batch<T>(kind_in, out, begin, end, options, work, stream, comm);
  }
  if (has_head(in)) head_backward<T>(in, out, options.head, stream, comm);

  out.grad_rows = in.rows;
  out.grad_columns = in.vocab_end - in.vocab_begin;
  out.token_loss_count = in.rows;
  out.logged_num_tokens = plan.valid_tokens;
  out.has_logged_loss = in.loss.reduction != LV_REDUCTION_NONE;
  if (out.has_logged_loss != 0) {
    const std::vector<float> token_loss = stream.download(out.token_loss, in.rows, "cudaMemcpyAsync (token_loss)");
    out.logged_loss = logged_loss(plan, token_loss.data(), sum);
  }
}

void run(const lv_rank_inputs& in, lv_rank_outputs& out, const Collectives& comm) {
  check_rank_inputs(in, out);
  if (in.memory != LV_MEMORY_CUDA) throw std::invalid_argument("inputs are not in CUDA memory");
  if (in.loss.kind != LV_LOSS_CROSS_ENTROPY) throw std::invalid_argument("this plugin computes cross-entropy only");
  const Options options = parse_options(in.params);
  switch (in.dtype) {
    case LV_DTYPE_F32:
      return run_typed<float>(in, out, options, comm);
    case LV_DTYPE_BF16:
      return run_typed<__nv_bfloat16>(in, out, options, comm);
    case LV_DTYPE_F16:
      return run_typed<__half>(in, out, options, comm);
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<int>(in.dtype)));
}

int run_rank(const lv_rank_inputs* inputs, lv_rank_outputs* outputs, const lv_collectives* collectives) {
  return run_guarded(*outputs, [&] { run(*inputs, *outputs, Collectives(*collectives)); });
}

int check_params(const char* params, char* error, size_t error_size) {
  return check_bug_parameters(params, kParameters, error, error_size);
}

const lv_plugin kPlugin = {
    LV_PLUGIN_ABI_VERSION,
    "example-cuda-cross-entropy",
    "example plugin: vocabulary-parallel cross-entropy in CUDA kernels, and the LM head in front of it "
    "(bug=no-max-shift, bug=head-dh-shard-partial available)",
    LV_MEMORY_CUDA,
    LV_SUPPORTS_CROSS_ENTROPY | LV_SUPPORTS_LM_HEAD,
    run_rank,
    check_params,
};

}  // namespace

extern "C" const lv_plugin* lossverify_plugin(void) { return &kPlugin; }
