#pragma once
// The case file: one scenario (loss, shape, inputs, rank layout, tolerances) as a validated value.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/core/dtype.hpp"
#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/math/cross_entropy_math.hpp"

namespace lossverify {

std::string_view to_string(LossKind);
std::string_view to_string(SmoothingConvention);
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
  LossKind kind = LossKind::cross_entropy;
  double label_smoothing = 0.0;
  SmoothingConvention convention = SmoothingConvention::pytorch;
  double z_loss_weight = 0.0;
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
  UpstreamWeights upstream_weights;
};

struct ShapeSpec {
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
};

// A hand-written row: replaces the generated logits (and optionally the label) of one token.
struct RowOverride {
  std::int64_t token = 0;
  std::vector<double> logits;  // empty: keep the generated row
  std::optional<std::int64_t> label;
};

struct InputSpec {
  std::uint64_t seed = 0;
  DType dtype = DType::fp32;
  LogitDistribution distribution = LogitDistribution::normal;
  double mean = 0.0;
  double scale = 1.0;
  double ignore_fraction = 0.0;
  std::vector<RowOverride> overrides;
};

struct LayoutSpec {
  int tp = 1;
  int world_size() const { return tp; }
};

// One tolerance: an element passes when |got - expected| <= atol * |token weight| + rtol * |expected|.
struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
};

struct Case {
  std::string name;
  std::string description;
  std::string source;  // file the case was read from ("<inline>" otherwise)
  LossSpec loss;
  ShapeSpec shape;
  InputSpec inputs;
  LayoutSpec layout;
  std::map<std::string, Tolerance> tolerance_overrides;  // keyed by quantity name (see tolerances.hpp)
  double timeout_seconds = 120.0;

  // The case with every default filled in, as JSON (what the report records and replay reads).
  nlohmann::json resolved() const;
};

// Parse and validate. Errors throw CaseError naming the source and the JSON path, e.g.
//   cases/x.json: $.loss.label_smoothing: must be in [0, 1), got 1.5
Case parse_case(const nlohmann::json& document, const std::string& source);
Case load_case_file(const std::string& path, const std::vector<std::string>& set_overrides = {});

// Apply one "dotted.key=value" override to a raw case document (value parsed as JSON, else a string).
void apply_set_override(nlohmann::json& document, const std::string& assignment, const std::string& source);

}  // namespace lossverify
