// The LM head's GPU oracle (kind_api/cuda_stage.hpp's cuda_stage_oracle_factory): the float64 reference of
// lm_head_reference.cpp evaluated on the rank's GPU, for a head in front of a kind the device row models evaluate
// (cross-entropy and KD; the policy kind's reference places its inputs against whole rows of logits on the host).
//
// Before the implementation runs it generates its own h (the rank's rows), the whole of W and b from the stage's
// Philox streams into buffers no implementation sees, and keeps them in float64 (and their magnitudes in float32).
// Then, from its own inputs only:
//   row_partials   u = h W^T + b by a float64 product (cuBLAS DGEMM: products of 16-bit or float32 values are exact in
//                  float64), each row's largest logit error of the head's model from sum_k |h_k W_vk| (a float32
//                  product of magnitudes, rounded up by its own worst case), and the kind's partials over the rank's
//                  columns (lm_head_oracle_kernels.cu);
//   start_judging  row block by row block, the kind's gradient g of whole rows and its bound e, then dh = g W (over the
//                  columns the dh contract sums), dW_r = g^T h and db_r = sum_t g_t by float64 products, and their
//                  bounds sum e |W| + gamma sum (|g| + e) |W| (and with |h|) as float32 products of magnitudes rounded
//                  up by their worst case: at most about 2% above the host oracle's exact sums of the same bounds
//                  (1.6% at V = 128256), never below them;
//   the judgement  the rank's dh, dW and db (copies of its outputs) against those, element by element, by the GPU
//                  reference's comparison kernel with each element's bound as its slack (reference_kernels.hpp).
// At N = 16384, H = 4096, V = 128256 the three float64 products are about 0.9 s of an H200 (docs/performance.md).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <unordered_map>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/checks/oracle.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/generate_rows.hpp"
#include "lossverify/cuda/shard_inputs.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/kinds/lm_head/lm_head_cublas.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/lm_head/lm_head_oracle_kernels.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"
#include "lossverify/oracle/cuda/gpu_reference.hpp"
#include "lossverify/oracle/cuda/reference_kernels.hpp"
#include "lossverify/outputs/rank_output.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify::cuda {

