#include "lossverify/case/case.hpp"
#include "lossverify/core/strings.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/case/tolerances.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/kind_api/registry.hpp"

namespace lossverify {

using detail::fail_at;
using detail::ObjectReader;
using nlohmann::json;

std::string_view to_string(const LossKind* k) { return k->name(); }
std::string_view to_string(FrameworkSpec::GradReduce g) { return g == FrameworkSpec::GradReduce::avg ? "avg" : "sum"; }
std::string_view to_string(FrameworkSpec::GaReduce g) { return g == FrameworkSpec::GaReduce::sum ? "sum" : "mean"; }
std::string_view to_string(BatchSpec::Placement p) {
  return p == BatchSpec::Placement::round_robin ? "round_robin" : "contiguous";
}
std::string_view to_string(BatchSpec::Labels l) {
  return l == BatchSpec::Labels::independent ? "independent" : "next_token";
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
std::string_view to_string(LogitDistribution d) {
  return d == LogitDistribution::normal ? "normal" : d == LogitDistribution::uniform ? "uniform" : "separated";
}

namespace {

// "kind" names a registered kind (kinds/registry.hpp), which reads its own keys; a key another kind owns is
// refused by name.
const LossKind& parse_kind(ObjectReader& r) {
  if (!r.has("kind")) {
    r.allow("kind");
    return default_loss_kind();
  }
  const std::string name = r.string("kind");
  if (const LossKind* kind = find_loss_kind(name)) return *kind;
  std::string allowed;
  for (const LossKind* k : loss_kinds()) append_to_list(allowed, k->name(), "|");
  r.fail("kind", "expected one of " + allowed + ", got \"" + name + "\"");
}

void refuse_other_kinds_keys(ObjectReader& r, const LossKind& kind) {
  const std::vector<std::string> own = kind.keys();
  for (const LossKind* other : loss_kinds()) {
    if (other == &kind) continue;
    for (const std::string& key : other->keys()) {
      if (r.has(key) && std::find(own.begin(), own.end(), key) == own.end()) {
        r.fail(key, "applies to " + std::string(other->name()) + " only, not " + std::string(kind.name()));
      }
    }
  }
}

void parse_loss(ObjectReader r, Case& c) {
  LossSpec& loss = c.loss;
  const LossKind& kind = parse_kind(r);
  loss.kind = &kind;
  refuse_other_kinds_keys(r, kind);
  loss.reduction =
      parse_choice(r, "reduction", std::array{Reduction::mean, Reduction::sum, Reduction::none}, Reduction::mean);
  parse_settings(kind.settings(), r, loss);
  kind.parse_extra(r, loss);  // a kind that aggregates tokens itself sets the reduction
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

// "stage": {"kind": NAME}, a registered stage in front of the loss kind (kind_api/stage.hpp).
void parse_stage(ObjectReader r, Case& c) {
  const std::string name = r.string("kind");
  c.loss.stage = find_stage(name);
  if (c.loss.stage == nullptr) {
    std::string allowed;
    for (const Stage* s : stages()) append_to_list(allowed, s->name(), "|");
    r.fail("kind", "expected a registered stage" +
                       (allowed.empty() ? std::string(" (none is)") : " (" + allowed + ")") + ", got \"" + name + "\"");
  }
  parse_settings(c.loss.stage->settings(), r, c.loss);
  r.reject_unknown_keys();
}

void parse_shape(ObjectReader r, Case& c, bool has_batch) {
  c.shape.tokens = has_batch ? r.integer("tokens", 0) : r.integer("tokens");
  if (has_batch && c.shape.tokens == 0) c.shape.tokens = 1;  // checked against the sequences later
  const std::string axis(kind_of(c.loss).column_axis());
  const std::int64_t width = r.integer(axis);
  if (c.shape.tokens < 1) r.fail("tokens", "must be >= 1, got " + std::to_string(c.shape.tokens));
  if (width < 2) r.fail(axis, "must be >= 2, got " + std::to_string(width));
  const std::int64_t blocks = kind_of(c.loss).row_blocks(c.loss);  // a router's layers, side by side in a row
  if (width > (std::int64_t{1} << 32) / blocks) {
    r.fail(axis,
           blocks == 1 ? "must be <= 2^32" : "times the row's " + std::to_string(blocks) + " blocks must be <= 2^32");
  }
  c.shape.vocab = width * blocks;
  if (c.shape.tokens > kMaxTokens) r.fail("tokens", "must be <= 2^40");
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
  in.distribution =
      parse_choice(r, "distribution",
                   std::array{LogitDistribution::normal, LogitDistribution::uniform, LogitDistribution::separated},
                   kind_of(c.loss).default_logit_distribution());
  in.mean = r.number("mean", 0.0);
  in.scale = r.number("scale", 1.0);
  if (!(in.scale >= 0.0)) r.fail("scale", "must be >= 0");
  in.ignore_fraction = r.number("ignore_fraction", 0.0);
  if (!(in.ignore_fraction >= 0.0 && in.ignore_fraction <= 1.0)) {
    r.fail("ignore_fraction", "must be in [0, 1], got " + json(in.ignore_fraction).dump());
  }
  if (r.has("teacher")) {
    if (!kind_of(c.loss).inputs().teacher_logits) {
      r.fail("teacher", "teacher logits do not apply to " + std::string(kind_of(c.loss).name()));
    }
    ObjectReader t = r.object("teacher");
    in.teacher.mean = t.number("mean", 0.0);
    in.teacher.scale = t.number("scale", 1.0);
    if (!(in.teacher.scale >= 0.0)) t.fail("scale", "must be >= 0");
    in.teacher.same_as_student = t.boolean("same_as_student", false);
    t.reject_unknown_keys();
  } else {
    r.allow("teacher");
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
      for (const std::string& name : kind_of(c.loss).token_inputs(c.loss)) {
        if (!o.has(name)) {
          o.allow(name);
          continue;
        }
        const double value = o.number(name);
        if (!(std::fabs(value) <= kMaxTokenInput)) {
          o.fail(name, json(value).dump() + " is not a finite number within +-" + json(kMaxTokenInput).dump());
        }
        row.token_inputs[name] = value;
      }
      o.reject_unknown_keys();
      in.overrides.push_back(std::move(row));
    }
  } else {
    r.allow("overrides");
  }
  r.reject_unknown_keys();
}

int parse_dimension(ObjectReader& r, const char* key) {
  const std::int64_t value = r.integer(key, 1);
  if (value < 1) r.fail(key, "must be >= 1, got " + std::to_string(value));
  if (value > 4096) r.fail(key, "must be <= 4096, got " + std::to_string(value));
  return static_cast<int>(value);
}

void parse_layout(ObjectReader r, Case& c) {
  c.layout.tp = parse_dimension(r, "tp");
  c.layout.cp = parse_dimension(r, "cp");
  c.layout.dp = parse_dimension(r, "dp");
  c.layout.ga = parse_dimension(r, "ga");
  if (std::int64_t{c.layout.tp} * c.layout.cp * c.layout.dp > 65536) r.fail_here("tp * cp * dp must be <= 65536 ranks");
  c.layout.sp = r.boolean("sp", false);
  if (c.layout.sp && !sequence_parallel_applies(c)) r.fail("sp", sequence_parallel_refusal(c));
  if (c.layout.sp && c.layout.tp == 1) r.fail("sp", "splits a micro-batch's tokens over TP ranks: needs tp > 1");
  r.reject_unknown_keys();
}

void parse_framework(ObjectReader r, Case& c) {
  c.framework.grad_reduce =
      parse_choice(r, "grad_reduce", std::array{FrameworkSpec::GradReduce::avg, FrameworkSpec::GradReduce::sum},
                   FrameworkSpec::GradReduce::avg);
  c.framework.ga_reduce =
      parse_choice(r, "ga_reduce", std::array{FrameworkSpec::GaReduce::sum, FrameworkSpec::GaReduce::mean},
                   FrameworkSpec::GaReduce::sum);
  r.reject_unknown_keys();
}

std::vector<int> parse_int_list(ObjectReader& r, const char* key) {
  if (!r.has(key)) {
    r.allow(key);
    return {};
  }
  const json& list = r.raw(key);
  if (!list.is_array() || list.empty()) r.fail(key, "expected a non-empty array of integers");
  std::vector<int> out;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto v = detail::as_integer(list[i], r.path_of(key) + "[" + std::to_string(i) + "]", r.source());
    if (v < 1 || v > 4096) r.fail(key, "values must be in [1, 4096]");
    out.push_back(static_cast<int>(v));
  }
  return out;
}

void parse_sweep(ObjectReader r, Case& c) {
  c.sweep.tp = parse_int_list(r, "tp");
  c.sweep.cp = parse_int_list(r, "cp");
  c.sweep.dp = parse_int_list(r, "dp");
  c.sweep.ga = parse_int_list(r, "ga");
  if (r.has("sp")) {
    const json& list = r.raw("sp");
    if (!list.is_array() || list.empty()) r.fail("sp", "expected a non-empty array of true/false");
    for (const json& v : list) {
      if (!v.is_boolean()) r.fail("sp", "expected a non-empty array of true/false");
      c.sweep.sp.push_back(v.get<bool>() ? 1 : 0);
    }
    if (!sequence_parallel_applies(c) && std::count(c.sweep.sp.begin(), c.sweep.sp.end(), 1) > 0) {
      r.fail("sp", sequence_parallel_refusal(c));
    }
  } else {
    r.allow("sp");
  }
  r.reject_unknown_keys();
}

// The packed sequences of the global batch: explicit lengths or a generator.
void parse_batch(ObjectReader r, Case& c) {
  BatchSpec& b = c.batch;
  if (r.has("sequence_lengths")) {
    const json& list = r.raw("sequence_lengths");
    const std::string path = r.path_of("sequence_lengths");
    if (!list.is_array() || list.empty()) fail_at(r.source(), path, "expected a non-empty array of lengths");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const auto v = detail::as_integer(list[i], path + "[" + std::to_string(i) + "]", r.source());
      if (v < 1) fail_at(r.source(), path + "[" + std::to_string(i) + "]", "sequence length must be >= 1");
      b.sequence_lengths.push_back(v);
    }
    if (r.has("generator")) r.fail("generator", "give either sequence_lengths or a generator, not both");
    r.allow("generator");
  } else if (r.has("generator")) {
    ObjectReader g = r.object("generator");
    const std::string kind = g.string("kind");
    const std::int64_t count = g.integer("count");
    if (count < 1 || count > (1 << 20)) g.fail("count", "must be in [1, 2^20]");
    if (kind == "halving") {
      // first, first/2, first/4, ... (at least 1): valid-token counts like 8/4/2/1 across ranks.
      std::int64_t length = g.integer("first");
      if (length < 1) g.fail("first", "must be >= 1");
      for (std::int64_t i = 0; i < count; ++i) {
        b.sequence_lengths.push_back(std::max<std::int64_t>(1, length));
        length /= 2;
      }
    } else if (kind == "uniform") {
      const std::int64_t lo = g.integer("min");
      const std::int64_t hi = g.integer("max");
      if (lo < 1) g.fail("min", "must be >= 1");
      if (hi < lo) g.fail("max", "must be >= min");
      for (std::int64_t i = 0; i < count; ++i) {
        const double u = token_uniform(c.inputs.seed, InputStream::sequence_lengths, static_cast<std::uint64_t>(i));
        b.sequence_lengths.push_back(lo + static_cast<std::int64_t>(u * static_cast<double>(hi - lo + 1)));
      }
    } else {
      g.fail("kind", "expected halving|uniform, got \"" + kind + "\"");
    }
    g.reject_unknown_keys();
  } else {
    r.fail_here("needs sequence_lengths or a generator");
  }
  b.placement =
      parse_choice(r, "placement", std::array{BatchSpec::Placement::round_robin, BatchSpec::Placement::contiguous},
                   BatchSpec::Placement::round_robin);
  b.labels = parse_choice(r, "labels", std::array{BatchSpec::Labels::next_token, BatchSpec::Labels::independent},
                          BatchSpec::Labels::next_token);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < b.sequence_lengths.size(); ++i) {
    if (b.sequence_lengths[i] <= kMaxTokens) total += b.sequence_lengths[i];  // total stays <= 2^41
    if (b.sequence_lengths[i] > kMaxTokens || total > kMaxTokens) {
      fail_at(r.source(), r.path_of(r.has("generator") ? "generator" : "sequence_lengths"),
              "the sequences hold more than 2^40 tokens (at sequence " + std::to_string(i) + ")");
    }
  }
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
    const std::int64_t ulp = t.integer("max_ulp", tol.max_ulp);
    if (ulp < 0 || ulp > 1000000) t.fail("max_ulp", "must be in [0, 1000000]");
    tol.max_ulp = static_cast<int>(ulp);
    if (tol.atol < 0.0) t.fail("atol", "must be >= 0");
    if (tol.rtol < 0.0) t.fail("rtol", "must be >= 0");
    t.reject_unknown_keys();
    c.tolerance_overrides[key] = tol;
  }
  r.reject_unknown_keys();
}

