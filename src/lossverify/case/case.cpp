#include "lossverify/case/case.hpp"
#include "lossverify/core/strings.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "lossverify/case/json_reader.hpp"
#include "lossverify/checks/tolerances.hpp"
#include "lossverify/core/errors.hpp"

namespace lossverify {

using detail::fail_at;
using detail::ObjectReader;
using nlohmann::json;

std::string_view to_string(LossKind) { return "cross_entropy"; }
std::string_view to_string(SmoothingConvention c) {
  return c == SmoothingConvention::pytorch ? "pytorch" : "megatron";
}
std::string_view to_string(Reduction r) {
  switch (r) {
    case Reduction::mean:
      return "mean";
    case Reduction::sum:
      return "sum";
    case Reduction::none:
      return "none";
  }
  return "?";
}
std::string_view to_string(LogitDistribution d) { return d == LogitDistribution::normal ? "normal" : "uniform"; }

namespace {

template <class Enum, std::size_t N>
Enum parse_choice(ObjectReader& reader, const std::string& key, const std::array<Enum, N>& choices,
                  Enum fallback) {
  if (!reader.has(key)) {
    reader.allow(key);
    return fallback;
  }
  const std::string value = reader.string(key);
  std::string allowed;
  for (Enum e : choices) {
    if (to_string(e) == value) return e;
    append_to_list(allowed, to_string(e), "|");
  }
  reader.fail(key, "expected one of " + allowed + ", got \"" + value + "\"");
}

void parse_loss(ObjectReader r, Case& c) {
  LossSpec& loss = c.loss;
  const std::string kind = r.string("kind", "cross_entropy");
  if (kind != "cross_entropy") r.fail("kind", "expected cross_entropy, got \"" + kind + "\"");
  loss.label_smoothing = r.number("label_smoothing", 0.0);
  if (!(loss.label_smoothing >= 0.0 && loss.label_smoothing < 1.0)) {
    r.fail("label_smoothing", "must be in [0, 1), got " + json(loss.label_smoothing).dump());
  }
  loss.convention = parse_choice(r, "smoothing_convention",
                                 std::array{SmoothingConvention::pytorch, SmoothingConvention::megatron},
                                 SmoothingConvention::pytorch);
  loss.z_loss_weight = r.number("z_loss_weight", 0.0);
  if (loss.z_loss_weight < 0.0) {
    r.fail("z_loss_weight", "must be >= 0, got " + json(loss.z_loss_weight).dump());
  }
  loss.ignore_index = r.integer("ignore_index", -100);
  loss.reduction = parse_choice(r, "reduction", std::array{Reduction::mean, Reduction::sum, Reduction::none},
                                Reduction::mean);
  if (r.has("upstream_weights")) {
    const json& u = r.raw("upstream_weights");
    const std::string path = r.path_of("upstream_weights");
    if (loss.reduction != Reduction::none) {
      fail_at(r.source(), path, "upstream weights apply to reduction \"none\" only");
    }
    if (u.is_array()) {
      loss.upstream_weights.kind = UpstreamWeights::Kind::explicit_list;
      for (std::size_t i = 0; i < u.size(); ++i) {
        loss.upstream_weights.values.push_back(
            detail::as_number(u[i], path + "[" + std::to_string(i) + "]", r.source()));
      }
    } else {
      ObjectReader w(u, path, r.source());
      const std::string dist = w.string("distribution");
      if (dist != "uniform") w.fail("distribution", "expected uniform, got \"" + dist + "\"");
      loss.upstream_weights.kind = UpstreamWeights::Kind::uniform;
      loss.upstream_weights.low = w.number("low");
      loss.upstream_weights.high = w.number("high");
      if (!(loss.upstream_weights.low <= loss.upstream_weights.high)) w.fail("high", "must be >= low");
      w.reject_unknown_keys();
    }
  } else {
    r.allow("upstream_weights");
  }
  r.reject_unknown_keys();
}

void parse_shape(ObjectReader r, Case& c) {
  c.shape.tokens = r.integer("tokens");
  c.shape.vocab = r.integer("vocab");
  if (c.shape.tokens < 1) r.fail("tokens", "must be >= 1, got " + std::to_string(c.shape.tokens));
  if (c.shape.vocab < 2) r.fail("vocab", "must be >= 2, got " + std::to_string(c.shape.vocab));
  if (c.shape.vocab > (std::int64_t{1} << 32)) r.fail("vocab", "must be <= 2^32");
  r.reject_unknown_keys();
}

void parse_inputs(ObjectReader r, Case& c) {
  InputSpec& in = c.inputs;
  const std::int64_t seed = r.integer("seed", 0);
  if (seed < 0) r.fail("seed", "must be >= 0");
  in.seed = static_cast<std::uint64_t>(seed);
  const std::string dtype = r.string("dtype", "fp32");
  const auto parsed = parse_dtype(dtype);
  if (!parsed) r.fail("dtype", "expected one of fp32|bf16|fp16, got \"" + dtype + "\"");
  in.dtype = *parsed;
  in.distribution = parse_choice(r, "distribution",
                                 std::array{LogitDistribution::normal, LogitDistribution::uniform},
                                 LogitDistribution::normal);
  in.mean = r.number("mean", 0.0);
  in.scale = r.number("scale", 1.0);
  if (!(in.scale >= 0.0)) r.fail("scale", "must be >= 0");
  in.ignore_fraction = r.number("ignore_fraction", 0.0);
  if (!(in.ignore_fraction >= 0.0 && in.ignore_fraction <= 1.0)) {
    r.fail("ignore_fraction", "must be in [0, 1], got " + json(in.ignore_fraction).dump());
  }
  if (r.has("overrides")) {
    const json& list = r.raw("overrides");
    const std::string path = r.path_of("overrides");
    if (!list.is_array()) fail_at(r.source(), path, "expected array, got " + detail::json_type_name(list));
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string item_path = path + "[" + std::to_string(i) + "]";
      ObjectReader o(list[i], item_path, r.source());
      RowOverride row;
      row.token = o.integer("token");
      if (o.has("logits")) {
        const json& logits = o.raw("logits");
        if (!logits.is_array()) o.fail("logits", "expected array, got " + detail::json_type_name(logits));
        for (std::size_t v = 0; v < logits.size(); ++v) {
          row.logits.push_back(
              detail::as_number(logits[v], o.path_of("logits") + "[" + std::to_string(v) + "]", r.source()));
        }
      } else {
        o.allow("logits");
      }
      if (o.has("label")) {
        row.label = o.integer("label");
      } else {
        o.allow("label");
      }
      o.reject_unknown_keys();
      in.overrides.push_back(std::move(row));
    }
  } else {
    r.allow("overrides");
  }
  r.reject_unknown_keys();
}

void parse_layout(ObjectReader r, Case& c) {
  for (const char* later : {"cp", "dp", "ga"}) {
    if (r.has(later)) {
      r.fail(later, std::string("the ") + later + " dimension is not supported by this version (tp only)");
    }
  }
  const std::int64_t tp = r.integer("tp", 1);
  if (tp < 1) r.fail("tp", "must be >= 1, got " + std::to_string(tp));
  if (tp > 4096) r.fail("tp", "must be <= 4096, got " + std::to_string(tp));
  c.layout.tp = static_cast<int>(tp);
  r.reject_unknown_keys();
}

void parse_tolerances(ObjectReader r, Case& c) {
  for (std::string_view quantity : kToleranceQuantities) {
    const std::string key(quantity);
    if (!r.has(key)) {
      r.allow(key);
      continue;
    }
    ObjectReader t = r.object(key);
    Tolerance tol = default_tolerance(quantity, c.inputs.dtype).tolerance;
    tol.atol = t.number("atol", tol.atol);
    tol.rtol = t.number("rtol", tol.rtol);
    if (tol.atol < 0.0) t.fail("atol", "must be >= 0");
    if (tol.rtol < 0.0) t.fail("rtol", "must be >= 0");
    t.reject_unknown_keys();
    c.tolerance_overrides[key] = tol;
  }
  r.reject_unknown_keys();
}

// Cross-field checks that need the whole case.
void validate_consistency(Case& c) {
  const std::string& src = c.source;
  const std::int64_t n = c.shape.tokens;
  const std::int64_t v = c.shape.vocab;
  if (c.layout.tp > v) {
    fail_at(src, "$.layout.tp",
            "tp = " + std::to_string(c.layout.tp) + " exceeds the vocabulary size " + std::to_string(v) +
                ": every TP rank needs at least one column");
  }
  if (c.loss.ignore_index >= 0 && c.loss.ignore_index < v) {
    fail_at(src, "$.loss.ignore_index", "must lie outside [0, vocab) so it cannot collide with a real label");
  }
  if (c.loss.upstream_weights.kind == UpstreamWeights::Kind::explicit_list &&
      static_cast<std::int64_t>(c.loss.upstream_weights.values.size()) != n) {
    fail_at(src, "$.loss.upstream_weights",
            "has " + std::to_string(c.loss.upstream_weights.values.size()) + " entries, expected one per token (" +
                std::to_string(n) + ")");
  }
  std::vector<char> seen(static_cast<std::size_t>(std::min<std::int64_t>(n, 1 << 24)), 0);
  for (std::size_t i = 0; i < c.inputs.overrides.size(); ++i) {
    const RowOverride& row = c.inputs.overrides[i];
    const std::string path = "$.inputs.overrides[" + std::to_string(i) + "]";
    if (row.token < 0 || row.token >= n) {
      fail_at(src, path + ".token", "token " + std::to_string(row.token) + " outside [0, " + std::to_string(n) + ")");
    }
    if (row.token < static_cast<std::int64_t>(seen.size())) {
      if (seen[static_cast<std::size_t>(row.token)]) {
        fail_at(src, path + ".token", "token " + std::to_string(row.token) + " is overridden twice");
      }
      seen[static_cast<std::size_t>(row.token)] = 1;
    }
    if (!row.logits.empty() && static_cast<std::int64_t>(row.logits.size()) != v) {
      fail_at(src, path + ".logits",
              "row has " + std::to_string(row.logits.size()) + " logits, expected vocab = " + std::to_string(v));
    }
    for (std::size_t k = 0; k < row.logits.size(); ++k) {
      if (std::fabs(row.logits[k]) > dtype_max(c.inputs.dtype)) {
        fail_at(src, path + ".logits[" + std::to_string(k) + "]",
                json(row.logits[k]).dump() + " overflows " + std::string(to_string(c.inputs.dtype)));
      }
    }
    if (row.label && *row.label != c.loss.ignore_index && (*row.label < 0 || *row.label >= v)) {
      fail_at(src, path + ".label",
              "label " + std::to_string(*row.label) + " outside [0, " + std::to_string(v) +
                  ") and not the ignore_index " + std::to_string(c.loss.ignore_index));
    }
  }
  const double generated_bound = std::fabs(c.inputs.mean) + 9.0 * c.inputs.scale;
  if (generated_bound > dtype_max(c.inputs.dtype)) {
    fail_at(src, "$.inputs.scale", "generated logits would overflow " + std::string(to_string(c.inputs.dtype)));
  }
}

}  // namespace