namespace {

// A float32 product of non-negative float64 factors (each rounded up to float32, then to TF32 by the tensor cores:
// at most 2^-10 below in relative terms, either factor) summing n terms in float32 (at most gamma_n below with
// round-to-nearest additions; a tensor core's accumulator may truncate, so twice that) and stored as a float32 (2^-24):
// the exact sum is at most the result times this.
double magnitude_inflation(double n) {
  const double tf32 = 0x1p-10, u = 0x1p-24;
  const double below = (1.0 - tf32) * (1.0 - tf32) * (1.0 - 2.0 * n * u / (1.0 - 2.0 * n * u)) * (1.0 - u);
  return (1.0 + 0x1p-40) / below;  // the factor's own roundings
}

// The rank's rows in blocks of at most this many float64 logits each (2 GiB); LOSSVERIFY_HEAD_ORACLE_BLOCK_ROWS sets
// the rows of a block instead (docs/tuning.md: tests take many blocks of a small case).
std::int64_t block_rows(std::int64_t vocab) {
  if (const char* e = std::getenv("LOSSVERIFY_HEAD_ORACLE_BLOCK_ROWS"); e != nullptr && std::atoll(e) > 0) {
    return std::atoll(e);
  }
  constexpr std::int64_t kBlockElements = std::int64_t{1} << 28;
  return std::max<std::int64_t>(1, kBlockElements / std::max<std::int64_t>(1, vocab));
}

// The oracle's own inputs on its GPU, generated before the implementation runs.
struct HeadDeviceInputs {
  HeadDeviceInputs(const Case& c, const InputSource& inputs, const RankAssignment& assignment, int device_in)
      : device(device_in),
        rows(static_cast<std::int64_t>(assignment.rows.size())),
        vocab(c.shape.vocab),
        hidden(head_options(c.loss).hidden),
        type(storage_of(c.inputs.dtype)),
        cublas(stream.get()),
        h(bytes64(rows * hidden)),
        h_abs(bytes32(rows * hidden)),
        w(bytes64(vocab * hidden)),
        w_abs(bytes32(vocab * hidden)),
        b(bytes64(head_options(c.loss).bias ? vocab : 0)) {
    if (inputs.is_explicit()) throw InternalError("the head's GPU oracle generates its inputs from the case's streams");
    const cudaStream_t s = stream.get();
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(rows));
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = std::max<std::int64_t>(assignment.rows[i].token, 0);
    std::vector<std::int64_t> columns(static_cast<std::size_t>(vocab));
    for (std::size_t v = 0; v < columns.size(); ++v) columns[v] = static_cast<std::int64_t>(v);
    const HeadOptions& o = head_options(c.loss);
    generate(c, InputStream::head_hidden, tokens, 0, hidden, o.hidden_scale, h, &h_abs);
    generate(c, InputStream::head_weight, columns, 0, hidden, head_weight_scale(c), w, &w_abs);
    if (o.bias) generate(c, InputStream::head_bias, {0}, 0, vocab, head_bias_scale(c), b, nullptr);
    if (kind_of(c.loss).inputs().teacher_logits) {
      // The KD teacher's logits of the rank's whole rows (the stage makes the student's), widened.
      RankAssignment whole = assignment;
      whole.vocab = VocabRange{0, vocab};
      const ShardInputs shard = generate_shard_inputs(c, inputs, whole, whole.vocab, s, false);
      teacher = DeviceBytes(bytes64(rows * vocab));
      head_oracle_widen(type, shard.teacher.as<void>(), teacher.as<double>(), nullptr, rows * vocab, s);
      LV_CUDA(cudaStreamSynchronize(s));  // the shard's buffers go out of scope
    }
  }

  static std::size_t bytes64(std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(double); }
  static std::size_t bytes32(std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); }

  // Rows `counters` of a stage input, columns [begin, end), in the dtype, then widened (and their magnitudes).
  void generate(const Case& c, InputStream input, const std::vector<std::int64_t>& counters, std::int64_t begin,
                std::int64_t end, double scale, DeviceBytes& out, DeviceBytes* magnitude) {
    const cudaStream_t s = stream.get();
    const auto count = static_cast<std::int64_t>(counters.size()) * (end - begin);
    DeviceBytes stored(static_cast<std::size_t>(count) * dtype_size(c.inputs.dtype));
    generate_normal_rows(c.inputs.seed, type, input, counters, begin, end, scale, stored.as<void>(), s);
    head_oracle_widen(type, stored.as<void>(), out.as<double>(),
                      magnitude != nullptr ? magnitude->as<float>() : nullptr, count, s);
    LV_CUDA(cudaStreamSynchronize(s));  // the temporaries go out of scope
  }

  int device;
  std::int64_t rows, vocab, hidden;
  StorageType type;
  Stream stream;
  CublasHandle cublas;
  DeviceBytes h, h_abs;    // rows x H: float64, and |h| as floats
  DeviceBytes w, w_abs;    // V x H
  DeviceBytes b;           // V, or none
  DeviceBytes teacher{0};  // rows x V (KD)
};