// The ranges in which the correct implementation passes every check (docs/cases.md, "Value ranges"): beyond
// them float32 and 16-bit arithmetic, not an implementation's bug, would decide the verdict.
void validate_value_ranges(const Case& c) {
  const std::string& src = c.source;
  const std::string dtype(to_string(c.inputs.dtype));
  const double bound = std::min(kMaxLogit, dtype_max(c.inputs.dtype));
  const std::string bound_text =
      json(bound).dump() + " (" +
      (bound < kMaxLogit ? dtype + "'s largest value" : "the range where the tool is exact") + ")";
  const auto check_generated = [&](double mean, double scale, const std::string& path) {
    const double reach = generated_reach(mean, scale);
    if (reach > bound) {
      fail_at(src, path,
              "generated logits reach |mean| + 9 * scale = " + json(reach).dump() + ", beyond " + bound_text);
    }
  };
  check_generated(c.inputs.mean, c.inputs.scale, "$.inputs.scale");
  if (kind_of(c.loss).inputs().teacher_logits && !c.inputs.teacher.same_as_student) {
    check_generated(c.inputs.teacher.mean, c.inputs.teacher.scale, "$.inputs.teacher.scale");
  }
  for (std::size_t i = 0; i < c.inputs.overrides.size(); ++i) {
    const auto& logits = c.inputs.overrides[i].logits;
    for (std::size_t k = 0; k < logits.size(); ++k) {
      if (std::fabs(logits[k]) > bound) {
        fail_at(src, "$.inputs.overrides[" + std::to_string(i) + "].logits[" + std::to_string(k) + "]",
                json(logits[k]).dump() + " is beyond " + bound_text);
      }
    }
  }
  const double weight_bound = std::min(kMaxUpstreamWeight, dtype_max(c.inputs.dtype) / 2.0);
  const UpstreamWeights& w = c.loss.upstream_weights;
  const auto check_weight = [&](double weight) {
    if (std::fabs(weight) > weight_bound) {
      fail_at(src, "$.loss.upstream_weights",
              json(weight).dump() + " is beyond +-" + json(weight_bound).dump() + " (the gradients would overflow " +
                  dtype + ")");
    }
  };
  for (const double weight : w.values) check_weight(weight);  // an explicit list (empty otherwise)
  if (w.kind == UpstreamWeights::Kind::uniform) {
    check_weight(w.low);
    check_weight(w.high);
  }
}

