// The LM head on the CUDA backend (kind_api/cuda_stage.hpp), as a fused head computes it: the rank's h, W_r (its
// shard of W) and b_r generated on its GPU from the stage's Philox streams, then chunk by chunk of its rows, so that
// no more than one chunk's logits exist at a time:
//   forward   u = h W_r^T (+ b_r): one cuBLAS product, bf16/fp16/fp32 operands, float32 accumulation, rounded once to
//             the dtype into the kind's buffer;
//   backward  from the kind's gradient g (the dtype) of the chunk: dh = g W_r (summed over TP where the head's
//             contract says so), dW_r += g^T h and db_r += sum_t g_t, accumulated over the chunks in float32.
// No TF32 anywhere (CUBLAS_COMPUTE_32F): the error model (docs/spec.md §11) is float32 accumulation of exact
// products. The catalogued bugs are switches of head_bug, as on the CPU (lm_head_cpu.cpp).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/generate_rows.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/cuda_stage.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/kinds/lm_head/lm_head_cublas.hpp"
#include "lossverify/kinds/lm_head/lm_head_kernels.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::cuda {

namespace {

cudaDataType data_type(StorageType t) {
  return t == StorageType::fp32 ? CUDA_R_32F : t == StorageType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
}

// One operand of a column-major product: its pointer, type and leading dimension.
struct Operand {
  const void* data;
  cudaDataType type;
  std::int64_t ld;
};

// C (m x n, column major) = op_a(A) op_b(B) + beta C, float32 accumulation.
void product(cublasHandle_t handle, cublasOperation_t op_a, cublasOperation_t op_b, std::int64_t m, std::int64_t n,
             std::int64_t k, Operand a, Operand b, float beta, void* c, cudaDataType c_type, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.0f;
  check_cublas(
      cublas_library().gemm_ex(handle, op_a, op_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                               &alpha, a.data, a.type, static_cast<int>(a.ld), b.data, b.type, static_cast<int>(b.ld),
                               &beta, c, c_type, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

class LmHeadCudaRank final : public CudaStageRank {
 public:
  explicit LmHeadCudaRank(const CudaStageSetup& s)
      : s_(s),
        o_(head_options(s.c.loss)),
        element_(dtype_size(s.c.inputs.dtype)),
        hidden_(o_.hidden),
        rows_(static_cast<std::int64_t>(s.assignment.rows.size())),
        own_(s.assignment.vocab),
        own_offset_(own_.begin - s.work_begin),
        stream_(static_cast<cudaStream_t>(s.stream)),
        cublas_(stream_),
        d_hidden_(bytes(rows_ * hidden_)),
        d_weight_(bytes(s.cols * hidden_)),
        d_bias_(bytes(o_.bias ? s.cols : 0)),
        d_dh_(bytes(rows_ * hidden_)),
        d_dw_(static_cast<std::size_t>(own_.size() * hidden_) * sizeof(float)),
        d_db_(static_cast<std::size_t>(o_.bias ? own_.size() : 0) * sizeof(float)),
        d_db_part_(d_db_.size()),
        d_dw_part_(narrow() ? d_dw_.size() : 0),
        d_scaled_(scaled() ? bytes(s.chunk_rows * s.cols) : 0),
        tp_sums_(tp_sums(s)),
        d_dh_part_(tp_sums_ > 0 ? static_cast<std::size_t>(s.chunk_rows * hidden_) * sizeof(float) : 0),
        h_dh_part_(d_dh_part_.size()) {
    generate_inputs();
    if (scaled()) upload_row_scales();
    if ((s.bugs.stage_switches & head_bug::bias_repeated) != 0 && o_.bias) upload_targets();
  }

  // dh, dW_r and db_r start from zero: dW_r and db_r are summed over the step's chunks. dW_r's first product of the
  // step overwrites it instead (beta 0), which spares clearing a V x H accumulator every step.
  void start_step() override {
    LV_CUDA(cudaMemsetAsync(d_dh_.as<void>(), 0, d_dh_.size(), stream_));
    if (d_db_.size() > 0) LV_CUDA(cudaMemsetAsync(d_db_.as<void>(), 0, d_db_.size(), stream_));
    if (narrow()) LV_CUDA(cudaMemsetAsync(d_dw_.as<void>(), 0, d_dw_.size(), stream_));
    dw_written_ = narrow();
  }

  // head-target-rounded-early, behind cross-entropy only (a fused linear cross-entropy's step; lm_head_cpu.cpp): the
  // rows' true-class columns among the rank's own and their weights.
  void row_weights(std::span<const float> weights) override {
    if ((s_.bugs.stage_switches & head_bug::target_rounded_early) == 0) return;
    if (kind_of(s_.c.loss).name() != "cross_entropy") return;
    std::vector<std::int64_t> target(static_cast<std::size_t>(rows_), -1);
    for (std::size_t i = 0; i < target.size(); ++i) {
      const std::int64_t t = s_.assignment.rows[i].token;
      if (t < 0 || !s_.inputs.is_valid(t)) continue;
      const std::int64_t label = s_.inputs.label(t);
      if (label >= own_.begin && label < own_.end) target[i] = label - own_.begin;
    }
    d_own_target_ = upload(target, stream_);
    d_weight_of_row_ = upload(weights.data(), weights.size(), stream_);
  }

  void forward(std::int64_t first, std::int64_t n) override {
    const cudaDataType t = data_type(s_.type);
    float beta = 0.0f;
    if (o_.bias) {
      head_broadcast_bias(s_.type, d_bias_.as<void>(), s_.logits, n, s_.cols, stream_);
      beta = 1.0f;
    }
    // u^T (cols x n, column major) = W_r (H x cols)^T h^T (H x n)
    product(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, s_.cols, n, hidden_, {d_weight_.as<void>(), t, hidden_},
            {hidden_rows(first), t, hidden_}, beta, s_.logits, t, s_.cols);
    if (d_target_.size() > 0) {
      head_repeat_bias(s_.type, d_bias_.as<void>(), d_target_.as<std::int64_t>() + first, s_.logits, n, s_.cols,
                       stream_);
    }
    LV_CUDA(cudaGetLastError());
  }

  void backward(std::int64_t first, std::int64_t n, RankGroups& groups) override {
    const cudaDataType t = data_type(s_.type);
    const std::int64_t own = own_.size();
    std::byte* const own_g = s_.logit_grad + static_cast<std::size_t>(own_offset_) * element_;
    const std::byte* g = own_g;
    if (d_own_target_.size() > 0) {
      head_round_target_early(s_.type, own_g, s_.cols, d_own_target_.as<std::int64_t>() + first,
                              d_weight_of_row_.as<float>() + first, n, stream_);
    }
    const Operand w{d_weight_.as<std::byte>() + static_cast<std::size_t>(own_offset_ * hidden_) * element_, t, hidden_};
    // dh^T (H x n) = W_r^T (H x own) g^T (own x n)
    std::byte* dh = d_dh_.as<std::byte>() + static_cast<std::size_t>(first * hidden_) * element_;
    if (tp_sums_ == 0) {
      product(cublas_.get(), CUBLAS_OP_N, CUBLAS_OP_N, hidden_, n, own, w, {g, t, s_.cols}, 0.0f, dh, t, hidden_);
    } else {
      product(cublas_.get(), CUBLAS_OP_N, CUBLAS_OP_N, hidden_, n, own, w, {g, t, s_.cols}, 0.0f, d_dh_part_.as<void>(),
              CUDA_R_32F, hidden_);
      sum_over_tp(n, groups);
      head_store(s_.type, d_dh_part_.as<float>(), dh, n * hidden_, stream_);
    }
    // dW_r^T (H x own) += h^T (H x n) g (n x own); db_r += sum_t g_t
    if (scaled()) {
      head_scale_rows(s_.type, s_.logit_grad, d_row_scale_.as<float>() + first, d_scaled_.as<void>(), n, s_.cols,
                      stream_);
      g = d_scaled_.as<std::byte>() + static_cast<std::size_t>(own_offset_) * element_;
    }
    // Over the stage's own chunks of these rows (a micro-batch's logits may be held whole, for a kind whose rows depend
    // on one another): one accumulation of dW and db each, as lossverify's CPU head accumulates them.
    const std::int64_t step = std::max<std::int64_t>(1, s_.accumulate_rows);
    for (std::int64_t part = 0; part < n; part += step) {
      accumulate_parameters(first + part, std::min(step, n - part), g + bytes(part * s_.cols));
    }
    LV_CUDA(cudaGetLastError());
  }

  // dW_r^T (H x own) += h^T (H x n) g (n x own) and db_r += sum_t g_t over the rank's rows [first, first + n), g their
  // own columns of the kind's gradient.
  void accumulate_parameters(std::int64_t first, std::int64_t n, const std::byte* g) {
    const cudaDataType t = data_type(s_.type);
    const std::int64_t own = own_.size();
    const Operand h{hidden_rows(first), t, hidden_};
    if (narrow()) {
      product(cublas_.get(), CUBLAS_OP_N, CUBLAS_OP_T, hidden_, own, n, h, {g, t, s_.cols}, 0.0f, d_dw_part_.as<void>(),
              CUDA_R_32F, hidden_);
      head_accumulate(s_.type, d_dw_.as<float>(), d_dw_part_.as<float>(), own * hidden_, true, stream_);
    } else {
      product(cublas_.get(), CUBLAS_OP_N, CUBLAS_OP_T, hidden_, own, n, h, {g, t, s_.cols}, dw_written_ ? 1.0f : 0.0f,
              d_dw_.as<void>(), CUDA_R_32F, hidden_);
      dw_written_ = true;
    }
    if (o_.bias) {
      head_column_sums(s_.type, g, s_.cols, d_db_part_.as<float>(), n, own, stream_);
      head_accumulate(s_.type, d_db_.as<float>(), d_db_part_.as<float>(), own, narrow(), stream_);
    }
  }

  void finish(RankOutput& out) override {
    if (!dw_written_) LV_CUDA(cudaMemsetAsync(d_dw_.as<void>(), 0, d_dw_.size(), stream_));  // a rank without rows
    out.stage_columns = {hidden_};
    // The rows whose dh the rank reports (Stage::gradient_rows): all of them, or under sequence parallelism with the
    // head's contract its token shard's, each already summed over TP (a reduce-scatter's values).
    out.stage_rows = s_.c.loss.stage->gradient_rows(s_.c, s_.assignment);
    std::vector<std::byte> all(d_dh_.size());
    download(d_dh_, all);
    LV_CUDA(cudaStreamSynchronize(stream_));
    const std::size_t row_bytes = bytes(hidden_);
    out.stage_grads.assign(1, std::vector<std::byte>(out.stage_rows.size() * row_bytes));
    for (std::size_t k = 0; k < out.stage_rows.size(); ++k) {
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(out.stage_rows[k]) * row_bytes),
                  row_bytes, out.stage_grads[0].begin() + static_cast<std::ptrdiff_t>(k * row_bytes));
    }
    out.stage_params.assign(2, {});
    out.stage_params[0] = stored(d_dw_, own_.size() * hidden_);
    if (o_.bias) out.stage_params[1] = stored(d_db_, own_.size());
    LV_CUDA(cudaStreamSynchronize(stream_));
  }

 private:
  std::size_t bytes(std::int64_t count) const { return static_cast<std::size_t>(count) * element_; }
  const void* hidden_rows(std::int64_t first) const { return d_hidden_.as<std::byte>() + bytes(first * hidden_); }
  bool narrow() const { return (s_.bugs.stage_switches & head_bug::dw_16bit_accumulate) != 0; }
  bool scaled() const { return (s_.bugs.stage_switches & head_bug::grad_output_first) != 0; }
  // How many times dh is summed over the TP group: once under the head's contract, never under the framework's,
  // as the catalogued bugs change it; never over a group of one (a sum over one rank is that rank's dh).
  static int tp_sums(const CudaStageSetup& s) {
    if (s.tp_ranks == 1) return 0;
    const bool head_sums = head_options(s.c.loss).dh_reduce == HeadOptions::DhReduce::head;
    int sums = head_sums ? 1 : 0;
    if ((s.bugs.stage_switches & head_bug::dh_shard_partial) != 0 && head_sums) sums = 0;
    if ((s.bugs.stage_switches & head_bug::dh_double_reduce) != 0) ++sums;
    return sums;
  }

  void generate_inputs() {
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(rows_));
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      // A CP padding row takes a row of h no token uses (past the last): its logits are masked, its g zero.
      const std::int64_t t = s_.assignment.rows[i].token;
      tokens[i] = t >= 0 ? t : s_.c.shape.tokens + static_cast<std::int64_t>(i);
    }
    const auto st = static_cast<cudaStream_t>(s_.stream);
    generate_normal_rows(s_.c.inputs.seed, s_.type, InputStream::head_hidden, tokens, 0, hidden_, o_.hidden_scale,
                         d_hidden_.as<void>(), st);
    std::vector<std::int64_t> columns(static_cast<std::size_t>(s_.cols));
    for (std::size_t v = 0; v < columns.size(); ++v) columns[v] = s_.work_begin + static_cast<std::int64_t>(v);
    generate_normal_rows(s_.c.inputs.seed, s_.type, InputStream::head_weight, columns, 0, hidden_,
                         head_weight_scale(s_.c), d_weight_.as<void>(), st);
    if (o_.bias) {
      generate_normal_rows(s_.c.inputs.seed, s_.type, InputStream::head_bias, {0}, s_.work_begin,
                           s_.work_begin + s_.cols, head_bias_scale(s_.c), d_bias_.as<void>(), st);
    }
  }

