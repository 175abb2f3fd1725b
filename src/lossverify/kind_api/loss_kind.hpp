#pragma once
// A loss kind as one module (docs/development.md, "Adding a loss kind"). Everything lossverify knows of
// one loss -- its case section, the inputs it reads, its catalogued bugs, its sharded implementation on
// each backend, its float64 reference -- is reached through this interface; the runner, the checks, the
// oracles, the dumps and the bundles ask the kind and never name it. The built-in kinds live in
// kinds/cross_entropy/ and kinds/kd/, and kinds/registry.cpp lists them; a kind added at run time
// (register_loss_kind) needs no edit elsewhere.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/core/dtype.hpp"
#include "lossverify/core/logit_distribution.hpp"
#include "lossverify/kind_api/settings.hpp"
#include "lossverify/layout/vocab_range.hpp"
#include "lossverify/reference/row_partial.hpp"

struct lv_rank_inputs;  // include/lossverify/plugin.h

namespace lossverify {

namespace detail {
class ObjectReader;
}
struct Case;
struct LossSpec;
struct LayoutSpec;
struct BugSwitches;
struct Implementation;
struct RankAssignment;
class InputSource;
class RankPlan;
struct RankGroups;
class ProgressBeacon;

// What a kind's ranks and its reference read besides the logits.
struct KindInputs {
  bool labels = true;           // a target column per token (ignore_index masks; overrides may set it)
  bool teacher_logits = false;  // a second [N, V] tensor of logits from its own Philox stream ("teacher")
};

// The float64 reference of one row, written from the kind's definitions (docs/spec.md §3) and nothing
// else. A row is evaluated over column slices [begin, begin + size): partial() of each slice, the slices'
// sums added up (rescaled to the row's maxima, see RowPartial), stats() of the total, then, when the
// kind needs it, a second pass value_partial() summed over the slices (into RowStats::value), and
// token_loss(). `teacher` is empty unless the kind reads teacher logits.
class KindReference {
 public:
  virtual ~KindReference() = default;
  virtual RowPartial partial(std::int64_t token, std::int64_t begin, std::span<const double> logits,
                             std::span<const double> teacher) const = 0;
  virtual RowStats stats(const RowPartial& total) const = 0;
  // A second pass over the columns once the row's statistics are known (KD's sum P (log P - log Q)).
  virtual bool needs_value_pass() const { return false; }
  virtual std::pair<double, double> value_partial(std::int64_t token, const RowStats& stats,
                                                  std::span<const double> logits,
                                                  std::span<const double> teacher) const {
    (void)token, (void)stats, (void)logits, (void)teacher;
    return {0.0, 0.0};
  }
  // l_t from the row's statistics (with a value pass, stats.value is the sum of value_partial over the slices).
  virtual double token_loss(std::int64_t token, const RowStats& stats) const = 0;
  // The token's weight in L where the kind aggregates tokens itself (a policy loss's sequence means); none:
  // the case's reduction decides (1/N_v for mean, 1 for sum, g_t for none).
  virtual std::optional<double> token_weight(std::int64_t token) const {
    (void)token;
    return std::nullopt;
  }
  // The kind's per-token quantities (LossKind::token_quantities), in that order.
  virtual void token_values(std::int64_t token, const RowStats& stats, std::span<double> out) const {
    (void)token, (void)stats, (void)out;
  }
  // Each logged statistic's value at this token (LossKind::logged_statistics); the logged value is their
  // mean over the step's valid tokens.
  virtual void token_statistics(std::int64_t token, const RowStats& stats, std::span<double> out) const {
    (void)token, (void)stats, (void)out;
  }
  // The rounding a correct float32 implementation may carry beyond the tolerance's rtol of the value (docs/checks.md,
  // "Cancellation"): where it subtracts large operands (a policy's log-prob x_y / T - lse, its entropy lse - sum p x
  // / T) or where terms of l_t cancel one another (beta KL against the surrogate). Absolute bounds; 0 for a kind
  // without such arithmetic. For l_t: the magnitude of its terms before they cancel (rtol applies to it; none:
  // |l_t|), and its inputs' rounding times their slopes in l_t.
  // either_way: how far l_t may lie from the reference's where the definitions admit a discrete choice either way
  // (a router's tie tokens: a count moved between the k-th and (k+1)-th experts, MOE.md section 3); it widens the
  // token's tolerance and, weighted, the logged loss's.
  struct LossArithmetic {
    std::optional<double> terms;
    double inputs_rounding = 0.0;
    double either_way = 0.0;
  };
  virtual LossArithmetic token_loss_arithmetic(std::int64_t token, const RowStats& stats) const {
    (void)token, (void)stats;
    return {};
  }
  virtual void token_value_rounding(std::int64_t token, const RowStats& stats, std::span<double> out) const {
    (void)token, (void)stats;
    std::fill(out.begin(), out.end(), 0.0);
  }
  virtual void token_statistic_rounding(std::int64_t token, const RowStats& stats, std::span<double> out) const {
    (void)token, (void)stats;
    std::fill(out.begin(), out.end(), 0.0);
  }
  // How many readings of the token the definitions admit: 1, or 2 where a branch of the objective (a policy
  // ratio at a clip edge) lies within the rounding that a correct implementation's inputs to it carry, so that
  // it may take either side. Reading b is the one evaluated with stats.branch = b (0: the reference's own);
  // the checks accept a token that matches either and report how many tokens were so judged.
  virtual int branches(std::int64_t token, const RowStats& stats) const {
    (void)token, (void)stats;
    return 1;
  }
  // d L / d x of the slice's columns, for a token of weight `weight` in L.
  virtual void gradient(std::int64_t token, const RowStats& stats, double weight, std::int64_t begin,
                        std::span<const double> logits, std::span<const double> teacher,
                        std::span<double> grad) const = 0;
  // The token's gradient factor beyond its weight and the kind's grad_scale, for the gradient's absolute
  // tolerance (docs/spec.md §6): a policy loss's (|g_lambda| + c_H + |g'| |lambda| / 2) / T; none: 1.
  virtual std::optional<double> gradient_scale(std::int64_t token, const RowStats& stats) const {
    (void)token, (void)stats;
    return std::nullopt;
  }
  // Where a discrete choice of the definitions may go either way (a router's tie tokens, MOE.md section 3): an
  // absolute bound per column of the slice on how far d L / d x of a token of weight `weight` may then lie from the
  // reference's, added to the gradient's tolerance; has_gradient_slack false: none (nothing is computed).
  virtual bool has_gradient_slack() const { return false; }
  virtual void gradient_slack(std::int64_t token, double weight, std::span<const double> logits,
                              std::span<double> slack) const {
    (void)token, (void)weight, (void)logits;
    std::fill(slack.begin(), slack.end(), 0.0);
  }
  // The step's tokens whose choice goes either way (counted in the report); 0 where none can.
  virtual std::int64_t either_way_tokens() const { return 0; }
  // The kind's values of one micro-batch scope (LossKind::scope_values_width: a router's per-expert counts) of DP rank
  // `dp`'s micro-batch `micro_batch`, and how far a correct implementation's may lie from them (a user's tie tokens).
  virtual void scope_values(int dp, int micro_batch, std::span<double> expected, std::span<double> slack) const {
    (void)dp, (void)micro_batch;
    std::fill(expected.begin(), expected.end(), 0.0);
    std::fill(slack.begin(), slack.end(), 0.0);
  }
  // sum_v d L / d x_v of a token of weight `weight`: the row-sum invariant; none where it does not hold.
  virtual std::optional<double> gradient_row_sum(const RowStats& stats, double weight) const = 0;
  // A stage in front that computes the logits (an LM head: kind_api/stage.hpp) leaves a correct implementation's
  // logits within `error` of the reference's in every column: bounds on how far the token's loss and each column of
  // its gradient (of weight `weight`, over columns [begin, begin + logits.size())) may then move. none / false: the
  // kind has no such model (LossKind::models_logit_error), and no such stage may sit in front of it.
  virtual std::optional<double> loss_under_logit_error(std::int64_t token, const RowStats& stats, double error) const {
    (void)token, (void)stats, (void)error;
    return std::nullopt;
  }
  virtual bool gradient_under_logit_error(std::int64_t token, const RowStats& stats, double weight, double error,
                                          std::int64_t begin, std::span<const double> logits,
                                          std::span<double> out) const {
    (void)token, (void)stats, (void)weight, (void)error, (void)begin, (void)logits, (void)out;
    return false;
  }
  // For a row model with per-row coefficients (DeviceRowModel::row_coefficients): the token's a and b in
  // d L / d x_v = (w / T) [a (delta_vy - p_v) + c p_v (log p_v + b)], and its gradient_scale (stats.branch
  // picks the reading).
  struct RowCoefficients {
    double a = 0.0, b = 0.0, scale = 1.0;
  };
  virtual RowCoefficients row_coefficients(std::int64_t token, const RowStats& stats) const {
    (void)token, (void)stats;
    return {};
  }
};

// The per-row model the GPU oracle's reference kernels evaluate: one softmax over x (softcapped) against
// a target distribution q (on, off), with a z-loss term; or two softmaxes x / T and y / T (a teacher's); or
// one softmax over x / T with per-row coefficients from the kind's reference (row_coefficients: the policy
// loss's (w / T) [a (delta_vy - p_v) + c p_v (log p_v + b)], its value pass sum_v p_v log p_v).
struct DeviceRowModel {
  bool row_coefficients = false;
  double entropy_coef = 0.0;  // c
  bool teacher = false;
  double temperature = 1.0;
  double teacher_grad_scale = 1.0;  // the teacher model's gradient factor (KD: T^(s-1))
  double softcap = 0.0;
  double z_loss_weight = 0.0;
  double q_on = 1.0, q_off = 0.0;
  bool labels = true;  // rows carry a label (the target column)
};

// One micro-batch of one rank on the CPU backend: rows [begin, begin + n) of the rank. The kind runs its
// collective protocol over groups.tp and writes token_loss[begin + i] of every active row and the
// micro-batch's gradient rows.
struct CpuMicroBatch {
  const Case& c;
  const BugSwitches& bugs;
  const RankPlan& plan;
  RankGroups& groups;
  const RankAssignment& assignment;
  std::int64_t begin = 0, n = 0;
  DType dtype = DType::fp32;
  VocabRange work;           // the columns the kernel's rows hold (kernel_columns)
  std::byte* logits;         // the rank's rows x work.size() logits (writable: a bug may overwrite them)
  const std::byte* teacher;  // the same shape, or null
  std::byte* grad;           // the rank's rows x assignment.vocab.size() gradient
  int threads = 1;
  ProgressBeacon* beacon = nullptr;
  std::vector<float>& token_loss;
  std::vector<float>& logged_token_loss;        // where the plan separates it (KindRowPlan::separate_logged_loss)
  std::vector<float>& token_values;             // rows x the kind's token_quantities(), row major
  std::vector<double>& logged_stats;            // the kind's logged_statistics(): this rank's share, summed over the
                                                // batch group after the last micro-batch
  int index = 0;                                // the micro-batch's (begin alone is ambiguous where some are empty)
  std::vector<double>* scope_values = nullptr;  // GA x scope_values_width(): this micro-batch's values at `index`
};

// What a kind plans for a rank's rows before its kernels run (LossKind::plan_rows): the rank's rows, which
// of them count, and its groups for the counts that span ranks.
struct RowPlanRequest {
  const Case& c;
  const InputSource& inputs;
  const RankAssignment& assignment;
  std::span<const char> valid;  // per local row: the token counts in the loss
  RankGroups& groups;
  const BugSwitches& bugs;
};
struct KindRowPlan {
  // Each local row's weight in the logged objective where the kind aggregates tokens itself; none where
  // the case's reduction decides (docs/spec.md §5).
  std::optional<std::vector<double>> weights;
  // Per local row, what the kind's kernels read besides the logits (a policy loss's old and reference
  // log-probabilities and whitened advantage), row major; the kind defines the width.
  std::vector<float> row_inputs;
  // The step's number of sequences, for a kind whose kernels reduce per sequence (sized alike on every rank).
  std::int64_t sequences = 0;
  // weights are each rank's own means (microbatch-local-mean): the backward weight is the rank's local
  // gradient, reduced by the framework, not forward / gradient scale.
  bool rank_local_weights = false;
  // Per local row, its weight in the kind's logged token statistics where it is not 1 / N (empty: 1 / N).
  std::vector<double> statistic_weights;
  // The logged loss sums the kernels' logged_token_loss, not token_loss: a catalogued bug weighs parts of a
  // token's loss apart (the policy kind's aux-term bugs), while each token's own loss stays the objective's.
  bool separate_logged_loss = false;
};

class LossKind {
 public:
  virtual ~LossKind() = default;
  // loss.kind in a case file, and what the kind is in a line for `lossverify list` (its settings come from settings()).
  virtual std::string_view name() const = 0;
  virtual std::string_view summary() const = 0;

