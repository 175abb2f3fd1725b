#pragma once
// The LM head stage's files, as the stage uses them (kinds/lm_head/).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "lossverify/kind_api/stage.hpp"

namespace lossverify {

// The stage's own bug switches (BugSwitches::stage_switches), one bit each (lm_head_stage.cpp's catalogue).
namespace head_bug {
inline constexpr std::uint64_t dh_shard_partial = 1u << 0;      // head-dh-shard-partial
inline constexpr std::uint64_t dh_double_reduce = 1u << 1;      // head-dh-double-reduce
inline constexpr std::uint64_t dw_16bit_accumulate = 1u << 2;   // head-dw-16bit-accumulate
inline constexpr std::uint64_t grad_output_first = 1u << 3;     // head-grad-output-first
inline constexpr std::uint64_t bias_repeated = 1u << 4;         // head-bias-repeated
inline constexpr std::uint64_t smoothing_dropped = 1u << 5;     // head-smoothing-dropped
inline constexpr std::uint64_t softcap_dropped = 1u << 6;       // head-softcap-dropped
inline constexpr std::uint64_t target_rounded_early = 1u << 7;  // head-target-rounded-early
}  // namespace head_bug

inline constexpr const char* kLmHead = "lm_head";

// gamma_n for float32 accumulation.
inline double head_gamma32(double n) {
  const double u = 0x1p-24;
  return n * u / (1.0 - n * u);
}

// The bound on a correct head's logit u = sum_k h_k W_vk (+ b_v) (lm_head_reference.cpp): a float32 sum of the terms
// whose magnitudes add up to `magnitude` (gamma of the term count, `accumulate`), then one rounding to the dtype
// (`stored`, its unit roundoff).
inline double head_logit_error(double u, double magnitude, double accumulate, double stored) {
  const double summed = accumulate * magnitude;
  return summed + stored * (std::fabs(u) + summed);
}
// Whether the head reduce-scatters dh to token shards: under sequence parallelism with the head's dh contract (under
// the framework's a rank returns its partial dh of every gathered row, which the framework's linear reduce-scatters).
bool head_scatters_dh(const Case& c);

// The head's inputs as implementations generate them (lm_head_inputs.cpp), values of the input dtype held as doubles:
// h of a token (H values), W's rows `rows` (rows.size() x H), b's columns (zeros without a bias).
void head_hidden_row(const Case& c, const InputSource& inputs, std::int64_t token, double* out);
void head_weight_rows(const Case& c, const InputSource& inputs, VocabRange rows, double* out);
void head_bias_values(const Case& c, const InputSource& inputs, VocabRange columns, double* out);
// A plugin's: h of the rank's rows, W_r and b_r in the dtype, and the head's settings in lv_rank_inputs.
std::vector<std::vector<std::byte>> head_plugin_inputs(const Case& c, const InputSource& inputs,
                                                       const RankAssignment& assignment);
void head_plugin_settings(const Case& c, lv_rank_inputs& settings);

std::unique_ptr<Stage> make_lm_head_stage();
std::unique_ptr<StageReference> make_lm_head_reference(const Case& c, const InputSource& inputs);
std::unique_ptr<StageLogits> make_lm_head_logits(const Case& c, const InputSource& inputs);
void lm_head_cpu_forward(const StageRank& rank);
void lm_head_cpu_backward(const StageRank& rank);

}  // namespace lossverify
