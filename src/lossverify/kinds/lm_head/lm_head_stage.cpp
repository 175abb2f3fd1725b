// The LM head stage (../shared/HEAD.md, docs/spec.md §11): a linear head in front of a kind that reads vocabulary
// logits. h (N x H) and W (V x H), and b (V) with a bias, come from the case's Philox streams; each TP rank holds its
// vocabulary shard of W; the head makes u = h W^T (+ b), the kind's logits, and turns the kind's gradient g of them
// into dh (per token), dW and db (per rank, over its tokens), judged against float64 sums with the error model of
// lm_head_reference.cpp. The kind's gradient g stays inside the head (a fused head never hands it out).
#include <algorithm>
#include <array>
#include <limits>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kinds/lm_head/lm_head_options.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/outputs/rank_output.hpp"
#include "lossverify/plugin.h"

namespace lossverify {

namespace {

Implementation head_bug_entry(const char* name, const char* summary, const char* source, const char* signal,
                              std::vector<std::string> caught_by, std::uint64_t bit) {
  return catalogued_bug(name, summary, source, signal, std::move(caught_by), Applies::stage(kLmHead),
                        switches_with([bit](BugSwitches& b) { b.stage_switches = bit; }));
}

class LmHeadStage final : public Stage {
 public:
  std::string_view name() const override { return kLmHead; }
  std::string_view summary() const override {
    return "a linear LM head in front of the kind: u = h W^T (+ b); dh, dW and db judged";
  }
  const SettingTable& settings() const override {
    using O = HeadOptions;
    constexpr OptionsSlot slot = &LossSpec::stage_options;
    static const SettingTable table{
        integer_setting("hidden", &O::hidden, 64, slot)
            .range(1, 65536)
            .halves_in_shrink()
            .described("H: the hidden size"),
        boolean_setting("bias", &O::bias, false, slot).described("a bias b (V) after h W^T").shrinks_as("no bias"),
        number_setting("hidden_scale", &O::hidden_scale, 1.0, slot)
            .range(0.0, 1e3, true)
            .shrinks_as("hidden scale 1")
            .described("the hidden states' standard deviation"),
        number_setting("weight_scale", &O::weight_scale, 0.0, slot)
            .range(0.0, 1e3)
            .shrinks_as("W at the case's logit scale")
            .described("W's standard deviation; 0: inputs.scale / (sqrt(H) hidden_scale), the case's logit scale"),
        choice_setting("dh_reduce", &O::dh_reduce, std::array{O::DhReduce::head, O::DhReduce::framework},
                       O::DhReduce::head, slot)
            .shrinks_as("the head sums dh")
            .described("who sums a vocab-parallel head's dh over TP: the head (a rank returns the whole dh) or the "
                       "framework after it (a rank returns its shard's partial dh)"),
        integer_setting("chunks", &O::chunks, 4, slot)
            .range(1, 4096)
            .halves_in_shrink()
            .described("lossverify's own head: its chunks of a rank's tokens (the oracle does not read it)"),
    };
    return table;
  }
  void validate(const Case& c) const override {
    if (!kind_of(c.loss).models_logit_error()) {
      detail::fail_at(c.source, "$.stage.kind",
                      "the lm_head stage needs a kind whose reference bounds its loss under an error in its logits "
                      "(cross_entropy, kd, policy); loss kind " +
                          std::string(kind_of(c.loss).name()) + " has none yet");
    }
    if (kind_of(c.loss).inputs().teacher_logits && c.inputs.teacher.same_as_student) {
      detail::fail_at(c.source, "$.inputs.teacher.same_as_student",
                      "the lm_head stage makes the student's logits; a teacher equal to them is not a generated input");
    }
  }
  bool takes_sequence_parallel() const override { return true; }
  // Under sequence parallelism with the head's contract, each micro-batch's token shard of the rank (its
  // sequence_parallel_slots), micro-batch after micro-batch.
  std::vector<std::int64_t> gradient_rows(const Case& c, const RankAssignment& assignment) const override {
    if (!head_scatters_dh(c)) return Stage::gradient_rows(c, assignment);
    std::vector<std::int64_t> rows;
    const auto& begin = assignment.micro_batch_begin;
    for (std::size_t k = 0; k + 1 < begin.size(); ++k) {
      for (const std::int64_t slot :
           sequence_parallel_slots(begin[k + 1] - begin[k], c.layout.tp, assignment.coordinates.tp)) {
        if (slot >= 0) rows.push_back(begin[k] + slot);
      }
    }
    return rows;
  }
  std::vector<std::string> gradients() const override { return {"dh"}; }
  // h (a row per token), W (a row per vocabulary column) and, with a bias, b: what a dump of a head carries.
  std::vector<StageInput> inputs(const Case& c) const override {
    const HeadOptions& o = head_options(c.loss);
    std::vector<StageInput> in = {
        {"h", InputStream::head_hidden, StageInput::Rows::token, o.hidden, o.hidden_scale},
        {"W", InputStream::head_weight, StageInput::Rows::column, o.hidden, head_weight_scale(c)},
    };
    if (o.bias)
      in.push_back({"b", InputStream::head_bias, StageInput::Rows::vocabulary, c.shape.vocab, head_bias_scale(c)});
    return in;
  }
  std::int64_t gradient_columns(std::size_t, const Case& c, const RankAssignment&) const override {
    return head_options(c.loss).hidden;
  }
  std::vector<std::string> parameters() const override { return {"dW", "db"}; }
  ParameterShape parameter_shape(std::size_t which, const Case& c, const RankAssignment& assignment) const override {
    const HeadOptions& o = head_options(c.loss);
    if (which == 0) return {assignment.vocab.size(), o.hidden};
    return {o.bias ? assignment.vocab.size() : 0, 1};
  }
  bool logit_gradient_internal() const override { return true; }
  // lossverify's own head makes a rank's logits in `chunks` chunks of its rows on the CUDA backend.
  std::int64_t chunk_rows(const Case& c, std::int64_t rank_rows) const override {
    const std::int64_t chunks = head_options(c.loss).chunks;
    return std::max<std::int64_t>(1, (rank_rows + chunks - 1) / chunks);
  }
  // u and its error bound for every token (N x V each), h, W and b, in float64 (lm_head_reference.cpp).
  std::int64_t reference_bytes(const Case& c) const override {
    const double n = static_cast<double>(c.shape.tokens), v = static_cast<double>(c.shape.vocab);
    const double h = head_options(c.loss).hidden;
    const double bytes = 8.0 * (2.0 * n * v + (n + v) * h + v + n);
    return bytes > 9e18 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(bytes);
  }
  std::vector<std::pair<std::string, nlohmann::json>> kind_settings_under(const BugSwitches& bugs) const override {
    std::vector<std::pair<std::string, nlohmann::json>> changed;
    if ((bugs.stage_switches & head_bug::smoothing_dropped) != 0) changed.emplace_back("label_smoothing", 0.0);
    if ((bugs.stage_switches & head_bug::softcap_dropped) != 0) changed.emplace_back("softcap", 0.0);
    return changed;
  }
  void cpu_forward(const StageRank& rank) const override { lm_head_cpu_forward(rank); }
  void cpu_backward(const StageRank& rank) const override { lm_head_cpu_backward(rank); }
  std::unique_ptr<StageReference> reference(const Case& c, const InputSource& inputs) const override {
    return make_lm_head_reference(c, inputs);
  }
  std::unique_ptr<StageLogits> float64_logits(const Case& c, const InputSource& inputs) const override {
    return make_lm_head_logits(c, inputs);
  }
  std::int64_t token_input_width(const Case& c) const override { return head_options(c.loss).hidden; }
  void token_input(const Case& c, const InputSource& inputs, std::int64_t token, double* out) const override {
    head_hidden_row(c, inputs, token, out);
  }
  std::uint32_t plugin_capability() const override { return LV_SUPPORTS_LM_HEAD; }
  std::string_view plugin_capability_name() const override { return "LV_SUPPORTS_LM_HEAD"; }
  // LV_SUPPORTS_LM_HEAD was defined for a head in front of cross-entropy and KD (include/lossverify/plugin.h).
  bool plugin_capability_covers(std::string_view kind) const override {
    return kind == "cross_entropy" || kind == "kd";
  }
  void plugin_settings(const Case& c, const RankAssignment&, lv_rank_inputs& settings) const override {
    head_plugin_settings(c, settings);
  }
  std::vector<std::vector<std::byte>> plugin_inputs(const Case& c, const InputSource& inputs,
                                                    const RankAssignment& assignment) const override {
    return head_plugin_inputs(c, inputs, assignment);
  }
  std::vector<Implementation> catalogue() const override {
    return {
        head_bug_entry("head-dh-shard-partial", "dh of a vocabulary shard not summed over TP",
                       "Apple ml-cross-entropy #42 (b616b22)", "dh at tp > 1 is the rank's partial sum", {"dh"},
                       head_bug::dh_shard_partial),
        head_bug_entry("head-dh-double-reduce", "dh summed over TP by the head and again after it",
                       "Apple ml-cross-entropy #42 (b616b22)",
                       "dh at tp > 1: x TP (head's contract), whole instead of "
                       "partial (framework's)",
                       {"dh"}, head_bug::dh_double_reduce),
        head_bug_entry("head-dw-16bit-accumulate", "dW (and db) accumulated across chunks in the 16-bit dtype",
                       "axolotl #1601; Liger-Kernel #830; OLMo-core #370",
                       "dW off by half a 16-bit unit per chunk, growing with the chunk count", {"dW"},
                       head_bug::dw_16bit_accumulate),
        head_bug_entry("head-grad-output-first",
                       "reduction none: dW and db use the first token's upstream weight for every token",
                       "Liger-Kernel #1298 (9ac26bb8), #678/#680, #496",
                       "dW and db wherever the upstream weights differ; dh and the loss right", {"dW", "db"},
                       head_bug::grad_output_first),
        head_bug_entry("head-bias-repeated", "the bias added a second time to the target logit, in both passes",
                       "Apple ml-cross-entropy #52 -> #53 (there, at d42911f, in the loss's target dot only: "
                       "ceil(H / 256) copies of b_y, the loss low by (ceil(H / 256) - 1) b_y, the gradients right)",
                       "the loss, dh, dW and db wherever the bias is on", {"loss", "dh", "dW", "db"},
                       head_bug::bias_repeated),
        head_bug_entry("head-smoothing-dropped", "label smoothing not passed through the fused path",
                       "Liger-Kernel #243 -> #244", "the loss, dh and dW wherever the case smooths its labels",
                       {"loss", "dh", "dW"}, head_bug::smoothing_dropped),
        head_bug_entry("head-softcap-dropped", "the softcap never applied in the fused path of a model that has one",
                       "Apple ml-cross-entropy #48 -> #50", "the loss, dh and dW wherever the case softcaps its logits",
                       {"loss", "dh", "dW"}, head_bug::softcap_dropped),
        head_bug_entry("head-target-rounded-early",
                       "the true class's gradient w p_y rounded into the 16-bit buffer before w is subtracted",
                       "Liger-Kernel #1268 -> #1329 (be1cdc17)",
                       "dh at confident rows (p_y -> 1): half a 16-bit unit of w p_y against one rounding of "
                       "w (1 - p_y); dW sums it with every other row's bound",
                       {"dh"}, head_bug::target_rounded_early),
    };
  }
};

}  // namespace

std::string_view to_string(HeadOptions::DhReduce d) {
  return d == HeadOptions::DhReduce::framework ? "framework" : "head";
}

bool head_scatters_dh(const Case& c) {
  return c.layout.sp && head_options(c.loss).dh_reduce == HeadOptions::DhReduce::head;
}

std::unique_ptr<Stage> make_lm_head_stage() { return std::make_unique<LmHeadStage>(); }

}  // namespace lossverify