Case parse_case(const json& document, const std::string& source) {
  Case c;
  c.source = source;
  ObjectReader root(document, "$", source);
  c.name = root.string("name");
  if (c.name.empty()) root.fail("name", "must not be empty");
  c.description = root.string("description", "");
  root.string("format", "lossverify.case/1");
  if (root.has("format") && root.string("format") != "lossverify.case/1") {
    root.fail("format", "unsupported format \"" + root.string("format") + "\" (this version reads lossverify.case/1)");
  }
  parse_shape(root.object("shape"), c);
  if (root.has("loss")) {
    parse_loss(root.object("loss"), c);
  } else {
    root.allow("loss");
  }
  if (root.has("inputs")) {
    parse_inputs(root.object("inputs"), c);
  } else {
    root.allow("inputs");
  }
  if (root.has("layout")) {
    parse_layout(root.object("layout"), c);
  } else {
    root.allow("layout");
  }
  if (root.has("tolerances")) {
    parse_tolerances(root.object("tolerances"), c);
  } else {
    root.allow("tolerances");
  }
  c.timeout_seconds = root.number("timeout_seconds", 120.0);
  if (!(c.timeout_seconds > 0.0)) root.fail("timeout_seconds", "must be > 0");
  root.reject_unknown_keys();
  validate_consistency(c);
  return c;
}

