#include "lossverify/impl/catalogue.hpp"

#include <algorithm>
#include <mutex>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/kind_api/registry.hpp"

namespace lossverify {

Implementation catalogued_bug(std::string name, std::string summary, std::string source, std::string signal,
                              std::vector<std::string> caught_by, Applies applies, BugSwitches switches) {
  return {std::move(name),      std::move(summary), std::move(source), std::move(signal),
          std::move(caught_by), std::move(applies), switches};
}

namespace {

// The correct implementation and the bugs of the layouts, which every kind (or every labelled kind) has.
std::vector<Implementation> layout_catalogue() {
  const auto bug = catalogued_bug;
  const auto with = [](auto set) { return switches_with(set); };
  const Applies any = Applies::any();
  const Applies labelled = Applies::labelled();
  std::vector<Implementation> v;
  v.push_back({"correct",
               "docs/spec.md §5 algorithm: max all-reduce, one packed sum all-reduce, no log(p)",
               "lossverify",
               "none",
               {},
               any,
               {}});
  v.push_back(bug("ignore-index-unmasked", "ignored targets treated as ordinary tokens",
                  "fused cross-entropy kernels that skip the ignore_index test (docs/spec.md §7)",
                  "loss = lse on ignored rows, nonzero gradient there, valid-token count too large",
                  {"loss", "grad", "stats"}, labelled, with([](BugSwitches& b) { b.ignore_index_unmasked = true; })));
  v.push_back(bug("mean-over-all-rows", "mean reduction divides by all rows, not the valid ones",
                  "NVIDIA/TransformerEngine issue #2476", "loss and gradient scaled by N_v/N", {"loss", "grad"}, any,
                  with([](BugSwitches& b) { b.mean_over_all_rows = true; })));
  v.push_back(bug("none-divides-grad", "reduction none still divides the gradient by N",
                  "NVIDIA/TransformerEngine issue #1879", "gradient/reference = 1/N", {"grad"}, any,
                  with([](BugSwitches& b) { b.none_divides_grad = true; })));
  v.push_back(bug("grad-output-first", "the first upstream weight is used for every row",
                  "NVIDIA/TransformerEngine issue #2139", "gradient rows scaled by g_0/g_t", {"grad"}, any,
                  with([](BugSwitches& b) { b.grad_output_first = true; })));
  v.push_back(bug("dp-local-mean", "each DP rank divides by its own valid-token count; gradients then averaged",
                  "pytorch/torchtitan before its loss-balancing fix (VLM PR stacked on #1802)",
                  "token weight 1/(R N_r) instead of 1/N_v: wrong when ranks hold unequal counts", {"loss", "grad"},
                  any, with([](BugSwitches& b) { b.dp_local_mean = true; })));
  v.push_back(bug("ga-microbatch-mean", "each micro-batch divided by its own valid count and by GA",
                  "pytorch/torchtitan issue #1842", "token weight 1/(GA N_k) instead of 1/N_v", {"loss", "grad"}, any,
                  with([](BugSwitches& b) { b.ga_microbatch_mean = true; })));
  v.push_back(bug(
      "microbatch-local-mean",
      "each rank's micro-batch aggregated with its own counts (its valid tokens; a policy loss's sequences and their "
      "tokens there), divided by GA; gradients then averaged over DP x CP",
      "the PyTorch DDP loop (F.cross_entropy(reduction=\"mean\") / GA); NVIDIA/Megatron-LM's default, not per-token, "
      "loss mode at d98e8a64 (pretrain_gpt.py loss_func, forward_step_calc_loss; its MTP loss too); volcengine/verl's "
      "legacy Megatron actor at b178a3cd (agg_loss's local normalisation, the schedule dividing by K); TRL's bnpo",
      "token weight 1/(DP CP GA n(r,k)) instead of 1/N_v: wrong when ranks or micro-batches hold unequal counts "
      "(= dp-local-mean at GA = 1)",
      {"loss", "grad"}, any, with([](BugSwitches& b) { b.microbatch_local_mean = true; })));
  // A layout bug under its policy-era name (golden/ keys on it): AReaL's loss_multiplier lacked the
  // micro-batch count that Megatron's schedule divides by, for its SFT loss as for its policy loss.
  v.push_back(bug("rl-schedule-double-divide",
                  "a globally normalised loss divided by the micro-batch count again before backward",
                  "inclusionAI/AReaL #1273, the SFT loss too (PR #1223's CP-local SFT path at 430a1f9c: "
                  "gradients / 2 at ga 2); THUDM/slime #987/#990",
                  "every gradient / K (K micro-batches per rank), any loss; logged loss exact; passes at ga = 1",
                  {"grad"}, any, with([](BugSwitches& b) { b.schedule_double_divide = true; })));
  v.push_back(bug("cp-duplicated-loss", "every CP rank back-propagates the full loss",
                  "CP loss on all-gathered logits, what inclusionAI/AReaL PR #1223 (CP-local loss) replaces",
                  "gradient = CP x reference", {"grad"}, any,
                  with([](BugSwitches& b) { b.cp_duplicated_loss = true; })));
  v.push_back(bug("cp-stats-dp-only", "token-count statistics reduced over DP only, not DP x CP",
                  "inclusionAI/AReaL issue #1242", "logged valid-token count = reference / CP (roughly)", {"stats"},
                  any, with([](BugSwitches& b) { b.cp_stats_dp_only = true; })));
  v.push_back(bug("cp-loss-stat-dp-only",
                  "the logged loss is the token mean of the rank's own CP slice, its sums and counts reduced over DP "
                  "only, not DP x CP",
                  "inclusionAI/AReaL PR #1223 (CP-local loss, head 430a1f9c: the stats tracker records the CP-split "
                  "tensors and reduces over DP), fixed on main by AReaL #1249",
                  "each CP rank logs its own slice's token mean (under a sum or a sequence aggregation, its slice's "
                  "part of L): loss fails at cp > 1; gradients and the logged count right",
                  {"loss"}, any, with([](BugSwitches& b) { b.cp_loss_stat_dp_only = true; })));
  v.push_back(bug("cp-roll-after-split", "next-token labels made by rolling the local CP shard",
                  "inclusionAI/AReaL PR #1223 (labels must be rolled before the split)", "wrong labels at chunk ends",
                  {"loss", "grad"}, labelled, with([](BugSwitches& b) { b.cp_roll_after_split = true; })));
  v.push_back(bug("cp-pad-to-cp", "labels split with sequences padded to a multiple of CP instead of 2 CP",
                  "Megatron/TransformerEngine load-balanced CP needs L divisible by 2 CP (AReaL PR #1223)",
                  "misaligned chunks: wrong labels, wrong losses", {"loss", "grad"}, labelled,
                  with([](BugSwitches& b) { b.cp_pad_to_cp = true; })));
  return v;
}

}  // namespace

const std::deque<Implementation>& implementations() {
  // Built on first use, and extended by the catalogue of each kind registered since (kinds/registry.hpp).
  static std::mutex mutex;
  static std::deque<Implementation> list;
  static std::size_t kinds_seen = 0, stages_seen = 0;
  const std::lock_guard lock(mutex);
  if (list.empty()) {
    for (Implementation& impl : layout_catalogue()) list.push_back(std::move(impl));
  }
  const std::vector<const LossKind*> kinds = loss_kinds();
  for (; kinds_seen < kinds.size(); ++kinds_seen) {
    for (Implementation& impl : kinds[kinds_seen]->catalogue()) list.push_back(std::move(impl));
  }
  const std::vector<const Stage*> registered = stages();
  for (; stages_seen < registered.size(); ++stages_seen) {
    for (Implementation& impl : registered[stages_seen]->catalogue()) list.push_back(std::move(impl));
  }
  return list;
}

const std::vector<Implementation>& control_implementations() {
  static const std::vector<Implementation> list = {
      {"correct-16bit",
       "the correct algorithm computing in the logits' 16-bit dtype, each intermediate tensor stored in it as "
       "PyTorch's eager ops store it (the control band's 16-bit control; on fp32 logits it is correct)",
       "lossverify (docs/checks.md, \"The control band\")",
       "none: the margins honest 16-bit rounding reaches",
       {},
       Applies::any(),
       switches_with([](BugSwitches& b) { b.compute_in_input_dtype = true; })}};
  return list;
}

const Implementation* find_implementation(std::string_view name) {
  if (is_plugin_spec(name)) return load_plugin_implementation(name);
  for (const auto& impl : implementations()) {
    if (impl.name == name) return &impl;
  }
  for (const auto& impl : control_implementations()) {
    if (impl.name == name) return &impl;
  }
  return nullptr;
}

bool applies_to(const Implementation& impl, const LossKind* kind) {
  switch (impl.applies.scope) {
    case Applies::Scope::any:
      return true;
    case Applies::Scope::labelled:
      return kind->inputs().labels;
    case Applies::Scope::kinds:
      return std::find(impl.applies.kinds.begin(), impl.applies.kinds.end(), kind->name()) != impl.applies.kinds.end();
    case Applies::Scope::stage:
      return true;  // whatever kind is behind the stage (applies_to(impl, loss) asks for the stage)
  }
  return false;
}

bool applies_to(const Implementation& impl, const LossSpec& loss) {
  if (!applies_to(impl, loss.kind)) return false;
  if (impl.applies.scope == Applies::Scope::stage &&
      (loss.stage == nullptr || loss.stage->name() != impl.applies.kinds.front())) {
    return false;
  }
  return impl.plugin == nullptr || missing_plugin_capability(*impl.plugin, loss).empty();
}

std::string applies_in_words(const Applies& applies) {
  if (applies.scope == Applies::Scope::stage) return "cases with the stage " + applies.kinds.front();
  std::vector<std::string> names = applies.kinds;
  if (applies.scope != Applies::Scope::kinds) {
    for (const LossKind* kind : loss_kinds()) {
      if (applies.scope == Applies::Scope::any || kind->inputs().labels) names.emplace_back(kind->name());
    }
  }
  std::string out;
  for (const std::string& k : names) out += (out.empty() ? "" : " and ") + k;
  return out;
}

}  // namespace lossverify
