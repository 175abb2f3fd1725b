// The cross-entropy kind (docs/spec.md §3): l = lse - sum_v q_v x_v + w_z lse^2 over the softcapped logits,
// with label smoothing in the PyTorch or Megatron convention.
#include "lossverify/kinds/cross_entropy/cross_entropy_parts.hpp"

#include <array>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/plugin.h"

namespace lossverify {

namespace {

using nlohmann::json;

class CrossEntropyKind final : public LossKind {
 public:
  std::string_view name() const override { return "cross_entropy"; }
  std::string_view summary() const override {
    return "label_smoothing with smoothing_convention pytorch|megatron, z_loss_weight, softcap, ignore_index, "
           "reduction mean|sum|none, upstream_weights";
  }

  std::vector<std::string> keys() const override {
    return {"label_smoothing", "smoothing_convention", "z_loss_weight", "softcap", "ignore_index"};
  }

  void parse(detail::ObjectReader& r, LossSpec& loss) const override {
    loss.softcap = r.number("softcap", 0.0);
    if (loss.softcap != 0.0 && !(loss.softcap >= kMinSoftcap && loss.softcap <= kMaxSoftcap)) {
      r.fail("softcap", "must be 0 (off) or in [1e-6, 1e6], got " + json(loss.softcap).dump());
    }
    loss.label_smoothing = r.number("label_smoothing", 0.0);
    if (!(loss.label_smoothing >= 0.0 && loss.label_smoothing < 1.0)) {
      r.fail("label_smoothing", "must be in [0, 1), got " + json(loss.label_smoothing).dump());
    }
    const std::string convention = r.string("smoothing_convention", "pytorch");
    if (convention != "pytorch" && convention != "megatron") {
      r.fail("smoothing_convention", "expected one of pytorch|megatron, got \"" + convention + "\"");
    }
    loss.convention = convention == "pytorch" ? SmoothingConvention::pytorch : SmoothingConvention::megatron;
    loss.z_loss_weight = r.number("z_loss_weight", 0.0);
    if (!(loss.z_loss_weight >= 0.0 && loss.z_loss_weight <= kMaxZLossWeight)) {
      r.fail("z_loss_weight", "must be in [0, 10], got " + json(loss.z_loss_weight).dump());
    }
    loss.ignore_index = r.integer("ignore_index", -100);
  }

  void resolve(const LossSpec& loss, json& l) const override {
    l["label_smoothing"] = loss.label_smoothing;
    l["smoothing_convention"] = std::string(to_string(loss.convention));
    l["z_loss_weight"] = loss.z_loss_weight;
    l["softcap"] = loss.softcap;
    l["ignore_index"] = loss.ignore_index;
  }

  // A dump comes from foreign code, where a silent default convention turns correct Megatron-style smoothing
  // into a false alarm (or hides a convention bug).
  void require_explicit(const LossSpec& loss, const json& l, const std::string& source) const override {
    if (loss.label_smoothing <= 0.0) return;
    if (l.is_object() && l.contains("smoothing_convention")) return;
    detail::fail_at(source, "$.loss.smoothing_convention",
                    "label_smoothing > 0 needs an explicit convention: \"pytorch\" (q = (1-a)[v=l] + a/V, as "
                    "torch.nn.functional.cross_entropy and TransformerEngine) or \"megatron\" (q = (1-a)[v=l] + "
                    "a/(V-1)[v!=l], as Megatron-LM's vocab_parallel_cross_entropy); they differ by a constant on "
                    "every non-target gradient, so a wrong guess fails correct code");
  }

  KindInputs inputs() const override { return {true, false}; }

  std::string row_sum_rule() const override { return "sum_v grad = w_t 2 w_z lse for every token"; }
  std::string row_sum_exemption(const LossSpec& loss) const override {
    return loss.softcap != 0.0 ? "softcap changes the invariant: not applicable" : "";
  }

  std::vector<Implementation> catalogue() const override { return cross_entropy_catalogue(); }

  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    return make_cross_entropy_reference(c, inputs);
  }

  std::optional<DeviceRowModel> device_row_model(const Case& c) const override {
    DeviceRowModel m;
    m.softcap = c.loss.softcap;
    m.z_loss_weight = c.loss.z_loss_weight;
    const TargetWeights q = cross_entropy_target_weights(c);
    m.q_on = q.on;
    m.q_off = q.off;
    return m;
  }

  // full-vocab-through-tp: every rank's kernel holds the whole gathered row.
  VocabRange kernel_columns(const BugSwitches& bugs, VocabRange own, std::int64_t vocab) const override {
    return bugs.full_vocab_through_tp ? VocabRange{0, vocab} : own;
  }
  void cpu_micro_batch(const CpuMicroBatch& batch) const override { cross_entropy_cpu_micro_batch(batch); }

  std::optional<int> plugin_kind() const override { return LV_LOSS_CROSS_ENTROPY; }
};

}  // namespace

std::unique_ptr<LossKind> make_cross_entropy_kind() { return std::make_unique<CrossEntropyKind>(); }

}  // namespace lossverify