// Cross-field checks that need the whole case.
void validate_consistency(const Case& c) {
  const std::string& src = c.source;
  const std::int64_t n = c.shape.tokens;
  const std::int64_t v = c.shape.vocab;
  if (tp_splits_columns(c) && c.layout.tp > v) {
    fail_at(src, "$.layout.tp",
            "tp = " + std::to_string(c.layout.tp) + " exceeds the vocabulary size " + std::to_string(v) +
                ": every TP rank needs at least one column");
  }
  for (int tp : c.sweep.tp) {
    if (tp_splits_columns(c) && tp > v)
      fail_at(src, "$.sweep.tp", "tp = " + std::to_string(tp) + " exceeds the vocabulary size " + std::to_string(v));
  }
  const LossKind& kind = kind_of(c.loss);
  if (!kind.inputs().labels) {
    for (const auto& row : c.inputs.overrides) {
      if (row.label) fail_at(src, "$.inputs.overrides", std::string(kind.name()) + " cases take no labels");
    }
  }
  if (kind.inputs().labels && c.loss.ignore_index >= 0 && c.loss.ignore_index < v) {
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
    if (row.label && *row.label != c.loss.ignore_index && (*row.label < 0 || *row.label >= v)) {
      fail_at(src, path + ".label",
              "label " + std::to_string(*row.label) + " outside [0, " + std::to_string(v) +
                  ") and not the ignore_index " + std::to_string(c.loss.ignore_index));
    }
  }
  validate_value_ranges(c);
  kind.validate(c);
  if (c.loss.stage != nullptr) c.loss.stage->validate(c);
}

}  // namespace