  // The case section: the kind's settings table (kind_api/settings.hpp), from which lossverify reads, checks,
  // writes back, shrinks, lists and carries to plugins every key of "loss" the kind owns (another kind's key is
  // refused by name); what a table cannot say goes in parse_extra and resolve_extra (a kind that aggregates its
  // tokens itself refuses "reduction"); checks that need the whole case go in validate.
  virtual const SettingTable& settings() const {
    static const SettingTable none;
    return none;
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    for (const Setting& s : settings()) out.push_back(s.key);
    return out;
  }
  virtual void parse_extra(detail::ObjectReader& loss, LossSpec& spec) const { (void)loss, (void)spec; }
  virtual void resolve_extra(const LossSpec& spec, nlohmann::json& loss) const { (void)spec, (void)loss; }
  virtual void validate(const Case& c) const { (void)c; }
  // A case written by foreign code (a dump's manifest): the settings it must state because a default would
  // decide the verdict. `loss` is the raw "loss" object (null when absent); throws CaseError.
  virtual void require_explicit(const LossSpec& spec, const nlohmann::json& loss, const std::string& source) const {
    (void)spec, (void)loss, (void)source;
  }

  virtual KindInputs inputs() const = 0;
  // Whether TP splits a row's columns (the vocabulary), as for every softmax over a vocabulary; false for a kind
  // whose rows are whole on every rank (a router's experts), where TP replicates tokens or, under layout.sp,
  // splits them (case.hpp: tp_splits_columns).
  virtual bool columns_split_by_tp() const { return true; }
  // Whether a backend may run a micro-batch in consecutive pieces of its rows, each row's outputs depending on its
  // row and the plan alone (a stage then makes the logits a chunk at a time, kind_api/cuda_stage.hpp); false: a
  // whole micro-batch per call.
  virtual bool rows_independent() const { return false; }
  // Whether its CUDA kernels may write the gradient over the logits they read: each element read before it is
  // written, by the same thread, and every row of a micro-batch written (a masked row zeroed). A stage then holds one
  // chunk of logits, not two buffers.
  virtual bool gradient_in_place() const { return false; }
  // The name of a row's columns in the case's "shape" ("vocab"; a router's "experts").
  virtual std::string_view column_axis() const { return "vocab"; }
  // The inputs' distribution where a case names none (a router's logits are `separated`: a clear top-k margin).
  virtual LogitDistribution default_logit_distribution() const { return LogitDistribution::normal; }
  // How many blocks of the axis's width a row holds side by side (a router's layers: its rows are [layers x
  // experts]); the case's shape.vocab is the row's width, shape.<column_axis> times this.
  virtual std::int64_t row_blocks(const LossSpec& spec) const {
    (void)spec;
    return 1;
  }
  // The layouts a sweep's invariance check compares with one another: those of one class (a router's losses are
  // over its micro-batches' scopes, so only layouts that split the batch alike agree); one class by default.
  virtual std::string invariance_class(const LayoutSpec& layout) const {
    (void)layout;
    return {};
  }
  virtual std::string_view invariance_rule() const { return "every layout"; }
  // Whether the losses are over micro-batches (a router's scopes): which micro-batch holds a token changes the
  // reference, so a dump must batch the sequences as the case's batch does.
  virtual bool scopes_are_micro_batches() const { return false; }
  // Whether the framework divides every gradient by the step's valid tokens after its reduction (Megatron's
  // per-token loss mode): the effective gradient is then the local one times gradient_scale / N
  // (effective_gradient_scale below).
  virtual bool divides_by_step_tokens(const LossSpec& spec) const {
    (void)spec;
    return false;
  }
  // Per-token float inputs the kind reads besides the logits and labels (a policy loss's old and reference
  // log-probabilities and advantages), by their names in exports and dumps; empty: none. A token's values in
  // that order come from the inputs: generated, or a dump's own (ExplicitInputs::token_inputs); 0 on padding.
  virtual std::vector<std::string> token_inputs(const LossSpec& spec) const {
    (void)spec;
    return {};
  }
  virtual void token_input_values(const Case& c, const InputSource& inputs, std::int64_t token,
                                  std::span<float> out) const {
    (void)c, (void)inputs, (void)token, (void)out;
  }
  // What the dump format (export-inputs, check-dump and the Python package over them) cannot carry of this
  // kind yet, in words; empty when it carries everything. Those paths refuse such a kind (exit 2).
  virtual std::string dump_gap() const { return {}; }
  // The token scale of tolerances (docs/spec.md §6): a loss's and a gradient's factor beyond the token's
  // weight in L (KD: T^s and T^(s-1)).
  virtual double loss_scale(const LossSpec& spec) const {
    (void)spec;
    return 1.0;
  }
  virtual double grad_scale(const LossSpec& spec) const {
    (void)spec;
    return 1.0;
  }
  // The 16-bit control (compute_in_input_dtype): whether a kernel computing in the logits' 16-bit dtype logs
  // its loss in that dtype, as PyTorch's reductions of 16-bit tensors return it; false where the objective's
  // float32 inputs promote it (a policy loss).
  virtual bool logs_loss_in_input_dtype() const { return true; }
  // The kind's plan of a rank's rows (collective over the request's groups; every rank calls it once).
  virtual KindRowPlan plan_rows(const RowPlanRequest& request) const {
    (void)request;
    return {};
  }
  // Per-token quantities a rank reports beside its loss (judged token by token, each as its own check), and
  // statistics it logs (judged in the "stats" check against the reference's mean over valid tokens).
  virtual std::vector<std::string> token_quantities() const { return {}; }
  virtual std::vector<std::string> logged_statistics(const LossSpec& spec) const {
    (void)spec;
    return {};
  }
  // Values a rank reports per micro-batch scope, one per column of a row, as it holds them after the scope's
  // collectives (a router's count per expert of each layer: what a trainer logs as tokens per expert), judged element
  // by element in a check of this name against KindReference::scope_values; empty: none.
  virtual std::string_view scope_values_name() const { return {}; }
  std::int64_t scope_values_width(const Case& c) const;  // the row's width, or 0 without scope values

