// The LM head's inputs as an implementation receives them, from the case's Philox streams (each value already in the
// input dtype): the CPU head's h rows, W_r and b_r, and a native plugin's copies of them in the dtype with the head's
// fields of lv_rank_inputs (include/lossverify/plugin.h). The float64 reference generates its own
// (lm_head_reference.cpp).
#include <algorithm>
#include <cstring>

#include "lossverify/case/case.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"
#include "lossverify/outputs/rank_output.hpp"
#include "lossverify/plugin.h"

namespace lossverify {

void head_hidden_row(const Case& c, const InputSource& inputs, std::int64_t token, double* out) {
  const HeadOptions& o = head_options(c.loss);
  inputs.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(token), 0, o.hidden, o.hidden_scale, out);
}

void head_weight_rows(const Case& c, const InputSource& inputs, VocabRange rows, double* out) {
  const std::int64_t h = head_options(c.loss).hidden;
  const double scale = head_weight_scale(c);
  for (std::int64_t v = rows.begin; v < rows.end; ++v) {
    inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(v), 0, h, scale,
                        out + (v - rows.begin) * h);
  }
}

void head_bias_values(const Case& c, const InputSource& inputs, VocabRange columns, double* out) {
  if (!head_options(c.loss).bias) {
    std::fill_n(out, columns.size(), 0.0);
    return;
  }
  inputs.stage_values(InputStream::head_bias, 0, columns.begin, columns.end, head_bias_scale(c), out);
}

namespace {

std::vector<std::byte> in_dtype(DType dtype, const std::vector<double>& values) {
  return dispatch_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    std::vector<std::byte> bytes(values.size() * sizeof(T));
    T* out = reinterpret_cast<T*>(bytes.data());
    for (std::size_t k = 0; k < values.size(); ++k) out[k] = T(static_cast<float>(values[k]));
    return bytes;
  });
}

}  // namespace

// h of every local row (zero on CP padding: as gathered under sequence parallelism), W_r and b_r.
std::vector<std::vector<std::byte>> head_plugin_inputs(const Case& c, const InputSource& inputs,
                                                       const RankAssignment& assignment) {
  const auto h = static_cast<std::size_t>(head_options(c.loss).hidden);
  const VocabRange columns = assignment.vocab;
  std::vector<double> hidden(assignment.rows.size() * h, 0.0);
  for (std::size_t i = 0; i < assignment.rows.size(); ++i) {
    if (assignment.rows[i].token >= 0) head_hidden_row(c, inputs, assignment.rows[i].token, &hidden[i * h]);
  }
  std::vector<double> weight(static_cast<std::size_t>(columns.size()) * h);
  head_weight_rows(c, inputs, columns, weight.data());
  std::vector<double> bias(static_cast<std::size_t>(columns.size()));
  head_bias_values(c, inputs, columns, bias.data());
  const DType dtype = c.inputs.dtype;
  return {in_dtype(dtype, hidden), in_dtype(dtype, weight), in_dtype(dtype, bias)};
}

void head_plugin_settings(const Case& c, lv_rank_inputs& settings) {
  const HeadOptions& o = head_options(c.loss);
  settings.head_hidden = o.hidden;
  settings.head_bias = o.bias ? 1 : 0;
  settings.head_dh_reduce = o.dh_reduce == HeadOptions::DhReduce::framework ? LV_HEAD_DH_FRAMEWORK : LV_HEAD_DH_HEAD;
}

}  // namespace lossverify
