#pragma once
// The case file: one scenario (loss, shape, inputs, rank layout, tolerances) as a validated value.
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/core/dtype.hpp"
#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/kind_api/settings.hpp"

namespace lossverify {

class LossKind;  // kinds/loss_kind.hpp
class Stage;     // kind_api/stage.hpp
const LossKind& default_loss_kind();

enum class Reduction { mean, sum, none };

std::string_view to_string(const LossKind*);
std::string_view to_string(Reduction);
std::string_view to_string(LogitDistribution);

// Upstream gradient weights g_t of reduction "none": ones, an explicit list, or drawn uniformly.
struct UpstreamWeights {
  enum class Kind { ones, explicit_list, uniform } kind = Kind::ones;
  std::vector<double> values;  // explicit_list
  double low = 1.0;            // uniform
  double high = 1.0;
};

struct LossSpec {
  const LossKind* kind = &default_loss_kind();  // kinds/registry.hpp; never null
  // Labelled kinds: the label that masks a token.
  std::int64_t ignore_index = -100;
  // Every kind.
  Reduction reduction = Reduction::mean;
  UpstreamWeights upstream_weights;
  // The kind's own settings, as its table (LossKind::settings) reads them; only that kind reads them
  // (case/kind_settings.hpp: options_of).
  std::shared_ptr<const KindOptions> options;
  // A stage in front of the kind that makes its logits (the case's "stage" section); null: the logits are the
  // inputs.
  const Stage* stage = nullptr;
  // The stage's own settings, as its table (Stage::settings) reads them from the "stage" section.
  std::shared_ptr<const KindOptions> stage_options;
};
// The case's kind, for the registry's interface (kinds/loss_kind.hpp).
inline const LossKind& kind_of(const LossSpec& loss) { return *loss.kind; }

struct ShapeSpec {
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;  // a row's columns; the case names them after the kind's axis (LossKind::column_axis)
};
inline constexpr std::int64_t kMaxTokens = std::int64_t{1} << 40;

// The value ranges in which the tool is exact (docs/cases.md): the correct implementation passes at each
// edge, and values beyond are refused (exit 2).
inline constexpr double kMaxLogit = 1e6;          // |generated or written logit|
inline constexpr double kMaxScaledLogit = 200.0;  // kd: |logit| / temperature
inline constexpr double kMaxTemperature = 1e6;
inline constexpr double kMinSoftcap = 1e-6, kMaxSoftcap = 1e6;
inline constexpr double kMaxZLossWeight = 10.0;
inline constexpr double kMaxUpstreamWeight = 1e6;  // and half the dtype's largest value
inline constexpr double kMaxTokenInput = 1e4;      // |a kind's per-token input| in an override
// How far generated logits reach: no logit of a Philox stream with this mean and scale lies further out.
inline double generated_reach(double mean, double scale) { return std::fabs(mean) + 9.0 * scale; }

// A hand-written row: replaces the generated logits (and optionally the label) of one token.
struct RowOverride {
  std::int64_t token = 0;
  std::vector<double> logits;  // empty: keep the generated row
  std::optional<std::int64_t> label;
  // The kind's per-token inputs set by name (the kind's token_inputs(): a policy loss's old_logprob...).
  std::map<std::string, double> token_inputs;
};

// Teacher logits of a kind that reads them (KD): their own Philox stream, or exactly the student's (KL = 0).
struct TeacherSpec {
  double mean = 0.0;
  double scale = 1.0;
  bool same_as_student = false;
};

struct InputSpec {
  std::uint64_t seed = 0;
  DType dtype = DType::fp32;
  LogitDistribution distribution = LogitDistribution::normal;
  double mean = 0.0;
  double scale = 1.0;
  double ignore_fraction = 0.0;
  std::vector<RowOverride> overrides;
  TeacherSpec teacher;
};

// The global batch as packed sequences, independent of any rank layout. Sequence i goes to DP rank
// i mod DP, micro-batch floor(i / DP) mod GA ("round_robin") or to contiguous groups ("contiguous").
struct BatchSpec {
  enum class Placement { round_robin, contiguous };
  enum class Labels { independent, next_token };
  std::vector<std::int64_t> sequence_lengths;  // one sequence of all tokens when absent
  Placement placement = Placement::round_robin;
  Labels labels = Labels::independent;  // next_token: label[i] = token[i + 1], last position masked
};

struct LayoutSpec {
  int tp = 1;  // tensor parallel: splits the vocabulary, or, for a kind whose rows are whole, replicates tokens
  int cp = 1;  // context parallel: zigzag chunks of every sequence
  int dp = 1;  // data parallel: disjoint sequences
  int ga = 1;  // gradient-accumulation micro-batches per DP rank
  // Sequence parallelism: TP splits each micro-batch's rows of a kind whose rows are whole on every rank
  // (LossKind::columns_split_by_tp false) into TP contiguous parts, instead of replicating them.
  bool sp = false;
  int world_size() const { return tp * cp * dp; }
};

// How the framework combines what the ranks compute (docs/spec.md §5).
struct FrameworkSpec {
  enum class GradReduce { avg, sum };  // over the DP x CP group
  enum class GaReduce { sum, mean };   // over micro-batches
  GradReduce grad_reduce = GradReduce::avg;
  GaReduce ga_reduce = GaReduce::sum;
  // The effective gradient is the local gradient times this factor.
  double gradient_scale(const LayoutSpec& layout) const {
    double f = grad_reduce == GradReduce::avg ? 1.0 / (layout.dp * layout.cp) : 1.0;
    if (ga_reduce == GaReduce::mean) f /= layout.ga;
    return f;
  }
};

// Layouts the gate (and `run --sweep`) runs this case at, besides its own: the cartesian product.
struct SweepSpec {
  std::vector<int> tp, cp, dp, ga;
  std::vector<int> sp;  // 0 and/or 1: layout.sp off and on (a kind whose rows are whole only)
  bool empty() const { return tp.empty() && cp.empty() && dp.empty() && ga.empty() && sp.empty(); }
};

// One tolerance: an element passes when |got - expected| <= atol * |token scale| + rtol * |expected|, or,
// when max_ulp > 0, when got is within max_ulp units in the last place of round(expected) in the output
// dtype (the token scale is the token's weight in L, times T^(s-1) or T^s for KD gradients or losses).
struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
  int max_ulp = 0;
};