void check_case(const Case& c) {
  std::int64_t total = 0;
  for (const auto length : c.batch.sequence_lengths) total += length;
  if (c.shape.tokens < 1 || c.shape.vocab < 2 || total != c.shape.tokens) {
    fail_at(c.source, "$.shape",
            "tokens = " + std::to_string(c.shape.tokens) + " and vocab = " + std::to_string(c.shape.vocab) +
                " with sequences holding " + std::to_string(total) +
                " tokens: the case was changed after parsing (change its JSON, or load_case_file's --set "
                "assignments, instead)");
  }
  if (c.layout.tp < 1 || c.layout.cp < 1 || c.layout.dp < 1 || c.layout.ga < 1) {
    fail_at(c.source, "$.layout", "every dimension must be >= 1");
  }
  validate_consistency(c);
}

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
  const bool has_batch = root.has("batch");
  const bool tokens_given = root.has("shape") && root.raw("shape").is_object() && root.raw("shape").contains("tokens");
  if (root.has("loss")) {
    parse_loss(root.object("loss"), c);
  } else {
    root.allow("loss");
  }
  parse_shape(root.object("shape"), c, has_batch);  // after the loss: the kind names the columns
  if (root.has("stage")) {
    parse_stage(root.object("stage"), c);
  } else {
    root.allow("stage");
  }
  if (root.has("inputs")) {
    parse_inputs(root.object("inputs"), c);
  } else {
    root.allow("inputs");
  }
  if (has_batch) {
    parse_batch(root.object("batch"), c);
    std::int64_t total = 0;
    for (auto l : c.batch.sequence_lengths) total += l;
    if (tokens_given && total != c.shape.tokens) {
      root.fail("shape", "tokens = " + std::to_string(c.shape.tokens) + " but the sequences hold " +
                             std::to_string(total) + " tokens");
    }
    if (total > (std::int64_t{1} << 40)) root.fail("batch", "too many tokens");
    c.shape.tokens = total;
  } else {
    root.allow("batch");
    c.batch.sequence_lengths = {c.shape.tokens};
    c.batch.labels = BatchSpec::Labels::independent;
  }
  if (root.has("layout")) {
    parse_layout(root.object("layout"), c);
  } else {
    root.allow("layout");
  }
  if (root.has("framework")) {
    parse_framework(root.object("framework"), c);
  } else {
    root.allow("framework");
  }
  if (root.has("sweep")) {
    parse_sweep(root.object("sweep"), c);
  } else {
    root.allow("sweep");
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
  if (!is_valid_utf8(assignment)) throw CaseError("--set " + printable(assignment) + ": not UTF-8 text");
  json value;
  try {
    value = json::parse(text);
  } catch (const json::parse_error&) {
    value = text;  // bare words such as bf16 or megatron are strings
  } catch (const json::out_of_range&) {
    throw CaseError("--set " + assignment + ": " + text + " is outside the range of a double");
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
  json document = detail::read_json_file(path, "case file");
  for (const auto& assignment : set_overrides) apply_set_override(document, assignment, path);
  return parse_case(document, path);
}

bool tp_splits_columns(const Case& c) { return kind_of(c.loss).columns_split_by_tp(); }

bool sequence_parallel_applies(const Case& c) {
  return !tp_splits_columns(c) || (c.loss.stage != nullptr && c.loss.stage->takes_sequence_parallel());
}

std::string sequence_parallel_refusal(const Case& c) {
  return "applies to a kind whose rows are whole on every rank, or to a stage in front that takes it (lm_head); TP "
         "splits the columns of " +
         std::string(kind_of(c.loss).name()) + "'s rows";
}

int token_replicas(const Case& c) { return tp_splits_columns(c) || c.layout.sp ? 1 : c.layout.tp; }

std::vector<LayoutSpec> sweep_layouts(const Case& c) {
  auto values = [](const std::vector<int>& list, int own) { return list.empty() ? std::vector<int>{own} : list; };
  std::vector<LayoutSpec> out;
  for (int dp : values(c.sweep.dp, c.layout.dp)) {
    for (int cp : values(c.sweep.cp, c.layout.cp)) {
      for (int ga : values(c.sweep.ga, c.layout.ga)) {
        for (int sp : values(c.sweep.sp, c.layout.sp ? 1 : 0)) {
          for (int tp : values(c.sweep.tp, c.layout.tp)) {
            // sp at tp 1 splits nothing: that layout is the one without it, listed once
            const LayoutSpec layout{tp, cp, dp, ga, sp == 1 && tp > 1};
            const bool listed = std::any_of(out.begin(), out.end(), [&](const LayoutSpec& l) {
              return l.tp == layout.tp && l.cp == layout.cp && l.dp == layout.dp && l.ga == layout.ga &&
                     l.sp == layout.sp;
            });
            if (!listed) out.push_back(layout);
          }
        }
      }
    }
  }
  return out;
}

SweepSpec parse_sweep_arguments(const std::vector<std::string>& arguments) {
  SweepSpec sweep;
  for (const std::string& argument : arguments) {
    const auto eq = argument.find('=');
    const std::string key = argument.substr(0, eq);
    std::vector<int>* target = key == "tp"   ? &sweep.tp
                               : key == "cp" ? &sweep.cp
                               : key == "dp" ? &sweep.dp
                               : key == "ga" ? &sweep.ga
                               : key == "sp" ? &sweep.sp
                                             : nullptr;
    if (eq == std::string::npos || target == nullptr) {
      throw CaseError(
          "--sweep " + argument +
          ": expected tp=..., cp=..., dp=..., ga=... with comma-separated counts, or sp=false,true (or 0,1)");
    }
    std::stringstream list(argument.substr(eq + 1));
    std::string item;
    while (std::getline(list, item, ',')) {
      if (target == &sweep.sp && (item == "false" || item == "true")) {  // as a case file's "sweep" spells it
        target->push_back(item == "true" ? 1 : 0);
        continue;
      }
      try {
        std::size_t used = 0;
        const int v = std::stoi(item, &used);
        const int low = target == &sweep.sp ? 0 : 1, high = target == &sweep.sp ? 1 : 4096;
        if (used != item.size() || v < low || v > high) throw std::invalid_argument(item);
        target->push_back(v);
      } catch (const std::exception&) {
        throw CaseError("--sweep " + argument + ": \"" + item + "\" is not " +
                        (target == &sweep.sp ? "false, true, 0 or 1" : "a count in [1, 4096]"));
      }
    }
    if (target->empty()) throw CaseError("--sweep " + argument + ": no values");
  }
  return sweep;
}

json Case::resolved() const {
  json j;
  j["format"] = "lossverify.case/1";
  j["name"] = name;
  j["description"] = description;
  j["shape"] = {{"tokens", shape.tokens},
                {std::string(kind_of(loss).column_axis()), shape.vocab / kind_of(loss).row_blocks(loss)}};
  json l = {{"kind", std::string(to_string(loss.kind))}, {"reduction", std::string(to_string(loss.reduction))}};
  resolve_settings(kind_of(loss).settings(), loss, l);
  kind_of(loss).resolve_extra(loss, l);
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
  if (loss.stage != nullptr) {
    json stage = {{"kind", std::string(loss.stage->name())}};
    resolve_settings(loss.stage->settings(), loss, stage);
    j["stage"] = stage;
  }
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
      for (const auto& [input, value] : row.token_inputs) r[input] = value;
      rows.push_back(r);
    }
    in["overrides"] = rows;
  }
  if (kind_of(loss).inputs().teacher_logits) {
    in["teacher"] = {{"mean", inputs.teacher.mean},
                     {"scale", inputs.teacher.scale},
                     {"same_as_student", inputs.teacher.same_as_student}};
  }
  j["inputs"] = in;
  j["batch"] = {{"sequence_lengths", batch.sequence_lengths},
                {"placement", std::string(to_string(batch.placement))},
                {"labels", std::string(to_string(batch.labels))}};
  j["layout"] = {{"tp", layout.tp}, {"cp", layout.cp}, {"dp", layout.dp}, {"ga", layout.ga}};
  if (sequence_parallel_applies(*this)) j["layout"]["sp"] = layout.sp;
  j["framework"] = {{"grad_reduce", std::string(to_string(framework.grad_reduce))},
                    {"ga_reduce", std::string(to_string(framework.ga_reduce))}};
  if (!sweep.empty()) {
    json sw = json::object();
    if (!sweep.tp.empty()) sw["tp"] = sweep.tp;
    if (!sweep.cp.empty()) sw["cp"] = sweep.cp;
    if (!sweep.dp.empty()) sw["dp"] = sweep.dp;
    if (!sweep.ga.empty()) sw["ga"] = sweep.ga;
    if (!sweep.sp.empty()) {
      sw["sp"] = json::array();
      for (int on : sweep.sp) sw["sp"].push_back(on == 1);
    }
    j["sweep"] = sw;
  }
  json tol = json::object();
  for (std::string_view q : kToleranceQuantities) {
    if (!tolerance_applies(*this, q)) continue;
    const Tolerance t = effective_tolerance(*this, q);
    tol[std::string(q)] = {{"atol", t.atol}, {"rtol", t.rtol}, {"max_ulp", t.max_ulp}};
  }
  j["tolerances"] = tol;
  j["timeout_seconds"] = timeout_seconds;
  return j;
}

}  // namespace lossverify