  // The row-sum invariant in words, and why it does not apply to a case (empty where it does).
  virtual std::string row_sum_rule() const = 0;
  virtual std::string row_sum_exemption(const LossSpec& spec) const {
    (void)spec;
    return {};
  }

  // The catalogued bugs of this kind's own arithmetic (docs/catalogue.md); their `applies` names the kind.
  virtual std::vector<Implementation> catalogue() const;

  virtual std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const = 0;
  // Whether its reference bounds the loss and gradient under an error in the logits (KindReference::
  // loss_under_logit_error): what a stage that computes the logits (the LM head) needs in front of it.
  virtual bool models_logit_error() const { return false; }
  // The GPU oracle's row model; none where its kernels cannot evaluate this kind (the host oracle judges).
  virtual std::optional<DeviceRowModel> device_row_model(const Case& c) const {
    (void)c;
    return std::nullopt;
  }

  // The columns a rank's kernel rows hold: its own shard, unless a catalogued bug gathers more.
  virtual VocabRange kernel_columns(const BugSwitches& bugs, VocabRange own, std::int64_t vocab) const {
    (void)bugs, (void)vocab;
    return own;
  }
  virtual void cpu_micro_batch(const CpuMicroBatch& batch) const = 0;

  // The C ABI's lv_loss_kind of this kind (include/lossverify/plugin.h); none: plugins cannot compute it.
  virtual std::optional<int> plugin_kind() const { return std::nullopt; }
  // The kind's own settings in the ABI's lv_rank_inputs (its loss, policy, policy_ratio), beyond the shared
  // fields the plugin backend fills; the plugin backend also reads them to see which capability bits a case needs.
  virtual void plugin_settings(const LossSpec& spec, lv_rank_inputs& settings) const { (void)spec, (void)settings; }
};

// The factor that turns a rank's local gradient into the effective one (docs/spec.md §5): the framework's reduction,
// and the division by the step's valid tokens where the kind's case says the framework makes it.
double effective_gradient_scale(const Case& c, std::int64_t step_valid_tokens);

}  // namespace lossverify
