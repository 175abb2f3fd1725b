#pragma once
// A stage in front of a loss kind (docs/development.md, "Stages"): each rank's logits come out of the stage, and the
// kind's gradient of them goes back through it into gradients of the stage's own inputs, which ranks report and the
// oracle judges beside the kind's checks, one check per gradient. The LM head (h, W -> logits; g -> dh, dW) is one;
// tests/kinds/pass_through/ is the least one. A case names its stage in a "stage" section ({"kind": NAME});
// a stage runs on the CPU backend, on the CUDA backend where it has a part there (kind_api/cuda_stage.hpp), and through
// a native plugin that declares the stage's capability; the host oracle judges it. A dump of a staged case carries the
// stage's inputs (Stage::inputs) and gradients, each under the gradient's check name.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/kind_api/settings.hpp"
#include "lossverify/layout/vocab_range.hpp"

struct lv_rank_inputs;  // include/lossverify/plugin.h

namespace lossverify {

struct Case;
struct Implementation;
struct BugSwitches;
struct RankAssignment;
struct RankGroups;
class InputSource;
enum class InputStream : std::uint32_t;  // inputs/philox_stream.hpp

// One of a stage's own inputs (an LM head's h, W, b), as `export-inputs` writes it and a dump carries it
// (docs/dumps.md): its tensor name, the Philox stream it comes from (InputSource::stage_values, the stream's row and
// columns), how its rows are laid out and their width. A dump's tensor of it is read in place of the stream.
struct StageInput {
  enum class Rows {
    token,       // a row per token (N x width): a rank holds its rows, in its row order
    column,      // a row per vocabulary column (V x width): a rank holds its columns' rows
    vocabulary,  // one row of V values (the stream's row 0): a rank holds its columns
  };
  std::string name;
  InputStream stream{};
  Rows rows = Rows::token;
  std::int64_t width = 0;  // values per row; V for Rows::vocabulary
  double scale = 1.0;      // the stream's standard deviation
};

// The float64 reference of the stage, from its definition: each gradient's expected row of a token from the kind's
// reference gradient of the token's whole row of logits (`row_grad`, columns [0, V)) and, per column, how far a
// correct implementation's gradient of the logits may lie from it (`row_grad_error`: the kind's tolerance, one
// rounding to the dtype, and where the stage makes the logits their error through the kind's model). `rank` is the
// rank's columns.
class StageReference {
 public:
  virtual ~StageReference() = default;
  // `bound` (same size as `out`, zero on entry) receives how far a correct implementation's element may lie from
  // `out` beyond one rounding of its output (the stage's error model), added to the element's tolerance.
  virtual void input_gradient(std::size_t which, std::int64_t token, VocabRange rank, std::span<const double> row_grad,
                              std::span<const double> row_grad_error, std::span<double> out,
                              std::span<double> bound) const = 0;
  // A stage that computes the logits: the kind's reference reads them in float64 from here (exactly, from the
  // stage's inputs), and `error` bounds how far a correct implementation's logits may lie from them, per column.
  // false: the rank's generated rows are the logits (the stage reads them as they are).
  virtual bool makes_logits() const { return false; }
  virtual void logits(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const {
    (void)token, (void)begin, (void)end, (void)out;
  }
  virtual void logit_error(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const {
    (void)token, (void)begin, (void)end, (void)out;
  }
  // The largest of a token's logit errors over its whole row.
  virtual double largest_logit_error(std::int64_t token) const {
    (void)token;
    return 0.0;
  }
  // A stage's parameter gradients (Stage::parameters): token `token`'s contribution over the rank's columns to each
  // expected element of parameter `which` (rows x columns of Stage::parameter_shape, row major: added to `sum`) and to
  // its bound (`bound`), from the reference's logit gradient of that token (`logit_grad`) and its bound from the
  // logits' error (`grad_error`).
  virtual void accumulate_parameter(std::size_t which, std::int64_t token, std::int64_t begin,
                                    std::span<const double> logit_grad, std::span<const double> grad_error,
                                    std::span<double> sum, std::span<double> bound) const {
    (void)which, (void)token, (void)begin, (void)logit_grad, (void)grad_error, (void)sum, (void)bound;
  }
};

// A stage's logits in float64, row by row, from the case and the stage's own inputs alone (a pure function of the
// case and the token, as a case's generated logits are), and each column's bound on how far a correct implementation's
// may lie from them (StageReference::logit_error's model): what a kind reads where it places its token inputs relative
// to the logits (a policy loss's old log-probabilities) or bounds its own quantities under the stage's error. Built
// once (it holds the stage's weights), each row costs the stage's product for one token (an LM head's V x H).
class StageLogits {
 public:
  virtual ~StageLogits() = default;
  // The token's whole row, columns [0, V); `error` empty, or V wide for each column's bound.
  virtual void row(std::int64_t token, std::span<double> out, std::span<double> error) const = 0;
};

// One rank's stage work on the CPU backend, over all of its rows: `logits` (rows x columns.size(), the dtype's
// elements) are what the kind will read; `logit_grad` (same shape) is what the kind wrote, and `gradients[w]` the
// stage's gradient `w` to fill (Stage::gradient_rows x gradient_columns, in the dtype), once the kind is done;
// `parameters[p]` its parameter gradient `p` (Stage::parameter_shape, in the dtype). `inputs` generate the stage's own
// inputs; the collectives run over `groups`.
struct StageRank {
  const Case& c;
  const BugSwitches& bugs;
  const RankAssignment& assignment;
  DType dtype = DType::fp32;
  VocabRange columns;
  std::byte* logits = nullptr;
  const std::byte* logit_grad = nullptr;
  std::vector<std::vector<std::byte>>& gradients;
  std::vector<std::vector<std::byte>>& parameters;
  const InputSource& inputs;
  RankGroups& groups;
  // Backward only: each row's weight of the kind's gradient (the framework's scale of the local gradient,
  // RowPlan::backward_weight), for a fused stage that forms part of that gradient itself; empty in the forward.
  std::span<const float> row_weights = {};
};

// A parameter gradient's shape on one rank (its shard of a weight: rows x columns).
struct ParameterShape {
  std::int64_t rows = 0, columns = 0;
};

class Stage {
 public:
  virtual ~Stage() = default;
  virtual std::string_view name() const = 0;
  virtual std::string_view summary() const = 0;
  // Its keys of the case's "stage" section (kind_api/settings.hpp, bound to LossSpec::stage_options); none by default.
  virtual const SettingTable& settings() const;
  // Cross-field checks of the whole case, after every section is read (exit 2 naming the field).
  virtual void validate(const Case& c) const { (void)c; }
  // The gradients of its inputs that ranks report, each judged as a check of that name ("dh"), and a row's width
  // of each on a rank.
  virtual std::vector<std::string> gradients() const = 0;
  // Its own inputs, in the order a dump lists them; none by default (a stage whose input is the generated logits).
  virtual std::vector<StageInput> inputs(const Case& c) const {
    (void)c;
    return {};
  }
  virtual std::int64_t gradient_columns(std::size_t which, const Case& c, const RankAssignment& assignment) const = 0;
  // Whether the stage takes layout.sp in front of a kind whose columns TP splits: its inputs arrive token-sharded over
  // TP (gathered before it) and its input gradients leave reduce-scattered, each TP rank with its own token shard's.
  virtual bool takes_sequence_parallel() const { return false; }
  // The rank's rows (indices into assignment.rows, in order) whose input gradients it reports, each gradient's rows in
  // that order; all of them by default.
  virtual std::vector<std::int64_t> gradient_rows(const Case& c, const RankAssignment& assignment) const;
  // Before the kind's micro-batches: the rank's logits from the stage's inputs (in place: the rank's generated
  // rows are the stage's input). After them: the stage's gradients from the kind's.
  virtual void cpu_forward(const StageRank& rank) const = 0;
  virtual void cpu_backward(const StageRank& rank) const = 0;
  virtual std::unique_ptr<StageReference> reference(const Case& c, const InputSource& inputs) const = 0;
  // A stage that makes the logits: its float64 logits row by row (StageLogits); none for one that does not.
  virtual std::unique_ptr<StageLogits> float64_logits(const Case& c, const InputSource& inputs) const {
    (void)c, (void)inputs;
    return nullptr;
  }
  // The bytes its float64 reference holds (each rank's oracle holds one), for the run's memory estimate.
  virtual std::int64_t reference_bytes(const Case& c) const {
    (void)c;
    return 0;
  }
  // Gradients of the stage's parameters, one block per rank (a weight's shard, accumulated over the rank's tokens
  // and micro-batches), each judged as a check of that name ("dW") against the float64 sum over the rank's tokens.
  virtual std::vector<std::string> parameters() const { return {}; }
  virtual ParameterShape parameter_shape(std::size_t which, const Case& c, const RankAssignment& assignment) const {
    (void)which, (void)c, (void)assignment;
    return {};
  }
  // A catalogued bug of a fused stage that runs its kind under other settings than the case's (label smoothing never
  // passed through the fused path): the kind's keys and the values the kind's kernels then read. None by default.
  virtual std::vector<std::pair<std::string, nlohmann::json>> kind_settings_under(const BugSwitches& bugs) const {
    (void)bugs;
    return {};
  }
  // How many of a rank's rows (of `rank_rows`) a backend that makes the logits a chunk at a time (CUDA) makes at once.
  virtual std::int64_t chunk_rows(const Case& c, std::int64_t rank_rows) const {
    (void)c;
    return rank_rows;
  }
  // Whether the kind's gradient of the logits stays inside the stage (a fused head never hands it out): its grad
  // and row_sum checks are then not applicable, and the stage's gradients judge it.
  virtual bool logit_gradient_internal() const { return false; }
  // The stage's own input row of a token (an LM head's h_t), which a reproducer bundle records and checks against
  // the generator: its width (0: none; the logits are then the inputs that matter) and its values in the dtype.
  virtual std::int64_t token_input_width(const Case& c) const {
    (void)c;
    return 0;
  }
  virtual void token_input(const Case& c, const InputSource& inputs, std::int64_t token, double* out) const {
    (void)c, (void)inputs, (void)token, (void)out;
  }
  // A stage a native plugin computes (include/lossverify/plugin.h): the capability bit a plugin sets in
  // lv_plugin.losses to be handed cases with the stage, and its name for messages; 0: no plugin computes it.
  virtual std::uint32_t plugin_capability() const { return 0; }
  virtual std::string_view plugin_capability_name() const { return ""; }
  // Whether its capability bit covers the stage in front of the loss kind `kind` (a bit defined before a kind could
  // stand behind the stage does not promise it): true by default.
  virtual bool plugin_capability_covers(std::string_view kind) const {
    (void)kind;
    return true;
  }
  // Its fields of the rank's lv_rank_inputs, and the rank's stage inputs in the case's dtype, in the order of the
  // ABI's stage inputs (the LM head: h of the rank's rows, W_r, b_r). Each rank's inputs generated from the case's
  // Philox streams, never read back from the oracle's.
  virtual void plugin_settings(const Case& c, const RankAssignment& assignment, lv_rank_inputs& settings) const {
    (void)c, (void)assignment, (void)settings;
  }
  virtual std::vector<std::vector<std::byte>> plugin_inputs(const Case& c, const InputSource& inputs,
                                                            const RankAssignment& assignment) const {
    (void)c, (void)inputs, (void)assignment;
    return {};
  }
  // The catalogued bugs of the stage's own arithmetic (their `applies` names the stage; their switches are
  // BugSwitches::stage_switches).
  virtual std::vector<Implementation> catalogue() const;
};

}  // namespace lossverify