void apply_set_override(json& document, const std::string& assignment, const std::string& source) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw CaseError("--set " + assignment + ": expected key=value, e.g. --set loss.label_smoothing=0.1");
  }
  const std::string key = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  json value;
  try {
    value = json::parse(text);
  } catch (const json::parse_error&) {
    value = text;  // bare words such as bf16 or megatron are strings
  }
  json* node = &document;
  std::string path = "$";
  std::size_t start = 0;
  while (true) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) throw CaseError("--set " + assignment + ": empty key component");
    if (!node->is_object()) {
      throw CaseError(source + ": --set " + assignment + ": " + path + " is not an object");
    }
    path += "." + part;
    if (dot == std::string::npos) {
      (*node)[part] = value;
      return;
    }
    node = &(*node)[part];
    if (node->is_null()) *node = json::object();
    start = dot + 1;
  }
}

Case load_case_file(const std::string& path, const std::vector<std::string>& set_overrides) {
  std::ifstream in(path);
  if (!in) throw CaseError(path + ": cannot open case file");
  std::stringstream buffer;
  buffer << in.rdbuf();
  json document;
  try {
    document = json::parse(buffer.str());
  } catch (const json::parse_error& e) {
    throw CaseError(path + ": not valid JSON: " + e.what());
  }
  for (const auto& assignment : set_overrides) apply_set_override(document, assignment, path);
  return parse_case(document, path);
}

