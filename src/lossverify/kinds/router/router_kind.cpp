// The router kind (../shared/MOE.md, docs/spec.md §10): a mixture-of-experts router's load-balancing losses (the
// Switch form over a micro-batch's scope, per sequence, and with the global batch's counts) and z-loss, on router
// logits whose layers x E columns are whole on every rank, under the trainer's scaling contract (MOE.md §2).
#include <array>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

namespace {

using nlohmann::json;
using Score = RouterOptions::Score;

Implementation router_bug_entry(const char* name, const char* summary, const char* source, const char* signal,
                                std::vector<std::string> caught_by, std::uint64_t bit) {
  return catalogued_bug(name, summary, source, signal, std::move(caught_by), Applies::kind("router"),
                        switches_with([bit](BugSwitches& b) { b.kind_switches = bit; }));
}

// The router's groups (router::routed_top_k): they tile the experts, the selected groups hold k experts, and each
// selected group is scored by k / top_groups of its keys.
void validate_groups(const Case& c, const RouterOptions& o, std::int64_t experts) {
  if (experts % o.groups != 0) {
    detail::fail_at(c.source, "$.loss.groups",
                    std::to_string(o.groups) + " groups do not tile the " + std::to_string(experts) + " experts");
  }
  if (o.top_groups > o.groups) {
    detail::fail_at(c.source, "$.loss.top_groups",
                    "must be at most groups (" + std::to_string(o.groups) + "), got " + std::to_string(o.top_groups));
  }
  if (o.groups > 1 && o.top_k % o.top_groups != 0) {
    detail::fail_at(c.source, "$.loss.top_groups",
                    "must divide top_k (" + std::to_string(o.top_k) + "): each selected group is scored by its top " +
                        "k / top_groups keys; got " + std::to_string(o.top_groups));
  }
  if (o.groups > 1 && o.top_k / o.top_groups > experts / o.groups) {
    detail::fail_at(c.source, "$.loss.top_groups",
                    "scores each group by its top " + std::to_string(o.top_k / o.top_groups) + " keys, but a group " +
                        "holds " + std::to_string(experts / o.groups) + " experts");
  }
}

class RouterKind final : public LossKind {
 public:
  std::string_view name() const override { return "router"; }
  std::string_view summary() const override {
    return "a mixture-of-experts router's load-balancing losses (micro-batch, sequence, global batch) and z-loss";
  }
  const SettingTable& settings() const override {
    using O = RouterOptions;
    static const SettingTable table{
        integer_setting("top_k", &O::top_k, 2)
            .range(1, 1024)
            .described("k: the experts each token is routed to (1 <= k < experts)"),
        integer_setting("layers", &O::layers, 1)
            .range(1, 64)
            .described("MoE layers, each with its own router logits: rows are [layers x experts]"),
        choice_setting("score", &O::score, std::array{Score::softmax, Score::sigmoid}, Score::softmax)
            .described("softmax p_t, or sigmoid normalised over the experts q_t, for the aux loss"),
        number_setting("aux_coef", &O::aux_coef, 0.01)
            .range(0.0, 10.0)
            .described("alpha of the aux loss over a micro-batch (0: off)"),
        number_setting("seq_aux_coef", &O::seq_aux_coef, 0.0)
            .range(0.0, 10.0)
            .described("alpha of the sequence aux loss, one scope per sequence, averaged over the micro-batch's")
            .shrinks_as("no sequence aux loss"),
        number_setting("global_aux_coef", &O::global_aux_coef, 0.0)
            .range(0.0, 10.0)
            .described("alpha of the global aux loss: f_e from the step's counts, P_e the micro-batch's")
            .shrinks_as("no global aux loss"),
        choice_setting("global_counts", &O::global_counts, std::array{O::GlobalCounts::step, O::GlobalCounts::running},
                       O::GlobalCounts::step)
            .described("step: the whole step's counts; running: those of micro-batches 0..m"),
        number_setting("z_loss_coef", &O::z_loss_coef, 0.0)
            .range(0.0, 10.0)
            .described("alpha_z of the router z-loss")
            .shrinks_as("no z-loss"),
        choice_setting("counts", &O::counts, std::array{O::Counts::top_k, O::Counts::first}, O::Counts::top_k)
            .described("the aux terms' counts: every routed expert, or first choices only (f_e = c1_e / T)"),
        boolean_setting("divide_by_k", &O::divide_by_k, true)
            .described("f_e = c_e / (k T), or c_e / T (k times the Switch form, as transformers writes it)"),
        boolean_setting("pool_layers", &O::pool_layers, false)
            .described("one aux loss over every layer's counts and scores pooled (transformers), not one per layer")
            .shrinks_as("one aux loss per layer"),
        choice_setting("map", &O::map, std::array{O::Map::top_k, O::Map::routed}, O::Map::top_k)
            .described("the aux terms' routing map: the plain top-k of the scores, or the routed map (group-limited "
                       "top-k of the routing scores plus the expert bias)")
            .shrinks_as("the plain top-k map"),
        integer_setting("groups", &O::groups, 1)
            .range(1, 64)
            .described("the router's expert groups (contiguous, E / groups each)")
            .shrinks_as("one group"),
        integer_setting("top_groups", &O::top_groups, 1)
            .range(1, 64)
            .described("the groups a token may route to, each scored by its top k / top_groups routing keys"),
        number_setting("expert_bias", &O::expert_bias, 0.0)
            .range(0.0, 10.0)
            .described("beta of the router's expert bias b_le in [-beta, beta], added to the routing scores for the "
                       "routed map (docs/spec.md)")
            .shrinks_as("no expert bias"),
        choice_setting("scaling", &O::scaling, std::array{O::Scaling::standard, O::Scaling::per_token},
                       O::Scaling::standard)
            .described("default: the mean of the micro-batches' losses; per_token: each weighs T_S / N and the "
                       "framework divides every gradient by N"),
    };
    return table;
  }
  void validate(const Case& c) const override {
    // The global aux loss's counts are all-reduced over every rank each micro-batch: a rank with an empty
    // micro-batch would not arrive (its kernel is not called), so every DP rank's micro-batches must hold tokens.
    if (router_options(c.loss).global_aux_coef > 0.0) {
      const GlobalBatch batch(c.batch);
      for (int dp = 0; dp < c.layout.dp; ++dp) {
        for (int k = 0; k < c.layout.ga; ++k) {
          if (sequences_of_slot(batch, c.batch, c.layout, dp, k).empty()) {
            detail::fail_at(c.source, "$.loss.global_aux_coef",
                            "DP rank " + std::to_string(dp) + "'s micro-batch " + std::to_string(k) +
                                " holds no sequence; the global aux loss needs every micro-batch of every DP rank");
          }
        }
      }
    }
    const RouterOptions& o = router_options(c.loss);
    if (o.pool_layers && (o.seq_aux_coef > 0.0 || o.global_aux_coef > 0.0)) {
      detail::fail_at(c.source, "$.loss.pool_layers",
                      "pools the layers of the aux loss only (as transformers does): the sequence and global aux "
                      "losses are per layer, so their coefficients must be 0");
    }
    const std::int64_t experts = c.shape.vocab / router_options(c.loss).layers;
    if (router_options(c.loss).top_k >= experts) {
      detail::fail_at(c.source, "$.loss.top_k",
                      "must be below the experts (" + std::to_string(experts) + "), got " +
                          std::to_string(router_options(c.loss).top_k));
    }
    validate_groups(c, o, experts);
    // 16-bit router logits tie at the k-th score (MOE.md §3) far more often than the bound for ties is worth
    // without one: routers compute in float32 (Megatron's moe_router_dtype), and so does this kind.
    if (c.inputs.dtype != DType::fp32) {
      detail::fail_at(c.source, "$.inputs.dtype",
                      "the router kind reads float32 router logits, got " + std::string(to_string(c.inputs.dtype)));
    }
  }
  KindInputs inputs() const override { return {false, false}; }
  bool columns_split_by_tp() const override { return false; }
  std::string_view column_axis() const override { return "experts"; }
  std::int64_t row_blocks(const LossSpec& spec) const override { return router_options(spec).layers; }
  // Generated router logits keep any two experts of a layer at least scale / 32768 apart (MOE.md section 3).
  LogitDistribution default_logit_distribution() const override { return LogitDistribution::separated; }
  std::string invariance_class(const LayoutSpec& layout) const override {
    return "dp" + std::to_string(layout.dp) + "-ga" + std::to_string(layout.ga);
  }
  std::string_view invariance_rule() const override {
    return "one dp and ga (a router's scopes are its micro-batches), over tp, sp and cp";
  }
  bool scopes_are_micro_batches() const override { return true; }
  bool divides_by_step_tokens(const LossSpec& spec) const override {
    return router_options(spec).scaling == RouterOptions::Scaling::per_token;
  }

