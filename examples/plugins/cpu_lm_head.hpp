// The example CPU plugin's LM head (include/lossverify/plugin.h, LV_SUPPORTS_LM_HEAD; docs/spec.md, the head), in front
// of its cross-entropy and KD (cpu_cross_entropy.cpp): u = h W_r^T (+ b_r) over the rank's columns, accumulated in
// float32 and stored in the dtype; the kind runs on u as on logits and writes its gradient g of u to outputs->grad;
// then dh = g W_r (summed over TP under the head's contract, the rows of head_dh_row_index kept: a reduce-scatter
// under sequence parallelism), dW_r = sum_t g_t^T h_t and db_r = sum_t g_t, accumulated in float32.
#pragma once

#include <lossverify/plugin.h>

#include "cpu_elements.hpp"
#include "plugin_common.hpp"

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace lossverify_example::cpu {

// Catalogued head bugs the example carries behind ?bug= (docs/catalogue.md).
struct HeadBugs {
  bool dh_shard_partial = false;  // head-dh-shard-partial (Apple ml-cross-entropy #42): dh never summed over TP
};

inline bool has_head(const lv_rank_inputs& in) { return in.head_hidden > 0; }

// u = h W_r^T (+ b_r) for every row that is a token (CP padding stays 0: the kind masks it).
template <class T>
std::vector<T> head_logits(const lv_rank_inputs& in) {
  const std::int64_t h = in.head_hidden, width = in.vocab_end - in.vocab_begin;
  const Matrix<T> hidden{static_cast<const T*>(in.hidden_states), h};
  const Matrix<T> weight{static_cast<const T*>(in.head_weight), h};
  const T* bias = static_cast<const T*>(in.head_bias_values);
  std::vector<T> logits(static_cast<std::size_t>(in.rows * width), narrow<T>(0.0f));
  for (std::int64_t i = 0; i < in.rows; ++i) {
    if (in.tokens[i] < 0) continue;
    const T* x = hidden.row(i);
    for (std::int64_t v = 0; v < width; ++v) {
      const T* w = weight.row(v);
      float u = 0.0f;
      for (std::int64_t k = 0; k < h; ++k) u += widen(x[k]) * widen(w[k]);
      logits[static_cast<std::size_t>(i * width + v)] = narrow<T>(u + widen(bias[v]));
    }
  }
  return logits;
}

// dh of every row (float32, rows x H) from the kind's gradient in outputs->grad, summed over TP where the head's
// contract says so; the rows the rank returns written to outputs->head_dh.
template <class T>
void head_dh(const lv_rank_inputs& in, lv_rank_outputs& out, const HeadBugs& bugs, const Collectives& comm) {
  const std::int64_t h = in.head_hidden, width = in.vocab_end - in.vocab_begin;
  const Matrix<T> weight{static_cast<const T*>(in.head_weight), h};
  const Matrix<T> grad{static_cast<const T*>(out.grad), width};
  std::vector<float> dh(static_cast<std::size_t>(in.rows * h), 0.0f);
  for (std::int64_t i = 0; i < in.rows; ++i) {
    for (std::int64_t v = 0; v < width; ++v) {
      const float g = widen(grad.row(i)[v]);
      if (g == 0.0f) continue;
      for (std::int64_t k = 0; k < h; ++k) dh[static_cast<std::size_t>(i * h + k)] += g * widen(weight.row(v)[k]);
    }
  }
  if (in.head_dh_reduce == LV_HEAD_DH_HEAD && !bugs.dh_shard_partial) allreduce(comm, LV_GROUP_TP, dh, LV_REDUCE_SUM);
  T* written = static_cast<T*>(out.head_dh);
  for (std::int64_t j = 0; j < in.head_dh_rows; ++j) {
    const std::int64_t row = in.head_dh_row_index[j];
    if (row < 0 || row >= in.rows) throw std::invalid_argument("head_dh_row_index names a row outside the rank's");
    for (std::int64_t k = 0; k < h; ++k) written[j * h + k] = narrow<T>(dh[static_cast<std::size_t>(row * h + k)]);
  }
  out.head_dh_count = in.head_dh_rows * h;
}

// dW_r and db_r over the rank's rows of every micro-batch.
template <class T>
void head_parameter_grads(const lv_rank_inputs& in, lv_rank_outputs& out) {
  const std::int64_t h = in.head_hidden, width = in.vocab_end - in.vocab_begin;
  const Matrix<T> hidden{static_cast<const T*>(in.hidden_states), h};
  const Matrix<T> grad{static_cast<const T*>(out.grad), width};
  std::vector<float> dw(static_cast<std::size_t>(width * h), 0.0f), db(static_cast<std::size_t>(width), 0.0f);
  for (std::int64_t i = 0; i < in.rows; ++i) {
    for (std::int64_t v = 0; v < width; ++v) {
      const float g = widen(grad.row(i)[v]);
      if (g == 0.0f) continue;
      db[static_cast<std::size_t>(v)] += g;
      for (std::int64_t k = 0; k < h; ++k) dw[static_cast<std::size_t>(v * h + k)] += g * widen(hidden.row(i)[k]);
    }
  }
  T* dw_out = static_cast<T*>(out.head_dw);
  for (std::size_t j = 0; j < dw.size(); ++j) dw_out[j] = narrow<T>(dw[j]);
  out.head_dw_count = width * h;
  out.head_db_count = 0;
  if (in.head_bias == 0) return;
  T* db_out = static_cast<T*>(out.head_db);
  for (std::size_t j = 0; j < db.size(); ++j) db_out[j] = narrow<T>(db[j]);
  out.head_db_count = width;
}

// The head around the kind: `run_kind(inputs)` computes the kind on the given inputs, its gradient into out.grad.
template <class T, class RunKind>
void run_with_head(const lv_rank_inputs& in, lv_rank_outputs& out, const HeadBugs& bugs, const Collectives& comm,
                   RunKind run_kind) {
  if (in.hidden_states == nullptr || in.head_weight == nullptr || in.head_bias_values == nullptr) {
    throw std::invalid_argument("a head without its hidden states, weight or bias");
  }
  const std::vector<T> logits = head_logits<T>(in);
  lv_rank_inputs kind_inputs = in;
  kind_inputs.logits = logits.data();
  run_kind(kind_inputs);
  head_dh<T>(in, out, bugs, comm);
  head_parameter_grads<T>(in, out);
}

}  // namespace lossverify_example::cpu
