// The LM head on the CPU backend, as a fused head computes it: in float32, over the rank's vocabulary shard W_r (its
// columns of W), chunk by chunk of the rank's tokens. Forward: u = h W_r^T (+ b), accumulated in float32 and stored in
// the dtype for the kind. Backward, from the kind's gradient g of u (in the dtype): dh = g W_r, summed over TP where
// the head's contract says so, dW_r = sum over chunks of g_chunk^T h_chunk and db_r = sum_t g_t, accumulated in float32
// and stored in the dtype. The catalogued bugs are switches of head_bug.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

namespace {

// A stage input's rows [first, first + count) of `width` values, as float32 (they are dtype values, exact in it).
std::vector<float> generate(const InputSource& inputs, InputStream stream, std::int64_t first, std::int64_t count,
                            std::int64_t width, double scale) {
  std::vector<double> row(static_cast<std::size_t>(width));
  std::vector<float> out(static_cast<std::size_t>(count * width));
  for (std::int64_t r = 0; r < count; ++r) {
    inputs.stage_values(stream, static_cast<std::uint64_t>(first + r), 0, width, scale, row.data());
    std::copy(row.begin(), row.end(), out.begin() + static_cast<std::ptrdiff_t>(r * width));
  }
  return out;
}

// The rank's W_r (columns x H) and b_r (columns; zeros without a bias).
struct Shard {
  std::vector<float> weight, bias;
};
Shard shard_of(const StageRank& r, VocabRange columns) {
  const HeadOptions& o = head_options(r.c.loss);
  Shard s;
  s.weight =
      generate(r.inputs, InputStream::head_weight, columns.begin, columns.size(), o.hidden, head_weight_scale(r.c));
  s.bias.assign(static_cast<std::size_t>(columns.size()), 0.0f);
  if (o.bias) {
    std::vector<double> b(static_cast<std::size_t>(columns.size()));
    r.inputs.stage_values(InputStream::head_bias, 0, columns.begin, columns.end, head_bias_scale(r.c), b.data());
    std::copy(b.begin(), b.end(), s.bias.begin());
  }
  return s;
}

std::vector<float> hidden_of(const StageRank& r, std::int64_t token) {
  const HeadOptions& o = head_options(r.c.loss);
  return generate(r.inputs, InputStream::head_hidden, token, 1, o.hidden, o.hidden_scale);
}

template <class T>
void forward(const StageRank& r) {
  const HeadOptions& o = head_options(r.c.loss);
  const auto h = static_cast<std::size_t>(o.hidden);
  const auto cols = static_cast<std::size_t>(r.columns.size());
  const Shard s = shard_of(r, r.columns);
  const bool repeated = (r.bugs.stage_switches & head_bug::bias_repeated) != 0;
  T* logits = reinterpret_cast<T*>(r.logits);
  for (std::size_t i = 0; i < r.assignment.rows.size(); ++i) {
    const std::int64_t t = r.assignment.rows[i].token;
    if (t < 0) continue;  // CP padding keeps its generated (masked) logits
    const std::vector<float> x = hidden_of(r, t);
    const std::int64_t label = r.inputs.label(t);
    for (std::size_t v = 0; v < cols; ++v) {
      const float* w = &s.weight[v * h];
      float u = 0.0f;
      for (std::size_t k = 0; k < h; ++k) u += x[k] * w[k];
      u += s.bias[v];
      // head-bias-repeated: the bias added again to the target logit
      if (repeated && r.columns.begin + static_cast<std::int64_t>(v) == label) u += s.bias[v];
      logits[i * cols + v] = T(u);
    }
  }
}

// Each row's share of dW and db: g_t as the kind wrote it, or (head-grad-output-first) rescaled to the first token's
// upstream weight.
std::vector<float> row_scales(const StageRank& r) {
  std::vector<float> scale(r.assignment.rows.size(), 1.0f);
  if ((r.bugs.stage_switches & head_bug::grad_output_first) == 0) return scale;
  double first = 0.0;
  for (std::size_t i = 0; i < scale.size(); ++i) {
    const std::int64_t t = r.assignment.rows[i].token;
    if (t < 0 || !r.inputs.is_valid(t)) continue;
    if (first == 0.0) first = r.inputs.upstream_weight(t);
    scale[i] = static_cast<float>(first / r.inputs.upstream_weight(t));
  }
  return scale;
}

// The kind's gradient of the rank's rows (rows x the rank's columns) in float32, as the head reads it. Under
// head-target-rounded-early, the true class's entry is formed as a fused head forms it: its share w p_y (g_y + w, w the
// row's weight) rounded into the 16-bit buffer before w is subtracted, so that it carries half a 16-bit unit of w p_y
// where the correct head carries one rounding of g_y = w (p_y - 1).
template <class T>
std::vector<float> kind_gradient(const StageRank& r, const T* g) {
  const VocabRange vocab = r.assignment.vocab;
  const auto cols = static_cast<std::size_t>(vocab.size());
  const std::size_t rows = r.assignment.rows.size();
  std::vector<float> out(rows * cols);
  for (std::size_t j = 0; j < out.size(); ++j) out[j] = static_cast<float>(g[j]);
  if ((r.bugs.stage_switches & head_bug::target_rounded_early) == 0 || r.row_weights.size() != rows) return out;
  // A fused linear cross-entropy's step: the kinds whose gradient is not w (p - onehot) have no such target term.
  if (kind_of(r.c.loss).name() != "cross_entropy") return out;
  for (std::size_t i = 0; i < rows; ++i) {
    const std::int64_t t = r.assignment.rows[i].token;
    if (t < 0 || !r.inputs.is_valid(t)) continue;
    const std::int64_t label = r.inputs.label(t);
    if (label < vocab.begin || label >= vocab.end) continue;
    const float w = r.row_weights[i];
    float& target = out[i * cols + static_cast<std::size_t>(label - vocab.begin)];
    target = static_cast<float>(T(target + w)) - w;
  }
  return out;
}

template <class T>
void backward(const StageRank& r) {
  const HeadOptions& o = head_options(r.c.loss);
  const std::uint64_t bugs = r.bugs.stage_switches;
  const VocabRange vocab = r.assignment.vocab;  // the rank's shard of W (and of the kind's gradient)
  const auto h = static_cast<std::size_t>(o.hidden);
  const auto cols = static_cast<std::size_t>(vocab.size());
  const std::size_t rows = r.assignment.rows.size();
  const Shard s = shard_of(r, vocab);
  const std::vector<float> g = kind_gradient(r, reinterpret_cast<const T*>(r.logit_grad));
  // dh = g W_r, then the contract's sum over TP
  std::vector<float> dh(rows * h, 0.0f);
  for (std::size_t i = 0; i < rows; ++i) {
    for (std::size_t v = 0; v < cols; ++v) {
      const float gv = g[i * cols + v];
      if (gv == 0.0f) continue;
      for (std::size_t k = 0; k < h; ++k) dh[i * h + k] += gv * s.weight[v * h + k];
    }
  }
  const bool head_sums = o.dh_reduce == HeadOptions::DhReduce::head;
  int sums = head_sums ? 1 : 0;
  if ((bugs & head_bug::dh_shard_partial) != 0 && head_sums) sums = 0;  // never summed over TP
  if ((bugs & head_bug::dh_double_reduce) != 0) ++sums;                 // summed once more than the contract says
  for (int k = 0; k < sums; ++k) r.groups.tp.allreduce_sum(std::span<float>(dh));
  T* dh_out = reinterpret_cast<T*>(r.gradients.front().data());
  for (std::size_t j = 0; j < dh.size(); ++j) dh_out[j] = T(dh[j]);
  // dW_r and db_r, chunk by chunk of rows, each chunk's partial sums added to float32 accumulators
  const std::vector<float> scale = row_scales(r);
  const bool narrow = (bugs & head_bug::dw_16bit_accumulate) != 0;
  std::vector<float> dw(cols * h, 0.0f), db(cols, 0.0f);
  const std::size_t chunks = std::max<std::size_t>(1, std::min<std::size_t>(static_cast<std::size_t>(o.chunks), rows));
  for (std::size_t c = 0; c < chunks; ++c) {
    const std::size_t first = rows * c / chunks, last = rows * (c + 1) / chunks;
    std::vector<float> part_w(cols * h, 0.0f), part_b(cols, 0.0f);
    for (std::size_t i = first; i < last; ++i) {
      const std::int64_t t = r.assignment.rows[i].token;
      if (t < 0) continue;
      const std::vector<float> x = hidden_of(r, t);
      for (std::size_t v = 0; v < cols; ++v) {
        const float gv = g[i * cols + v] * scale[i];
        if (gv == 0.0f) continue;
        part_b[v] += gv;
        for (std::size_t k = 0; k < h; ++k) part_w[v * h + k] += gv * x[k];
      }
    }
    for (std::size_t j = 0; j < dw.size(); ++j) {
      dw[j] += part_w[j];
      if (narrow) dw[j] = static_cast<float>(T(dw[j]));  // head-dw-16bit-accumulate: the accumulator in the dtype
    }
    for (std::size_t j = 0; j < db.size(); ++j) {
      db[j] += part_b[j];
      if (narrow) db[j] = static_cast<float>(T(db[j]));
    }
  }
  T* dw_out = reinterpret_cast<T*>(r.parameters[0].data());
  for (std::size_t j = 0; j < dw.size(); ++j) dw_out[j] = T(dw[j]);
  if (o.bias) {
    T* db_out = reinterpret_cast<T*>(r.parameters[1].data());
    for (std::size_t j = 0; j < db.size(); ++j) db_out[j] = T(db[j]);
  }
}

}  // namespace

void lm_head_cpu_forward(const StageRank& rank) {
  dispatch_dtype(rank.dtype, [&](auto type) { forward<typename decltype(type)::type>(rank); });
}

void lm_head_cpu_backward(const StageRank& rank) {
  dispatch_dtype(rank.dtype, [&](auto type) { backward<typename decltype(type)::type>(rank); });
}

}  // namespace lossverify
