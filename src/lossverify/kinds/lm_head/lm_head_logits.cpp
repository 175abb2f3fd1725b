// The LM head's logits in float64, row by row, from the case's streams alone (Stage::float64_logits): u = h W^T (+ b)
// summed in float64 in the order of lm_head_reference.cpp, and each column's bound from the same error model
// (head_logit_error). It holds W and b (V x H, V); each row generates the token's h and costs V x H multiply-adds, so
// that a kind placing its inputs against the head's logits (the policy kind's old log-probabilities) pays N x V x H
// per step, as the reference does once.
#include <algorithm>
#include <cmath>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"

namespace lossverify {

namespace {

class HeadLogits final : public StageLogits {
 public:
  HeadLogits(const Case& c, const InputSource& inputs)
      : inputs_(inputs),
        options_(head_options(c.loss)),
        vocab_(c.shape.vocab),
        weight_(static_cast<std::size_t>(vocab_ * options_.hidden)),
        bias_(static_cast<std::size_t>(vocab_), 0.0),
        accumulate_(head_gamma32(static_cast<double>(options_.hidden + (options_.bias ? 1 : 0)))),
        stored_(unit_roundoff(c.inputs.dtype)) {
    const std::int64_t h = options_.hidden;
    for (std::int64_t v = 0; v < vocab_; ++v) {
      inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(v), 0, h, head_weight_scale(c),
                          &weight_[static_cast<std::size_t>(v * h)]);
    }
    if (options_.bias) inputs.stage_values(InputStream::head_bias, 0, 0, vocab_, head_bias_scale(c), bias_.data());
  }

  void row(std::int64_t token, std::span<double> out, std::span<double> error) const override {
    const auto h = static_cast<std::size_t>(options_.hidden);
    std::vector<double> x(h);
    inputs_.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(token), 0, options_.hidden,
                         options_.hidden_scale, x.data());
    for (std::size_t v = 0; v < static_cast<std::size_t>(vocab_); ++v) {
      const double* w = &weight_[v * h];
      double u = 0.0, magnitude = 0.0;
      for (std::size_t k = 0; k < h; ++k) {
        u += x[k] * w[k];
        magnitude += std::fabs(x[k] * w[k]);
      }
      u += bias_[v];
      magnitude += std::fabs(bias_[v]);
      out[v] = u;
      if (!error.empty()) error[v] = head_logit_error(u, magnitude, accumulate_, stored_);
    }
  }

 private:
  const InputSource& inputs_;
  const HeadOptions options_;
  std::int64_t vocab_;
  std::vector<double> weight_, bias_;  // V x H, V
  double accumulate_, stored_;
};

}  // namespace

std::unique_ptr<StageLogits> make_lm_head_logits(const Case& c, const InputSource& inputs) {
  return std::make_unique<HeadLogits>(c, inputs);
}

}  // namespace lossverify