  bool logs_loss_in_input_dtype() const override { return false; }
  KindRowPlan plan_rows(const RowPlanRequest& request) const override { return plan_router_rows(request); }
  // The logged aux loss (every aux term) and z-loss, each the mean over layers of a layer's as it enters the step's
  // loss; with several layers, each layer's too.
  std::vector<std::string> logged_statistics(const LossSpec& spec) const override {
    std::vector<std::string> names = {"aux_loss", "z_loss"};
    const int layers = router_options(spec).layers;
    for (int l = 0; layers > 1 && l < layers; ++l) {
      names.push_back("aux_loss.layer" + std::to_string(l));
      names.push_back("z_loss.layer" + std::to_string(l));
    }
    return names;
  }
  // Each micro-batch scope's counts per expert, layer after layer, as the rank holds them after their all-reduce.
  std::string_view scope_values_name() const override { return "counts"; }
  std::string row_sum_rule() const override { return "none: the router's row sums depend on its scope"; }
  std::string row_sum_exemption(const LossSpec&) const override {
    return "the router's row sums depend on its scope's counts: not checked";
  }
  std::vector<Implementation> catalogue() const override {
    return {
        router_bug_entry("moe-aux-local-counts",
                         "counts and T from the rank's own tokens, not all-reduced over the "
                         "sequence partition",
                         "Megatron-LM dc41f8908a", "loss, grad and the counts depend on SP and CP",
                         {"loss", "grad", "counts"}, router_bug::local_counts),
        router_bug_entry("moe-aux-topk-squared", "the aux loss divided by k^2 instead of k",
                         "Megatron-LM dc41f8908a, fixed in 5c8eb08f66", "loss and grad = reference / k",
                         {"loss", "grad"}, router_bug::topk_squared),
        router_bug_entry("moe-aux-tp-sum",
                         "under SP the aux loss on logits all-gathered over TP: the gather's "
                         "backward sums TP identical aux gradients",
                         "Megatron-LM cac8d1a3f0", "router grad x TP at tp > 1 with sp", {"grad"}, router_bug::tp_sum),
        router_bug_entry("moe-aux-cp-missing", "the injected aux gradient lacks the CP factor the main loss has",
                         "Megatron-LM f6e0d425a5 (#2237)", "grad / CP at cp > 1", {"grad"}, router_bug::cp_missing),
        router_bug_entry("moe-aux-padding-counted", "padding tokens counted in T and in the scores' sums",
                         "Megatron-LM #2142, #3096; transformers #28517, #29363",
                         "loss, grad and the counts wherever a scope holds padding", {"loss", "grad", "counts"},
                         router_bug::padding_counted),
        router_bug_entry("moe-aux-no-grad", "the aux loss scaler's return discarded: no aux gradient",
                         "NeMo Automodel #1408, fixed in #1412", "the aux terms' gradient 0; the loss right", {"grad"},
                         router_bug::no_grad),
        router_bug_entry("moe-aux-log-doubled",
                         "the logged aux loss doubled (activation checkpointing runs the "
                         "router's forward twice)",
                         "Megatron-LM e6d56d6828, 4abeecce74 (#3199)",
                         "the logged aux loss x 2; loss and gradients right", {"stats"}, router_bug::log_doubled),
        router_bug_entry("moe-aux-ga-overweight",
                         "the aux gradient summed over the DP ranks and the micro-batches, not averaged",
                         "NeMo Automodel #3359 (bcebe8ed: x DP GA, docs/frameworks.md)",
                         "the aux terms' gradient x DP GA at dp GA > 1", {"grad"}, router_bug::ga_overweight),
        router_bug_entry("moe-aux-per-token-divided",
                         "per-token mode: the aux gradient already divided by the step's tokens, and finalize "
                         "divides it again",
                         "Megatron-LM 87d9d2506a", "the aux terms' gradient / N in per-token mode", {"grad"},
                         router_bug::per_token_divided),
        router_bug_entry("moe-aux-per-token-tp-cp", "per-token mode scales the aux and z gradients by 1/(TP CP)",
                         "Megatron-LM 9ef8a2a420 (#5047)", "the router gradient / (TP CP) in per-token mode", {"grad"},
                         router_bug::per_token_tp_cp),
        router_bug_entry("moe-seq-aux-mbs", "per-token mode: the sequence aux gradient divided by the micro-batch size",
                         "Megatron-LM e3fe5508c9 (#5798)",
                         "the sequence aux term's gradient / the micro-batch's sequences in per-token mode", {"grad"},
                         router_bug::seq_aux_mbs),
        router_bug_entry("moe-aux-count-not-returned",
                         "per-token mode at CP > 1: the token count never handed to finalize, so nothing divides by it",
                         "verl #6609, fixed in #6836", "the router gradient x N in per-token mode at cp > 1", {"grad"},
                         router_bug::count_not_returned),
        router_bug_entry("moe-aux-global-topk", "a global top_k (2) used instead of the router's own",
                         "OpenRLHF 152c72ba", "loss, grad and the counts wherever the router's top_k is not 2",
                         {"loss", "grad", "counts"}, router_bug::global_topk),
        router_bug_entry("moe-aux-per-token-rank-count",
                         "per-token mode: a scope's tokens taken as the rank's own count x the ranks of the scope",
                         "Megatron-LM router.py, MOE.md section 2",
                         "the router gradient wherever the ranks of a scope hold unequal valid tokens", {"grad"},
                         router_bug::per_token_rank_count),
        router_bug_entry("moe-zloss-rank-mean",
                         "default mode: the z-loss a mean of per-rank means, alpha_z / (TP CP) over each rank's own "
                         "valid tokens",
                         "Megatron-LM d98e8a64 router.py apply_z_loss (docs/frameworks.md)",
                         "the z-loss and its gradient wherever the ranks of a scope hold unequal valid tokens",
                         {"loss", "grad", "stats"}, router_bug::zloss_rank_mean),
        router_bug_entry("moe-aux-per-token-reduced-count",
                         "per-token mode: the aux terms' token count read after its in-place all-reduce, the scope's "
                         "T_S where the rank's own was meant",
                         "Megatron-LM d98e8a64 moe_utils.py get_tokens_per_expert_and_token_count (docs/frameworks.md)",
                         "the aux terms' gradient x TP CP under SP (x CP without) in per-token mode; the global aux "
                         "term's is T_DP TP CP / T_S in the code, taken as TP CP (exact at dp 1)",
                         {"grad"}, router_bug::per_token_reduced_count),
        router_bug_entry("moe-seq-aux-mean-length",
                         "the sequence aux loss scaled by the micro-batch's mean sequence length, not each "
                         "sequence's own",
                         "Megatron-LM d98e8a64 router.py _apply_seq_aux_loss (docs/frameworks.md)",
                         "the sequence aux term x (S_j / mean S)^2 wherever a micro-batch's sequences hold unequal "
                         "valid tokens",
                         {"loss", "grad", "stats"}, router_bug::seq_aux_mean_length),
        router_bug_entry("moe-global-aux-mean-counts",
                         "running global counts: f from their mean over the micro-batches so far, over the current "
                         "micro-batch's tokens",
                         "Megatron-LM d98e8a64 router.py _apply_global_aux_loss (docs/frameworks.md)",
                         "the global aux term x (T_1 + ... + T_m) / (m T_m) at micro-batch m",
                         {"loss", "grad", "stats"}, router_bug::global_mean_counts),
        router_bug_entry("moe-global-aux-batch-tokens",
                         "the global aux term's P over the micro-batch's tokens of every DP rank, not its scope's",
                         "Megatron-LM d98e8a64 router.py _apply_global_aux_loss (docs/frameworks.md)",
                         "the global aux term x T_S / T_DP at dp > 1", {"loss", "grad", "stats"},
                         router_bug::global_batch_tokens),
        router_bug_entry(
            "moe-aux-mask-ignored",
            "the padding mask never reaches the router: padded and masked rows routed as tokens, in T, "
            "the counts, the scores' sums and the z-loss, and given a gradient",
            "DeepSpeed-MoE edaa7221 top2gating/topkgating (used_token dropped); verl 1dda039b BSHD "
            "(docs/frameworks.md)",
            "a gradient on padded and masked rows; loss, grad and the counts wherever a scope holds padding",
            {"loss", "grad", "counts", "stats"}, router_bug::mask_ignored),
        router_bug_entry("moe-aux-mask-counts-only",
                         "the padding mask reaches the experts' counts only: T, the scores' sums and the gradient "
                         "over every row",
                         "DeepSpeed-MoE edaa7221 top1gating (docs/frameworks.md)",
                         "a gradient on padded and masked rows; valid rows' aux gradient x (T / rows)^2",
                         {"loss", "grad", "stats"}, router_bug::mask_counts_only),
        router_bug_entry("moe-aux-ga-double-divide",
                         "the aux gradient divided by the micro-batch count twice (once by the trainer, once by "
                         "a hook on the model's returned aux loss)",
                         "DeepSpeed edaa7221 engine GA hooks with the loss returned beside the aux loss "
                         "(docs/frameworks.md)",
                         "the aux terms' gradient / GA at ga > 1", {"grad"}, router_bug::ga_double_divide),
        router_bug_entry("moe-seq-aux-packed",
                         "the sequence aux loss over a packed micro-batch: one sequence of all its tokens, so the "
                         "micro-batch's aux loss with the sequence coefficient",
                         "verl 1dda039b THD packing into Megatron-LM's router (docs/frameworks.md)",
                         "the sequence aux term wherever a micro-batch holds several sequences",
                         {"loss", "grad", "stats"}, router_bug::seq_aux_packed),
        router_bug_entry("moe-aux-loss-dp-ga-summed",
                         "the aux term inside a loss the trainer sums over the micro-batches and the DP ranks (scaled "
                         "for a token-normalised main loss): its value and gradient x DP GA",
                         "transformers Trainer with average_tokens_across_devices (#48690; docs/frameworks.md)",
                         "the aux terms' loss, logged value and gradient x DP GA at dp GA > 1",
                         {"loss", "grad", "stats"}, router_bug::aux_loss_dp_ga_summed),
    };
  }
  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    return make_router_reference(c, inputs);
  }
  void cpu_micro_batch(const CpuMicroBatch& batch) const override { router_cpu_micro_batch(batch); }
};

}  // namespace

const RouterOptions& router_options(const LossSpec& loss) { return options_of<RouterOptions>(loss); }

std::string_view to_string(RouterOptions::Score s) { return s == Score::sigmoid ? "sigmoid" : "softmax"; }
std::string_view to_string(RouterOptions::GlobalCounts g) {
  return g == RouterOptions::GlobalCounts::running ? "running" : "step";
}
std::string_view to_string(RouterOptions::Map m) { return m == RouterOptions::Map::routed ? "routed" : "top_k"; }
std::string_view to_string(RouterOptions::Counts c) { return c == RouterOptions::Counts::first ? "first" : "top_k"; }
double aux_k_divisor(const RouterOptions& o) {
  return o.counts == RouterOptions::Counts::first || !o.divide_by_k ? 1.0 : static_cast<double>(o.top_k);
}
std::string_view to_string(RouterOptions::Scaling s) {
  return s == RouterOptions::Scaling::per_token ? "per_token" : "default";
}

std::unique_ptr<LossKind> make_router_kind() { return std::make_unique<RouterKind>(); }

}  // namespace lossverify