// Row-major C (m x n, ldc) = alpha A B + beta C with row-major A (m x k, lda) and B (k x n, ldb), each possibly
// transposed as stored: cuBLAS's column-major product of the transposes.
struct RowMajor {
  const void* data;
  std::int64_t ld;
  bool transposed;  // the operand is stored as its transpose (k x m for A)
};
void dgemm(cublasHandle_t handle, std::int64_t m, std::int64_t n, std::int64_t k, RowMajor a, RowMajor b, double beta,
           double* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const double one = 1.0;
  // C^T (n x m, column major) = op(B)^T op(A)^T
  check_cublas(cublas_library().dgemm(
                   handle, b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
                   static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &one,
                   static_cast<const double*>(b.data), static_cast<int>(b.ld), static_cast<const double*>(a.data),
                   static_cast<int>(a.ld), &beta, c, static_cast<int>(ldc)),
               "cublasDgemm");
}
// The same for float32 magnitudes on the tensor cores (TF32 operands, float32 accumulation): bounds only, rounded up
// afterwards by magnitude_inflation.
void magnitude_gemm(cublasHandle_t handle, std::int64_t m, std::int64_t n, std::int64_t k, RowMajor a, RowMajor b,
                    float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const float one = 1.0f;
  check_cublas(cublas_library().gemm_ex(
                   handle, b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
                   static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &one, b.data, CUDA_R_32F,
                   static_cast<int>(b.ld), a.data, CUDA_R_32F, static_cast<int>(a.ld), &beta, c, CUDA_R_32F,
                   static_cast<int>(ldc), CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (magnitudes)");
}

HeadOracleModel oracle_model(const Case& c) {
  const std::optional<DeviceRowModel> m = kind_of(c.loss).device_row_model(c);
  if (!m || m->row_coefficients) {
    throw InternalError("the head's GPU oracle cannot evaluate loss kind " + std::string(kind_of(c.loss).name()));
  }
  HeadOracleModel o;
  o.teacher = m->teacher ? 1 : 0;
  o.temperature = m->temperature;
  o.kd_scale = m->teacher_grad_scale;
  o.softcap = m->softcap;
  o.z_loss_weight = m->z_loss_weight;
  o.q_on = m->q_on;
  o.q_off = m->q_off;
  return o;
}

// The stage's reference as the checks read it beside this oracle: each of the rank's tokens' largest logit error
// (the loss's bound), from the device; the rest is evaluated on the device and never asked of it.
class DeviceHeadErrors final : public StageReference {
 public:
  explicit DeviceHeadErrors(const std::unordered_map<std::int64_t, double>& largest) : largest_(largest) {}
  void input_gradient(std::size_t, std::int64_t, VocabRange, std::span<const double>, std::span<const double>,
                      std::span<double>, std::span<double>) const override {
    throw InternalError("the head's GPU oracle evaluates dh on the device");
  }
  bool makes_logits() const override { return true; }
  void logits(std::int64_t, std::int64_t, std::int64_t, double*) const override {
    throw InternalError("the head's GPU oracle holds its logits on the device");
  }
  double largest_logit_error(std::int64_t token) const override {
    const auto it = largest_.find(token);
    if (it == largest_.end()) {
      throw InternalError("the head's GPU oracle has no logit error of token " + std::to_string(token));
    }
    return it->second;
  }

 private:
  const std::unordered_map<std::int64_t, double>& largest_;
};

class HeadGpuOracle final : public Oracle {
 public:
  HeadGpuOracle(const Case& c, const InputSource& inputs, std::unique_ptr<HeadDeviceInputs> d, const RankOutput& out,
                const GradJudgement& judgement)
      : case_(c),
        inputs_(inputs),
        d_(std::move(d)),
        out_(out),
        judgement_(judgement),
        options_(head_options(c.loss)),
        model_(oracle_model(c)),
        reference_(c, inputs, kind_of(c.loss).reference(c, inputs), std::make_unique<DeviceHeadErrors>(largest_)),
        own_(out.assignment.vocab),
        block_rows_(block_rows(d_->vocab)) {
    if (out_.stage_grads.size() != 1 || out_.stage_params.size() != 2) {
      throw InternalError("the head's GPU oracle needs the rank's dh, dW and db");
    }
  }

  const LossReference& reference() const override { return reference_; }

  void row_partials(std::vector<double>& partials, std::vector<char>& valid) override {
    LV_CUDA(cudaSetDevice(d_->device));
    const cudaStream_t s = d_->stream.get();
    std::vector<std::int64_t> labels;
    reference_rows(case_, inputs_, out_.assignment, labels, valid_);
    d_labels_ = upload(labels, s);
    d_valid_ = upload(valid_, s);
    compute_logits();
    DeviceBytes d_partials(static_cast<std::size_t>(d_->rows) * RowPartial::kDoubles * sizeof(double));
    head_oracle_partials(model_, logits(), d_->teacher.as<double>(), d_->vocab, d_->rows, own_.begin, own_.size(),
                         d_valid_.as<int>(), d_labels_.as<std::int64_t>(), d_partials.as<double>(), s);
    partials = download<double>(d_partials, static_cast<std::size_t>(d_->rows) * RowPartial::kDoubles, s);
    const std::vector<double> largest = download<double>(d_largest_, static_cast<std::size_t>(d_->rows), s);
    largest_.clear();
    for (std::size_t i = 0; i < largest.size(); ++i) {
      if (valid_[i]) largest_[out_.assignment.rows[i].token] = largest[i];
    }
    valid.assign(valid_.begin(), valid_.end());
  }

  std::vector<double> value_partials(std::span<const RowStats> stats) override {
    const cudaStream_t s = d_->stream.get();
    const std::size_t rows = stats.size();
    if (!model_.teacher) return std::vector<double>(2 * rows, 0.0);
    std::vector<double> lse(rows), teacher_lse(rows);
    for (std::size_t k = 0; k < rows; ++k) {
      lse[k] = stats[k].lse;
      teacher_lse[k] = stats[k].teacher_lse;
    }
    const DeviceBytes d_lse = upload(lse, s), d_teacher_lse = upload(teacher_lse, s);
    DeviceBytes d_out(2 * rows * sizeof(double));
    head_oracle_kl(model_, logits(), d_->teacher.as<double>(), d_->vocab, d_->rows, own_.begin, own_.size(),
                   d_valid_.as<int>(), d_lse.as<double>(), d_teacher_lse.as<double>(), d_out.as<double>(), s);
    return download<double>(d_out, 2 * rows, s);
  }

  void start_judging(std::span<const RowStats> stats) override {
    LV_CUDA(cudaSetDevice(d_->device));
    expected_gradients(stats);
    compare_all();
  }

  std::span<const RowJudgement> judged_rows() override {
    const cudaStream_t s = d_->stream.get();
    const std::vector<RowComparison> dh = download<RowComparison>(d_compared_dh_, out_.stage_rows.size(), s);
    rows_.assign(static_cast<std::size_t>(d_->rows), RowJudgement{});
    const int rank = out_.assignment.world_rank;
    for (std::size_t j = 0; j < dh.size(); ++j) {
      const auto i = static_cast<std::size_t>(out_.stage_rows[j]);
      rows_[i].stage = {packed(dh[j], out_.assignment.rows[i].token, dh[j].worst_column, rank)};
    }
    return rows_;
  }

  std::vector<PackedStats> stage_parameters() override {
    const cudaStream_t s = d_->stream.get();
    const int rank = out_.assignment.world_rank;
    const auto hidden = d_->hidden;
    std::vector<PackedStats> judged;
    {
      const std::vector<RowComparison> rows = download<RowComparison>(d_compared_dw_, own_rows(), s);
      ErrorStats all;
      for (std::size_t j = 0; j < rows.size(); ++j) {
        all.merge(ErrorStats::unpack(
            packed(rows[j], -1, static_cast<std::int64_t>(j) * hidden + rows[j].worst_column, rank)));
      }
      judged.push_back(all.pack());
    }
    if (options_.bias) {
      const std::vector<RowComparison> row = download<RowComparison>(d_compared_db_, 1, s);
      judged.push_back(packed(row[0], -1, row[0].worst_column, rank));
    } else {
      judged.push_back(ErrorStats{}.pack());
    }
    return judged;
  }

 private:
  const double* logits() const { return d_logits_.as<double>(); }
  std::size_t own_rows() const { return static_cast<std::size_t>(own_.size()); }

  // u = h W^T + b over the rank's whole rows, and each row's largest logit error from the magnitudes' product, block
  // by block of rows.
  void compute_logits() {
    const cudaStream_t s = d_->stream.get();
    const std::int64_t rows = d_->rows, vocab = d_->vocab, hidden = d_->hidden;
    d_logits_ = DeviceBytes(HeadDeviceInputs::bytes64(rows * vocab));
    d_largest_ = DeviceBytes(HeadDeviceInputs::bytes64(rows));
    // u (rows x V) = h (rows x H) W^T (W stored V x H)
    dgemm(d_->cublas.get(), rows, vocab, hidden, {d_->h.as<double>(), hidden, false},
          {d_->w.as<double>(), hidden, true}, 0.0, d_logits_.as<double>(), vocab);
    if (options_.bias) head_oracle_add_bias(d_logits_.as<double>(), vocab, d_->b.as<double>(), rows, vocab, s);
    const double accumulate = head_gamma32(static_cast<double>(hidden + (options_.bias ? 1 : 0)));
    const double stored = unit_roundoff(case_.inputs.dtype);
    DeviceBytes magnitude(HeadDeviceInputs::bytes32(std::min(rows, block_rows_) * vocab));
    for (std::int64_t first = 0; first < rows; first += block_rows_) {
      const std::int64_t n = std::min(block_rows_, rows - first);
      magnitude_gemm(d_->cublas.get(), n, vocab, hidden, {d_->h_abs.as<float>() + first * hidden, hidden, false},
                     {d_->w_abs.as<float>(), hidden, true}, 0.0f, magnitude.as<float>(), vocab);
      head_oracle_largest_error(d_logits_.as<double>() + first * vocab, vocab, magnitude.as<float>(),
                                options_.bias ? d_->b.as<double>() : nullptr, n, vocab,
                                magnitude_inflation(static_cast<double>(hidden)), accumulate, stored,
                                d_largest_.as<double>() + first, s);
    }
  }

  // The expected dh (the rank's rows), dW_r and db_r and their bounds, block by block of rows: the kind's g and the
  // error model's factors, then the products.
  void expected_gradients(std::span<const RowStats> stats) {
    const cudaStream_t s = d_->stream.get();
    const std::int64_t rows = d_->rows, vocab = d_->vocab, hidden = d_->hidden, own = own_.size();
    std::vector<double> lse(stats.size()), teacher_lse(stats.size()), weight(stats.size());
    weight_total_ = 0.0;
    for (std::size_t k = 0; k < stats.size(); ++k) {
      lse[k] = stats[k].lse;
      teacher_lse[k] = stats[k].teacher_lse;
      if (!valid_[k]) continue;
      weight[k] = reference_.token_weight(out_.assignment.rows[k].token);
      weight_total_ += std::fabs(weight[k]);
    }
    const DeviceBytes d_lse = upload(lse, s), d_teacher_lse = upload(teacher_lse, s), d_weight = upload(weight, s);
    // The dh contract's columns: the whole row where the head sums dh over TP, the rank's own where the framework does.
    const bool whole = options_.dh_reduce == HeadOptions::DhReduce::head;
    const VocabRange summed = whole ? VocabRange{0, vocab} : own_;
    const double gamma_dh = head_gamma32(static_cast<double>(summed.size() + case_.layout.tp));
    const double gamma_dw = head_gamma32(static_cast<double>(case_.shape.tokens));
    const std::int64_t block = std::min(rows, block_rows_);
    DeviceBytes g(HeadDeviceInputs::bytes64(block * vocab));
    DeviceBytes a_dh(HeadDeviceInputs::bytes32(block * vocab)), a_dw(HeadDeviceInputs::bytes32(block * vocab));
    DeviceBytes dh_part(HeadDeviceInputs::bytes32(rows * hidden)), dw_part(HeadDeviceInputs::bytes32(own * hidden));
    d_dh_ = DeviceBytes(HeadDeviceInputs::bytes64(rows * hidden));
    d_dw_ = DeviceBytes(HeadDeviceInputs::bytes64(own * hidden));
    d_db_ = DeviceBytes(HeadDeviceInputs::bytes64(own));
    DeviceBytes db_part(HeadDeviceInputs::bytes64(own));
    LV_CUDA(cudaMemsetAsync(d_db_.as<void>(), 0, d_db_.size(), s));
    LV_CUDA(cudaMemsetAsync(db_part.as<void>(), 0, db_part.size(), s));
    const double* w = d_->w.as<double>();
    const float* w_abs = d_->w_abs.as<float>();
    std::int64_t blocks = 0;
    for (std::int64_t first = 0; first < rows; first += block, ++blocks) {
      const std::int64_t n = std::min(block, rows - first);
      HeadOracleGradientArgs a{};
      a.model = model_;
      a.u = logits() + first * vocab;
      a.teacher = model_.teacher ? d_->teacher.as<double>() + first * vocab : nullptr;
      a.rows = n;
      a.cols = vocab;
      a.valid = d_valid_.as<int>() + first;
      a.label = d_labels_.as<std::int64_t>() + first;
      a.lse = d_lse.as<double>() + first;
      a.teacher_lse = d_teacher_lse.as<double>() + first;
      a.weight = d_weight.as<double>() + first;
      a.delta = d_largest_.as<double>() + first;
      a.atol = judgement_.tolerance.atol;
      a.rtol = judgement_.tolerance.rtol;
      a.quantum = judgement_.quantum;
      a.framework_scale = judgement_.framework_scale;
      a.grad_scale = judgement_.grad_scale;
      a.unit = unit_roundoff(case_.inputs.dtype);
      a.gamma_dh = gamma_dh;
      a.gamma_dw = gamma_dw;
      a.g = g.as<double>();
      a.a_dh = a_dh.as<float>();
      a.a_dw = a_dw.as<float>();
      head_oracle_gradient(a, s);
      const double beta = first == 0 ? 0.0 : 1.0;
      const cublasHandle_t handle = d_->cublas.get();
      // dh (n x H) = g[:, summed] W[summed, :], and its bound from a_dh and |W|
      dgemm(handle, n, hidden, summed.size(), {g.as<double>() + summed.begin, vocab, false},
            {w + summed.begin * hidden, hidden, false}, 0.0, d_dh_.as<double>() + first * hidden, hidden);
      magnitude_gemm(handle, n, hidden, summed.size(), {a_dh.as<float>() + summed.begin, vocab, false},
                     {w_abs + summed.begin * hidden, hidden, false}, 0.0f, dh_part.as<float>() + first * hidden,
                     hidden);
      // dW_r (own x H) += g[:, own]^T h, and its bound from a_dw and |h|; db_r += sum_t g_t
      dgemm(handle, own, hidden, n, {g.as<double>() + own_.begin, vocab, true},
            {d_->h.as<double>() + first * hidden, hidden, false}, beta, d_dw_.as<double>(), hidden);
      magnitude_gemm(handle, own, hidden, n, {a_dw.as<float>() + own_.begin, vocab, true},
                     {d_->h_abs.as<float>() + first * hidden, hidden, false}, static_cast<float>(beta),
                     dw_part.as<float>(), hidden);
      if (options_.bias) {
        head_oracle_column_sums(g.as<double>() + own_.begin, vocab, n, own, d_db_.as<double>(), s);
        head_oracle_column_sums(a_dw.as<float>() + own_.begin, vocab, n, own, db_part.as<double>(), s);
      }
    }
    const double unit = unit_roundoff(case_.inputs.dtype);
    d_dh_bound_ = DeviceBytes(d_dh_.size());
    d_dw_bound_ = DeviceBytes(d_dw_.size());
    d_db_bound_ = DeviceBytes(d_db_.size());
    head_oracle_finish_bound(dh_part.as<float>(), d_dh_.as<double>(),
                             magnitude_inflation(static_cast<double>(summed.size())), unit, d_dh_bound_.as<double>(),
                             rows * hidden, s);
    head_oracle_finish_bound(dw_part.as<float>(), d_dw_.as<double>(),
                             magnitude_inflation(static_cast<double>(rows + blocks)), unit, d_dw_bound_.as<double>(),
                             own * hidden, s);
    // db's bound: a float64 sum of `rows` non-negative terms, at most (rows + 1) 2^-52 below the exact one.
    head_oracle_finish_bound(db_part.as<double>(), d_db_.as<double>(), 1.0 + static_cast<double>(rows + 1) * 0x1p-52,
                             unit, d_db_bound_.as<double>(), own, s);
    LV_CUDA(cudaStreamSynchronize(s));  // the blocks' buffers go out of scope
  }

  // The comparison kernel's inputs for `rows` rows of expected values with their bounds, each row's token scale
  // |weight| grad_scale (reference_kernels.hpp: no row model is read where `expected` is given).
  struct Compared {
    DeviceBytes kind{0}, label{0}, lse{0}, weight{0}, got{0};
  };
  void compare(const std::vector<double>& row_weight, const std::vector<std::byte>& got, std::int64_t cols,
               const double* expected, const double* bound, Compared& keep, DeviceBytes& result) {
    const cudaStream_t s = d_->stream.get();
    const std::size_t rows = row_weight.size();
    keep.kind = upload(std::vector<int>(rows, 0), s);
    keep.label = upload(std::vector<std::int64_t>(rows, -1), s);
    keep.lse = upload(std::vector<double>(rows, 0.0), s);
    keep.weight = upload(row_weight, s);
    keep.got = upload(got, s);
    result = DeviceBytes(rows * sizeof(RowComparison));
    ReferenceCompareArgs a{};
    a.student = keep.got.as<void>();  // not read: the expected values are given
    a.grad = keep.got.as<void>();
    a.rows = static_cast<std::int64_t>(rows);
    a.cols = cols;
    a.kind = keep.kind.as<int>();
    a.label = keep.label.as<std::int64_t>();
    a.lse = keep.lse.as<double>();
    a.weight = keep.weight.as<double>();
    a.temperature = a.inverse_temperature = a.kd_grad_scale = 1.0;
    a.expected = expected;
    a.slack = bound;
    a.atol = judgement_.tolerance.atol;
    a.rtol = judgement_.tolerance.rtol;
    a.max_ulp = judgement_.tolerance.max_ulp;
    a.dtype = static_cast<int>(d_->type);
    a.framework_scale = judgement_.framework_scale;
    a.quantum = judgement_.quantum;
    a.grad_scale = judgement_.grad_scale;
    a.smallest_normal = judgement_.smallest_normal;
    reference_compare(d_->type, a, result.as<RowComparison>(), s);
    LV_CUDA(cudaGetLastError());
  }

  // dh of the rows the rank reports (Stage::gradient_rows, in its order), dW_r and db_r, queued.
  void compare_all() {
    const cudaStream_t s = d_->stream.get();
    const std::int64_t hidden = d_->hidden;
    const std::size_t reported = out_.stage_rows.size();
    const DeviceBytes d_reported = upload(out_.stage_rows, s);
    d_dh_reported_ = DeviceBytes(HeadDeviceInputs::bytes64(static_cast<std::int64_t>(reported) * hidden));
    d_dh_reported_bound_ = DeviceBytes(d_dh_reported_.size());
    head_oracle_gather_rows(d_dh_.as<double>(), d_reported.as<std::int64_t>(), static_cast<std::int64_t>(reported),
                            hidden, d_dh_reported_.as<double>(), s);
    head_oracle_gather_rows(d_dh_bound_.as<double>(), d_reported.as<std::int64_t>(),
                            static_cast<std::int64_t>(reported), hidden, d_dh_reported_bound_.as<double>(), s);
    // A row that is no valid token is judged at weight 1 (zero expected, zero bound), as the host oracle judges it.
    std::vector<double> row_weight(reported, 1.0);
    for (std::size_t j = 0; j < reported; ++j) {
      const auto i = static_cast<std::size_t>(out_.stage_rows[j]);
      if (valid_[i]) row_weight[j] = reference_.token_weight(out_.assignment.rows[i].token);
    }
    compare(row_weight, out_.stage_grads[0], hidden, d_dh_reported_.as<double>(), d_dh_reported_bound_.as<double>(),
            dh_inputs_, d_compared_dh_);
    compare(std::vector<double>(own_rows(), weight_total_), out_.stage_params[0], hidden, d_dw_.as<double>(),
            d_dw_bound_.as<double>(), dw_inputs_, d_compared_dw_);
    if (options_.bias) {
      compare({weight_total_}, out_.stage_params[1], own_.size(), d_db_.as<double>(), d_db_bound_.as<double>(),
              db_inputs_, d_compared_db_);
    }
    LV_CUDA(cudaStreamSynchronize(s));  // d_reported goes out of scope
  }

  static PackedStats packed(const RowComparison& rc, std::int64_t token, std::int64_t column, int rank) {
    return PackedStats{
        rc.compared, rc.mismatches,
        rc.max_ulp,  rc.compared > 0,
        rc.max_abs,  rc.max_rel,
        rc.margin,   PackedElement{token, column, rank, -1, -1, rc.worst_expected, rc.worst_got, rc.worst_tolerance}};
  }

  const Case& case_;
  const InputSource& inputs_;
  std::unique_ptr<HeadDeviceInputs> d_;
  const RankOutput& out_;
  const GradJudgement judgement_;
  const HeadOptions& options_;
  const HeadOracleModel model_;
  std::unordered_map<std::int64_t, double> largest_;  // before reference_, which reads it
  const LossReference reference_;
  const VocabRange own_;
  const std::int64_t block_rows_;
  std::vector<int> valid_;
  double weight_total_ = 0.0;  // sum of the rank's |w_t|: dW's and db's token scale
  DeviceBytes d_labels_{0}, d_valid_{0}, d_logits_{0}, d_largest_{0};
  DeviceBytes d_dh_{0}, d_dw_{0}, d_db_{0}, d_dh_bound_{0}, d_dw_bound_{0}, d_db_bound_{0};
  DeviceBytes d_dh_reported_{0}, d_dh_reported_bound_{0};
  Compared dh_inputs_, dw_inputs_, db_inputs_;
  DeviceBytes d_compared_dh_{0}, d_compared_dw_{0}, d_compared_db_{0};
  std::vector<RowJudgement> rows_;
};

class HeadKindOracle final : public CudaKindOracle {
 public:
  HeadKindOracle(const Case& c, const InputSource& inputs, const RankAssignment& assignment, int device)
      : case_(c), inputs_(inputs) {
    LV_CUDA(cudaSetDevice(device));
    d_ = std::make_unique<HeadDeviceInputs>(c, inputs, assignment, device);
  }
  std::unique_ptr<Oracle> judge(const RankOutput& out, const GradJudgement& judgement) override {
    return std::make_unique<HeadGpuOracle>(case_, inputs_, std::move(d_), out, judgement);
  }

 private:
  const Case& case_;
  const InputSource& inputs_;
  std::unique_ptr<HeadDeviceInputs> d_;
};

std::unique_ptr<CudaKindOracle> make_lm_head_oracle(const Case& c, const InputSource& inputs,
                                                    const RankAssignment& assignment, int device) {
  return std::make_unique<HeadKindOracle>(c, inputs, assignment, device);
}

}  // namespace

// The kinds whose rows the oracle's kernels evaluate behind the head: a device row model without per-row
// coefficients (cross-entropy and KD).
CudaOracleFactory lm_head_oracle_factory(const Case& c) {
  const std::optional<DeviceRowModel> m = kind_of(c.loss).device_row_model(c);
  if (!m || m->row_coefficients) return nullptr;
  return &make_lm_head_oracle;
}

}  // namespace lossverify::cuda
