#pragma once
// The LM head stage's settings (../shared/HEAD.md, docs/spec.md §11): the case's "stage" section, {"kind": "lm_head",
// "hidden": H, ...}. Declared once, in the stage's table (lm_head_stage.cpp).
#include <cmath>
#include <string_view>

#include "lossverify/case/case.hpp"
#include "lossverify/case/kind_settings.hpp"

namespace lossverify {

struct HeadOptions final : KindOptions {
  int hidden = 64;            // H: the hidden size
  bool bias = false;          // a bias b (V) after h W^T
  double hidden_scale = 1.0;  // the hidden states' standard deviation
  double weight_scale = 0.0;  // W's; 0: inputs.scale / (sqrt(H) hidden_scale), so that u = h W^T spreads like the
                              // case's logits
  // Who sums a vocab-parallel head's dh over TP: the head (each rank returns the whole dh) or the framework's
  // column-parallel linear after it (each rank returns its shard's partial dh).
  enum class DhReduce { head, framework };
  DhReduce dh_reduce = DhReduce::head;
  int chunks = 4;  // the implementation's chunks of tokens (lossverify's own head; the oracle does not read it)
};

inline const HeadOptions& head_options(const LossSpec& loss) {
  return options_of<HeadOptions>(loss, &LossSpec::stage_options);
}
std::string_view to_string(HeadOptions::DhReduce);

// W's standard deviation: the case's, or the one that gives u = h W^T the case's logit scale.
inline double head_weight_scale(const Case& c) {
  const HeadOptions& o = head_options(c.loss);
  if (o.weight_scale > 0.0) return o.weight_scale;
  return c.inputs.scale / (std::sqrt(static_cast<double>(o.hidden)) * o.hidden_scale);
}
// b's: half the logit scale.
inline double head_bias_scale(const Case& c) { return 0.5 * c.inputs.scale; }

}  // namespace lossverify