json Case::resolved() const {
  json j;
  j["format"] = "lossverify.case/1";
  j["name"] = name;
  j["description"] = description;
  j["shape"] = {{"tokens", shape.tokens}, {"vocab", shape.vocab}};
  json l = {{"kind", std::string(to_string(loss.kind))},
            {"label_smoothing", loss.label_smoothing},
            {"smoothing_convention", std::string(to_string(loss.convention))},
            {"z_loss_weight", loss.z_loss_weight},
            {"ignore_index", loss.ignore_index},
            {"reduction", std::string(to_string(loss.reduction))}};
  switch (loss.upstream_weights.kind) {
    case UpstreamWeights::Kind::ones:
      break;
    case UpstreamWeights::Kind::explicit_list:
      l["upstream_weights"] = loss.upstream_weights.values;
      break;
    case UpstreamWeights::Kind::uniform:
      l["upstream_weights"] = {
          {"distribution", "uniform"}, {"low", loss.upstream_weights.low}, {"high", loss.upstream_weights.high}};
      break;
  }
  j["loss"] = l;
  json in = {{"seed", inputs.seed},
             {"dtype", std::string(to_string(inputs.dtype))},
             {"distribution", std::string(to_string(inputs.distribution))},
             {"mean", inputs.mean},
             {"scale", inputs.scale},
             {"ignore_fraction", inputs.ignore_fraction}};
  if (!inputs.overrides.empty()) {
    json rows = json::array();
    for (const auto& row : inputs.overrides) {
      json r = {{"token", row.token}};
      if (!row.logits.empty()) r["logits"] = row.logits;
      if (row.label) r["label"] = *row.label;
      rows.push_back(r);
    }
    in["overrides"] = rows;
  }
  j["inputs"] = in;
  j["layout"] = {{"tp", layout.tp}};
  json tol = json::object();
  for (std::string_view q : kToleranceQuantities) {
    const Tolerance t = effective_tolerance(*this, q);
    tol[std::string(q)] = {{"atol", t.atol}, {"rtol", t.rtol}};
  }
  j["tolerances"] = tol;
  j["timeout_seconds"] = timeout_seconds;
  return j;
}

}  // namespace lossverify
