// The LM head's float64 reference (../shared/HEAD.md §1, docs/spec.md §11), from the definitions and its own reading
// of the stage's inputs: u = h W^T (+ b) for every token, exact to float64 rounding (products of 16-bit or float32
// values are exact in float64; H terms add up with a relative error far below a float32 unit), dh = g W,
// dW = g^T h, db = sum_t g_t, with g the kind's reference gradient of u.
//
// The error model (docs/spec.md §11): a correct head accumulates in float32, in any order and any chunking, and
// rounds each output once to the dtype. A sum of n terms accumulated in float32 lies within gamma_n sum |terms|,
// gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, Lemma 3.1), whatever the order; the logits
// then round to the dtype (u_d (|u| + that)). Their error moves the kind's gradient by its own bound
// (KindReference::gradient_under_logit_error) plus the kind's tolerance and one rounding to the dtype (the oracle's
// row_grad_error). dh over the columns C the contract sums, dW over the rank's tokens:
//   |dh_k err| <= sum_{v in C} e_v |W_vk| + gamma_{|C| + TP} sum_{v in C} (|g_v| + e_v) |W_vk|
//   |dW_vk err| <= sum_t e_tv |h_tk| + gamma_N sum_t (|g_tv| + e_tv) |h_tk|      (db: h = 1)
// and one rounding of the output, which the gradient rule of the dtype covers.
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

double gamma32(double n) { return head_gamma32(n); }

class LmHeadReference final : public StageReference {
 public:
  LmHeadReference(const Case& c, const InputSource& inputs)
      : options_(head_options(c.loss)),
        tokens_(c.shape.tokens),
        vocab_(c.shape.vocab),
        hidden_(options_.hidden),
        tp_(c.layout.tp),
        hidden_states_(static_cast<std::size_t>(tokens_ * hidden_)),
        weight_(static_cast<std::size_t>(vocab_ * hidden_)),
        bias_(static_cast<std::size_t>(vocab_), 0.0),
        logits_(static_cast<std::size_t>(tokens_ * vocab_)),
        error_(logits_.size()),
        largest_error_(static_cast<std::size_t>(tokens_), 0.0) {
    const auto h = static_cast<std::int64_t>(hidden_);
    for (std::int64_t t = 0; t < tokens_; ++t) {
      inputs.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(t), 0, h, options_.hidden_scale,
                          &hidden_states_[static_cast<std::size_t>(t * h)]);
    }
    const double w_scale = head_weight_scale(c);
    for (std::int64_t v = 0; v < vocab_; ++v) {
      inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(v), 0, h, w_scale,
                          &weight_[static_cast<std::size_t>(v * h)]);
    }
    if (options_.bias) inputs.stage_values(InputStream::head_bias, 0, 0, vocab_, head_bias_scale(c), bias_.data());
    const double accumulate = gamma32(static_cast<double>(hidden_ + (options_.bias ? 1 : 0)));
    const double stored = unit_roundoff(c.inputs.dtype);
    for (std::int64_t t = 0; t < tokens_; ++t) {
      const double* x = &hidden_states_[static_cast<std::size_t>(t * h)];
      for (std::int64_t v = 0; v < vocab_; ++v) {
        const double* w = &weight_[static_cast<std::size_t>(v * h)];
        double u = 0.0, magnitude = 0.0;
        for (std::int64_t k = 0; k < h; ++k) {
          u += x[k] * w[k];
          magnitude += std::fabs(x[k] * w[k]);
        }
        u += bias_[static_cast<std::size_t>(v)];
        magnitude += std::fabs(bias_[static_cast<std::size_t>(v)]);
        const auto at = static_cast<std::size_t>(t * vocab_ + v);
        logits_[at] = u;
        error_[at] = head_logit_error(u, magnitude, accumulate, stored);
        largest_error_[static_cast<std::size_t>(t)] = std::max(largest_error_[static_cast<std::size_t>(t)], error_[at]);
      }
    }
  }

  bool makes_logits() const override { return true; }
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const override {
    std::copy_n(&logits_[static_cast<std::size_t>(token * vocab_ + begin)], end - begin, out);
  }
  void logit_error(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const override {
    std::copy_n(&error_[static_cast<std::size_t>(token * vocab_ + begin)], end - begin, out);
  }
  double largest_logit_error(std::int64_t token) const override {
    return largest_error_[static_cast<std::size_t>(token)];
  }

  // dh: over the whole row under the head's contract, over the rank's columns under the framework's.
  void input_gradient(std::size_t, std::int64_t, VocabRange rank, std::span<const double> row_grad,
                      std::span<const double> row_grad_error, std::span<double> out,
                      std::span<double> bound) const override {
    const bool whole = options_.dh_reduce == HeadOptions::DhReduce::head;
    const std::int64_t begin = whole ? 0 : rank.begin, end = whole ? vocab_ : rank.end;
    const double accumulate = gamma32(static_cast<double>(end - begin + tp_));
    const auto h = static_cast<std::size_t>(hidden_);
    for (std::size_t k = 0; k < h; ++k) out[k] = bound[k] = 0.0;
    std::vector<double> magnitude(h, 0.0);
    for (std::int64_t v = begin; v < end; ++v) {
      const double g = row_grad[static_cast<std::size_t>(v)], e = row_grad_error[static_cast<std::size_t>(v)];
      const double* w = &weight_[static_cast<std::size_t>(v) * h];
      for (std::size_t k = 0; k < h; ++k) {
        out[k] += g * w[k];
        bound[k] += e * std::fabs(w[k]);
        magnitude[k] += (std::fabs(g) + e) * std::fabs(w[k]);
      }
    }
    for (std::size_t k = 0; k < h; ++k) bound[k] += accumulate * magnitude[k];
  }

  // dW (which 0): rank columns x H; db (which 1): rank columns.
  void accumulate_parameter(std::size_t which, std::int64_t token, std::int64_t begin, std::span<const double> grad,
                            std::span<const double> grad_error, std::span<double> sum,
                            std::span<double> bound) const override {
    const double accumulate = gamma32(static_cast<double>(tokens_));
    const auto h = static_cast<std::size_t>(hidden_);
    const double* x = &hidden_states_[static_cast<std::size_t>(token) * h];
    for (std::size_t j = 0; j < grad.size(); ++j) {
      const double g = grad[j], e = grad_error[j];
      if (which == 1) {
        sum[j] += g;
        bound[j] += e + accumulate * (std::fabs(g) + e);
        continue;
      }
      for (std::size_t k = 0; k < h; ++k) {
        sum[j * h + k] += g * x[k];
        bound[j * h + k] += e * std::fabs(x[k]) + accumulate * (std::fabs(g) + e) * std::fabs(x[k]);
      }
    }
    (void)begin;
  }

 private:
  const HeadOptions options_;
  std::int64_t tokens_, vocab_;
  int hidden_, tp_;
  std::vector<double> hidden_states_, weight_, bias_;  // N x H, V x H, V
  std::vector<double> logits_, error_;                 // N x V
  std::vector<double> largest_error_;                  // N
};

}  // namespace

std::unique_ptr<StageReference> make_lm_head_reference(const Case& c, const InputSource& inputs) {
  return std::make_unique<LmHeadReference>(c, inputs);
}

}  // namespace lossverify