struct Case {
  std::string name;
  std::string description;
  std::string source;  // file the case was read from ("<inline>" otherwise)
  LossSpec loss;
  ShapeSpec shape;
  InputSpec inputs;
  BatchSpec batch;
  LayoutSpec layout;
  FrameworkSpec framework;
  SweepSpec sweep;
  std::map<std::string, Tolerance> tolerance_overrides;  // keyed by quantity name (see tolerances.hpp)
  double timeout_seconds = 120.0;

  // The case with every default filled in, as JSON (what the report records and replay reads).
  nlohmann::json resolved() const;
};

std::string_view to_string(FrameworkSpec::GradReduce);
std::string_view to_string(FrameworkSpec::GaReduce);
std::string_view to_string(BatchSpec::Placement);
std::string_view to_string(BatchSpec::Labels);

// Parse and validate. Errors throw CaseError naming the source and the JSON path, e.g.
//   cases/x.json: $.loss.label_smoothing: must be in [0, 1), got 1.5
Case parse_case(const nlohmann::json& document, const std::string& source);
Case load_case_file(const std::string& path, const std::vector<std::string>& set_overrides = {});
// The parser's cross-field checks again, for a case built or changed in code (run_case calls it): a
// shape that no longer matches the parsed batch, an override outside it, a TP wider than the vocabulary.
// Throws CaseError naming the JSON path.
void check_case(const Case& c);

// How TP treats a case's rows (docs/spec.md §4): it splits their columns (the vocabulary) unless the case's kind keeps
// rows whole on every rank; then it replicates the tokens over TP, or splits them under layout.sp.
bool tp_splits_columns(const Case& c);
// Whether layout.sp means something for the case: its kind's rows are whole on every rank (SP splits them), or a
// stage in front takes the tokens sharded over TP (an LM head gathers h and reduce-scatters dh); and the refusal's
// words where not.
bool sequence_parallel_applies(const Case& c);
std::string sequence_parallel_refusal(const Case& c);
// How many TP ranks hold each token: TP for whole rows without SP, else 1.
int token_replicas(const Case& c);

// All layouts of a sweep (the case's own when the sweep is empty), in a fixed order.
std::vector<LayoutSpec> sweep_layouts(const Case& c);
// Parses "tp=1,2,4 cp=1,2" style arguments (one dimension per string).
SweepSpec parse_sweep_arguments(const std::vector<std::string>& arguments);

// Apply one "dotted.key=value" override to a raw case document (value parsed as JSON, else a string).
void apply_set_override(nlohmann::json& document, const std::string& assignment, const std::string& source);

}  // namespace lossverify