  // head-grad-output-first: each row's g rescaled to the first valid token's upstream weight (lm_head_cpu.cpp).
  void upload_row_scales() {
    std::vector<float> scale(static_cast<std::size_t>(rows_), 1.0f);
    double first = 0.0;
    for (std::size_t i = 0; i < scale.size(); ++i) {
      const std::int64_t t = s_.assignment.rows[i].token;
      if (t < 0 || !s_.inputs.is_valid(t)) continue;
      if (first == 0.0) first = s_.inputs.upstream_weight(t);
      scale[i] = static_cast<float>(first / s_.inputs.upstream_weight(t));
    }
    d_row_scale_ = upload(scale, stream_);
  }
  // head-bias-repeated: each row's target column among the kernel's, -1 where not there.
  void upload_targets() {
    std::vector<std::int64_t> target(static_cast<std::size_t>(rows_), -1);
    for (std::size_t i = 0; i < target.size(); ++i) {
      const std::int64_t t = s_.assignment.rows[i].token;
      if (t < 0) continue;
      const std::int64_t j = s_.inputs.label(t) - s_.work_begin;
      if (j >= 0 && j < s_.cols) target[i] = j;
    }
    d_target_ = upload(target, stream_);
  }

  void sum_over_tp(std::int64_t n, RankGroups& groups) {
    const std::size_t count = static_cast<std::size_t>(n * hidden_);
    float* host = h_dh_part_.as<float>();
    LV_CUDA(cudaMemcpyAsync(host, d_dh_part_.as<void>(), count * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    LV_CUDA(cudaStreamSynchronize(stream_));
    for (int k = 0; k < tp_sums_; ++k) groups.tp.allreduce_sum(std::span<float>(host, count));
    LV_CUDA(cudaMemcpyAsync(d_dh_part_.as<void>(), host, count * sizeof(float), cudaMemcpyHostToDevice, stream_));
  }

  void download(const DeviceBytes& from, std::vector<std::byte>& to) {
    if (!to.empty()) LV_CUDA(cudaMemcpyAsync(to.data(), from.as<void>(), to.size(), cudaMemcpyDeviceToHost, stream_));
  }
  // A float32 accumulator rounded once to the dtype, on the host.
  std::vector<std::byte> stored(const DeviceBytes& accumulator, std::int64_t count) {
    DeviceBytes narrowed(bytes(count));
    head_store(s_.type, accumulator.as<float>(), narrowed.as<void>(), count, stream_);
    std::vector<std::byte> out(narrowed.size());
    download(narrowed, out);
    LV_CUDA(cudaStreamSynchronize(stream_));
    return out;
  }

  const CudaStageSetup s_;
  const HeadOptions& o_;
  const std::size_t element_;
  const std::int64_t hidden_, rows_;
  const VocabRange own_;           // the rank's columns of W and of dW (the kernel's may be wider)
  const std::int64_t own_offset_;  // their first among the kernel's

  cudaStream_t stream_;
  CublasHandle cublas_;
  DeviceBytes d_hidden_, d_weight_, d_bias_;  // rows x H, kernel columns x H, kernel columns (the dtype)
  DeviceBytes d_dh_;                          // rows x H (the dtype)
  DeviceBytes d_dw_, d_db_, d_db_part_;       // own x H, own, own (float32 accumulators)
  DeviceBytes d_dw_part_;                     // own x H: a chunk's dW (head-dw-16bit-accumulate)
  bool dw_written_ = false;                   // this step has written d_dw_
  DeviceBytes d_scaled_;                      // a chunk's rescaled g (head-grad-output-first)
  const int tp_sums_;
  DeviceBytes d_dh_part_;  // a chunk's dh in float32, before the TP sum
  PinnedBytes h_dh_part_;
  DeviceBytes d_row_scale_{0}, d_target_{0};
  DeviceBytes d_own_target_{0}, d_weight_of_row_{0};  // head-target-rounded-early
};

}  // namespace

std::unique_ptr<CudaStageRank> make_lm_head_cuda_rank(const CudaStageSetup& setup) {
  return std::make_unique<LmHeadCudaRank>(setup);
}

}  // namespace lossverify::cuda
