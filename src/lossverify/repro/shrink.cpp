#include "lossverify/repro/shrink.hpp"
#include "lossverify/kind_api/registry.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify {

using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

std::string margin_text(double m) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3g", m);
  return buffer;
}

std::string layout_text(const LayoutSpec& l) {
  return "tp=" + std::to_string(l.tp) + (l.sp ? " sp" : "") + " cp=" + std::to_string(l.cp) +
         " dp=" + std::to_string(l.dp) + " ga=" + std::to_string(l.ga);
}

// Removes obj[key] when it equals the default.
void drop_default(json& obj, const char* key, const json& fallback) {
  if (obj.is_object() && obj.contains(key) && obj[key] == fallback) obj.erase(key);
}
void drop_if_empty(json& obj, const char* key) {
  if (obj.contains(key) && obj[key].is_object() && obj[key].empty()) obj.erase(key);
}

// A stretch of the old token numbering that becomes one sequence of the new case.
struct Segment {
  std::int64_t begin = 0;
  std::int64_t length = 0;
};

// The case restricted to the tokens of `segments` (each one sequence, in order): inline rows and explicit
// upstream weights follow their tokens; rows of dropped tokens go.
json restrict_tokens(const json& doc, const std::vector<Segment>& segments) {
  json out = doc;
  std::vector<std::int64_t> lengths;
  std::int64_t total = 0;
  for (const Segment& s : segments) {
    lengths.push_back(s.length);
    total += s.length;
  }
  auto new_index = [&](std::int64_t old) -> std::int64_t {
    std::int64_t offset = 0;
    for (const Segment& s : segments) {
      if (old >= s.begin && old < s.begin + s.length) return offset + (old - s.begin);
      offset += s.length;
    }
    return -1;
  };
  out["batch"]["sequence_lengths"] = lengths;
  out["shape"]["tokens"] = total;
  if (out["inputs"].contains("overrides")) {
    json kept = json::array();
    for (json o : out["inputs"]["overrides"]) {
      const std::int64_t t = new_index(o.at("token").get<std::int64_t>());
      if (t < 0) continue;
      o["token"] = t;
      kept.push_back(o);
    }
    if (kept.empty()) {
      out["inputs"].erase("overrides");
    } else {
      out["inputs"]["overrides"] = kept;
    }
  }
  if (out["loss"].contains("upstream_weights") && out["loss"]["upstream_weights"].is_array()) {
    const json& old = out["loss"]["upstream_weights"];
    json kept = json::array();
    for (const Segment& s : segments) {
      for (std::int64_t t = s.begin; t < s.begin + s.length; ++t) kept.push_back(old.at(static_cast<std::size_t>(t)));
    }
    out["loss"]["upstream_weights"] = kept;
  }
  return out;
}

std::vector<Segment> segments_of(const json& doc) {
  std::vector<Segment> out;
  std::int64_t begin = 0;
  for (const auto& l : doc.at("batch").at("sequence_lengths")) {
    out.push_back({begin, l.get<std::int64_t>()});
    begin += l.get<std::int64_t>();
  }
  return out;
}

// The kind a case document names (cross_entropy when it names none).
const LossKind& kind_in(const json& doc) {
  if (doc.contains("loss") && doc["loss"].contains("kind") && doc["loss"]["kind"].is_string()) {
    if (const LossKind* kind = find_loss_kind(doc["loss"]["kind"].get<std::string>())) return *kind;
  }
  return default_loss_kind();
}

// The stage a case document puts in front of its kind, or null.
const Stage* stage_in(const json& doc) {
  if (!doc.contains("stage") || !doc["stage"].is_object() || !doc["stage"].contains("kind")) return nullptr;
  const json& kind = doc["stage"]["kind"];
  return kind.is_string() ? find_stage(kind.get<std::string>()) : nullptr;
}

class Shrinker {
 public:
  // Guards against slipping into a different failure: a target that failed with a finite margin must keep
  // a finite one, and when every output was finite (the finite check passed) it must stay so.
  Shrinker(const ShrinkOptions& options, const std::string& check, bool finite_margin, bool finite_outputs,
           Clock::time_point start)
      : options_(options),
        check_(check),
        finite_margin_(finite_margin),
        finite_outputs_(finite_outputs),
        start_(start) {}

  // The target check's margin when it fails on this document; nullopt when it passes or the document is
  // not a valid case.
  std::optional<double> failing_margin(const json& doc) {
    Case c;
    try {
      c = parse_case(doc, "<shrink>");
    } catch (const CaseError&) {
      return std::nullopt;
    }
    RunOptions run_options;
    run_options.implementation = options_.implementation;
    run_options.threads = options_.threads;
    const RunResult r = run_case(c, run_options);
    std::optional<double> margin;
    for (const CheckResult& check : r.checks) {
      if (check.name == check_ && check.verdict == Verdict::fail) margin = check.margin;
      if (finite_outputs_ && check.name == "finite" && check.verdict == Verdict::fail) return std::nullopt;
    }
    if (margin && finite_margin_ && !std::isfinite(*margin)) return std::nullopt;
    return margin;
  }

  bool out_of_budget() const {
    return trials_ >= options_.max_trials ||
           std::chrono::duration<double>(Clock::now() - start_).count() >= options_.max_seconds;
  }

  // Runs the candidate; keeps it when the check still fails.
  bool attempt(const json& candidate, const std::string& what) {
    if (out_of_budget()) {
      exhausted_ = true;
      return false;
    }
    if (candidate == doc_) return false;
    // A candidate that passed once passes again (runs are deterministic): never run it twice.
    const std::size_t key = std::hash<std::string>{}(json_text(candidate));
    if (rejected_.count(key)) return false;
    ++trials_;
    const std::optional<double> margin = failing_margin(candidate);
    if (!margin) {
      rejected_.insert(key);
      return false;
    }
    doc_ = candidate;
    margin_ = *margin;
    steps_.push_back(what);
    if (options_.progress) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
      char head[64];
      std::snprintf(head, sizeof(head), "[trial %d, %.1f s] ", trials_, elapsed);
      options_.progress(head + what + ": " + check_ + " still fails (margin " + margin_text(*margin) + ")");
    }
    return true;
  }

  bool shrink_layout() {
    bool changed = false;
    if (doc_["layout"].value("sp", false)) {
      json candidate = doc_;
      candidate["layout"]["sp"] = false;
      changed = attempt(candidate, "no sequence parallelism");
    }
    for (const char* dim : {"dp", "cp", "tp", "ga"}) {
      bool progress = true;
      while (progress) {
        progress = false;
        const int v = doc_["layout"][dim].get<int>();
        int previous = v;
        for (int next : {1, v / 2, v - 1}) {
          if (next < 1 || next >= v || next == previous) continue;
          previous = next;
          json candidate = doc_;
          candidate["layout"][dim] = next;
          // sequence parallelism splits over TP ranks: at tp 1 it goes too
          if (next == 1 && std::string(dim) == "tp" && candidate["layout"].contains("sp")) {
            candidate["layout"]["sp"] = false;
          }
          if (attempt(candidate, std::string(dim) + " " + std::to_string(v) + " -> " + std::to_string(next))) {
            progress = changed = true;
            break;
          }
        }
      }
    }
    return changed;
  }

  bool drop_sequences() {
    bool changed = false;
    std::size_t chunk = segments_of(doc_).size() / 2;
    while (chunk >= 1 && !exhausted_) {
      std::size_t start = 0;
      while (true) {
        const std::vector<Segment> all = segments_of(doc_);
        if (all.size() <= 1 || start >= all.size()) break;
        const std::size_t end = std::min(all.size(), start + chunk);
        if (end - start >= all.size()) break;
        std::vector<Segment> kept;
        for (std::size_t i = 0; i < all.size(); ++i) {
          if (i < start || i >= end) kept.push_back(all[i]);
        }
        const std::string what = end - start == 1
                                     ? "drop sequence " + std::to_string(start)
                                     : "drop sequences " + std::to_string(start) + "-" + std::to_string(end - 1);
        if (attempt(restrict_tokens(doc_, kept),
                    what + " (" + std::to_string(all.size()) + " -> " + std::to_string(kept.size()) + " sequences)")) {
          changed = true;
        } else {
          start = end;
        }
        if (exhausted_) break;
      }
      chunk /= 2;
    }
    return changed;
  }

  bool shorten_sequences() {
    bool changed = false;
    for (std::size_t i = 0; i < segments_of(doc_).size() && !exhausted_; ++i) {
      bool progress = true;
      while (progress && !exhausted_) {
        progress = false;
        const std::vector<Segment> all = segments_of(doc_);
        const Segment s = all[i];
        if (s.length <= 1) break;
        const std::int64_t half = s.length / 2;
        struct Option {
          Segment keep;
          const char* what;
        };
        std::vector<Option> options = {{{s.begin, s.length - half}, "first half"},
                                       {{s.begin + s.length - half, half}, "second half"}};
        if (half == 1 || s.length <= 16) {
          options.push_back({{s.begin, s.length - 1}, "without its last token"});
          options.push_back({{s.begin + 1, s.length - 1}, "without its first token"});
        }
        for (const Option& option : options) {
          std::vector<Segment> candidate_segments = all;
          candidate_segments[i] = option.keep;
          const std::string what = "sequence " + std::to_string(i) + ": keep its " + option.what + " (" +
                                   std::to_string(s.length) + " -> " + std::to_string(option.keep.length) + " tokens)";
          if (attempt(restrict_tokens(doc_, candidate_segments), what)) {
            progress = changed = true;
            break;
          }
        }
      }
    }
    return changed;
  }

  bool shrink_vocab() {
    bool changed = false;
    bool progress = true;
    while (progress && !exhausted_) {
      progress = false;
      const Case c = parse_case(doc_, "<shrink>");
      const std::string axis(kind_of(c.loss).column_axis());  // "vocab", a router's "experts"
      const std::int64_t blocks = kind_of(c.loss).row_blocks(c.loss);
      const std::int64_t v = c.shape.vocab / blocks;
      const bool split = tp_splits_columns(c);
      const std::int64_t lowest = std::max<std::int64_t>(2, split ? c.layout.tp : 2);
      std::vector<std::int64_t> options = {v / 2};
      if (v <= 32) options.push_back(v - 1);
      for (std::int64_t next : options) {
        if (next < lowest || next >= v) continue;
        json candidate = doc_;
        candidate["shape"][axis] = next;
        if (blocks > 1 && candidate["inputs"].contains("overrides")) continue;  // rows of blocks: not cut here
        if (candidate["inputs"].contains("overrides")) {
          for (json& o : candidate["inputs"]["overrides"]) {
            if (!o.contains("logits")) continue;
            json row = json::array();
            for (std::int64_t k = 0; k < next; ++k) row.push_back(o["logits"][static_cast<std::size_t>(k)]);
            o["logits"] = row;
          }
        }
        if (attempt(candidate, axis + " " + std::to_string(v) + " -> " + std::to_string(next))) {
          progress = changed = true;
          break;
        }
      }
    }
    return changed;
  }

  // A stage's sizes its table halves (an LM head's hidden size and chunks), each while the failure stays.
  bool shrink_stage_sizes() {
    const Stage* stage = stage_in(doc_);
    if (stage == nullptr) return false;
    bool changed = false;
    for (const Setting& s : stage->settings()) {
      if (!s.shrinks_by_half) continue;
      bool progress = true;
      while (progress && !exhausted_ && doc_["stage"].contains(s.key)) {
        progress = false;
        const std::int64_t v = doc_["stage"][s.key].get<std::int64_t>();
        const auto lowest = static_cast<std::int64_t>(std::max(1.0, s.low));
        for (const std::int64_t next : {v / 2, v - 1}) {
          if (next < lowest || next >= v) continue;
          json candidate = doc_;
          candidate["stage"][s.key] = next;
          if (attempt(candidate, "stage " + s.key + " " + std::to_string(v) + " -> " + std::to_string(next))) {
            progress = changed = true;
            break;
          }
        }
      }
    }
    return changed;
  }

  bool simplify_features() {
    bool changed = false;
    struct Feature {
      const char* what;
      std::function<bool(json&)> apply;  // false: nothing to simplify
    };
    auto set_default = [](const char* section, const char* key, json value) {
      return [section, key, value](json& d) {
        if (!d.contains(section) || !d[section].contains(key) || d[section][key] == value) return false;
        d[section][key] = value;
        return true;
      };
    };
    std::vector<Feature> features;
    // The kind's settings that its table offers to shrink, at their fallbacks.
    for (const Setting& s : kind_in(doc_).settings()) {
      if (s.simplify.empty()) continue;
      const std::string key = s.key;
      const json value = s.fallback;
      features.push_back({s.simplify.c_str(), [key, value](json& d) {
                            if (!d.contains("loss") || !d["loss"].contains(key) || d["loss"][key] == value)
                              return false;
                            d["loss"][key] = value;
                            return true;
                          }});
    }
    // The stage's settings that its table offers to shrink, at their fallbacks.
    if (const Stage* stage = stage_in(doc_)) {
      for (const Setting& s : stage->settings()) {
        if (s.simplify.empty()) continue;
        const std::string key = s.key;
        const json value = s.fallback;
        features.push_back({s.simplify.c_str(), [key, value](json& d) {
                              if (!d["stage"].contains(key) || d["stage"][key] == value) return false;
                              d["stage"][key] = value;
                              return true;
                            }});
      }
    }
    const std::vector<Feature> shared = {
        {"no ignored tokens", set_default("inputs", "ignore_fraction", 0.0)},
        {"reduction mean",
         [](json& d) {
           if (d["loss"]["reduction"] == "mean") return false;
           d["loss"]["reduction"] = "mean";
           d["loss"].erase("upstream_weights");
           return true;
         }},
        {"unit upstream weights",
         [](json& d) {
           if (!d["loss"].contains("upstream_weights")) return false;
           d["loss"].erase("upstream_weights");
           return true;
         }},
        {"fp32 inputs", set_default("inputs", "dtype", "fp32")},
        {"grad_reduce avg", set_default("framework", "grad_reduce", "avg")},
        {"ga_reduce sum", set_default("framework", "ga_reduce", "sum")},
        {"round-robin placement", set_default("batch", "placement", "round_robin")},
        {"independent labels", set_default("batch", "labels", "independent")},
        {"normal logits", set_default("inputs", "distribution", "normal")},
        {"logit mean 0", set_default("inputs", "mean", 0.0)},
        {"logit scale 1", set_default("inputs", "scale", 1.0)},
    };
    features.insert(features.end(), shared.begin(), shared.end());
    for (const Feature& f : features) {
      if (exhausted_) break;
      json candidate = doc_;
      if (!f.apply(candidate)) continue;
      changed = attempt(candidate, f.what) || changed;
    }
    return changed;
  }

  bool drop_overrides() {
    bool changed = false;
    if (!doc_["inputs"].contains("overrides")) return false;
    std::size_t chunk = std::max<std::size_t>(1, doc_["inputs"]["overrides"].size() / 2);
    while (chunk >= 1 && !exhausted_) {
      std::size_t start = 0;
      while (!exhausted_ && doc_["inputs"].contains("overrides")) {
        const json rows = doc_["inputs"]["overrides"];
        if (start >= rows.size()) break;
        const std::size_t end = std::min(rows.size(), start + chunk);
        json kept = json::array();
        for (std::size_t i = 0; i < rows.size(); ++i) {
          if (i < start || i >= end) kept.push_back(rows[i]);
        }
        json candidate = doc_;
        if (kept.empty()) {
          candidate["inputs"].erase("overrides");
        } else {
          candidate["inputs"]["overrides"] = kept;
        }
        std::string tokens;
        for (std::size_t i = start; i < end; ++i) append_to_list(tokens, rows[i]["token"].dump(), ",");
        if (attempt(candidate, "drop inline row(s) of token " + tokens)) {
          changed = true;
        } else {
          start = end;
        }
      }
      chunk /= 2;
    }
    return changed;
  }

  // Pins the worst element's row of the target check inline (the generated values, exactly).
  void pin_worst_row() {
    if (exhausted_) return;
    const Case c = parse_case(doc_, "<shrink>");
    if (c.shape.vocab > 65536) return;
    // A stage that makes the logits from inputs of its own (an LM head): a pinned row of logits would reach no one.
    if (c.loss.stage != nullptr && c.loss.stage->token_input_width(c) > 0) return;
    RunOptions run_options;
    run_options.implementation = options_.implementation;
    run_options.threads = options_.threads;
    const RunResult r = run_case(c, run_options);
    for (const CheckResult& check : r.checks) {
      if (check.name != check_ || !check.worst || check.worst->token < 0) continue;
      const std::int64_t t = check.worst->token;
      const InputSource inputs(c);
      std::vector<double> row(static_cast<std::size_t>(c.shape.vocab));
      inputs.logits(t, 0, c.shape.vocab, row.data());
      json candidate = doc_;
      json& overrides = candidate["inputs"]["overrides"];
      if (overrides.is_null()) overrides = json::array();
      for (const json& o : overrides) {
        if (o["token"] == t && o.contains("logits")) return;  // already inline
      }
      json kept = json::array();
      for (const json& o : overrides) {
        if (o["token"] != t) kept.push_back(o);
      }
      json o = {{"token", t}, {"logits", row}};
      if (kind_of(c.loss).inputs().labels) o["label"] = inputs.label(t);
      kept.push_back(o);
      overrides = kept;
      attempt(candidate, "pin the row of token " + std::to_string(t) + " inline");
    }
  }

  ShrinkResult run(const json& start_doc, double initial_margin) {
    doc_ = start_doc;
    margin_ = initial_margin;
    bool progress = true;
    while (progress && !exhausted_) {
      progress = false;
      // Tokens and vocabulary first: every later trial runs on the smaller problem.
      progress = drop_sequences() || progress;
      progress = shorten_sequences() || progress;
      progress = shrink_vocab() || progress;
      progress = shrink_stage_sizes() || progress;
      progress = shrink_layout() || progress;
      progress = simplify_features() || progress;
      progress = drop_overrides() || progress;
    }
    if (options_.pin_rows) pin_worst_row();
    ShrinkResult result;
    result.minimized_case = parse_case(doc_, "<shrink>");
    result.margin_after = margin_;
    result.trials = trials_;
    result.steps = steps_;
    result.budget_exhausted = exhausted_;
    result.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    return result;
  }

  void count_trial() { ++trials_; }

 private:
  const ShrinkOptions& options_;
  std::string check_;
  bool finite_margin_ = true;
  bool finite_outputs_ = true;
  json doc_;
  double margin_ = 0.0;
  int trials_ = 0;
  bool exhausted_ = false;
  std::vector<std::string> steps_;
  std::set<std::size_t> rejected_;
  Clock::time_point start_;
};

}  // namespace

std::string case_file_text(const json& document) {
  nlohmann::ordered_json out;
  static const char* const order[] = {"name",       "description",     "format", "shape",  "loss",
                                      "stage",      "inputs",          "batch",  "layout", "framework",
                                      "tolerances", "timeout_seconds", "sweep"};
  for (const char* key : order) {
    if (document.contains(key)) out[key] = document[key];
  }
  for (const auto& [key, value] : document.items()) {
    if (!out.contains(key)) out[key] = value;
  }
  return json_text(out, 2) + "\n";
}

ShrinkSize size_of(const Case& c) {
  return ShrinkSize{c.shape.tokens, c.shape.vocab, static_cast<std::int64_t>(c.batch.sequence_lengths.size()),
                    static_cast<std::int64_t>(c.inputs.overrides.size()), c.layout};
}

json compact_case_json(const Case& c) {
  Case plain = c;
  plain.sweep = SweepSpec{};
  const json full = plain.resolved();
  json doc = full;
  doc.erase("tolerances");
  if (!c.tolerance_overrides.empty()) {
    json tol = json::object();
    for (const auto& [quantity, t] : c.tolerance_overrides) {
      tol[quantity] = {{"atol", t.atol}, {"rtol", t.rtol}, {"max_ulp", t.max_ulp}};
    }
    doc["tolerances"] = tol;
  }
  drop_default(doc, "description", "");
  doc.erase("format");  // lossverify.case/1 is what a file without one means
  json& loss = doc["loss"];
  drop_default(loss, "kind", "cross_entropy");
  drop_default(loss, "reduction", "mean");
  for (const Setting& s : kind_of(c.loss).settings()) {
    if (s.fallback_from.empty()) drop_default(loss, s.key.c_str(), s.fallback);
  }
  drop_if_empty(doc, "loss");
  if (c.loss.stage != nullptr) {
    for (const Setting& s : c.loss.stage->settings()) {
      if (s.fallback_from.empty()) drop_default(doc["stage"], s.key.c_str(), s.fallback);
    }
  }
  json& inputs = doc["inputs"];
  drop_default(inputs, "dtype", "fp32");
  drop_default(inputs, "distribution", "normal");
  drop_default(inputs, "mean", 0.0);
  drop_default(inputs, "scale", 1.0);
  drop_default(inputs, "ignore_fraction", 0.0);
  if (inputs.contains("teacher")) {
    drop_default(inputs["teacher"], "mean", 0.0);
    drop_default(inputs["teacher"], "scale", 1.0);
    drop_default(inputs["teacher"], "same_as_student", false);
    drop_if_empty(inputs, "teacher");
  }
  json& batch = doc["batch"];
  if (c.batch.sequence_lengths.size() == 1 && c.batch.labels == BatchSpec::Labels::independent) {
    doc.erase("batch");  // one sequence with independent labels: what a case without a batch means
  } else {
    drop_default(batch, "placement", "round_robin");
    drop_default(batch, "labels", "next_token");
    doc["shape"].erase("tokens");  // the sequences give it
  }
  for (const char* dim : {"tp", "cp", "dp", "ga"}) drop_default(doc["layout"], dim, 1);
  drop_default(doc["layout"], "sp", false);
  drop_if_empty(doc, "layout");
  drop_default(doc["framework"], "grad_reduce", "avg");
  drop_default(doc["framework"], "ga_reduce", "sum");
  drop_if_empty(doc, "framework");
  drop_default(doc, "timeout_seconds", 120.0);
  // Must read back as the same case; otherwise keep everything explicit.
  try {
    if (parse_case(doc, "<compact>").resolved() == full) return doc;
  } catch (const CaseError&) {
  }
  json explicit_doc = full;
  explicit_doc.erase("tolerances");
  if (doc.contains("tolerances")) explicit_doc["tolerances"] = doc["tolerances"];
  return explicit_doc;
}

ShrinkResult shrink_case(const Case& c, const ShrinkOptions& options) {
  if (find_implementation(options.implementation) == nullptr) {
    throw CaseError("--impl " + options.implementation + ": unknown implementation (see `lossverify list`)");
  }
  if (!options.check.empty()) {
    const auto& catalogue = check_catalogue();
    if (std::none_of(catalogue.begin(), catalogue.end(), [&](const CheckInfo& i) { return i.name == options.check; }) ||
        options.check == "invariance") {
      throw CaseError("--check " + options.check + ": not a check of a single run (see `lossverify list`)");
    }
  }
  RunOptions run_options;
  run_options.implementation = options.implementation;
  run_options.threads = options.threads;
  const auto start = Clock::now();
  const RunResult first = run_case(c, run_options);
  std::string check = options.check;
  double margin = 0.0;
  for (const CheckResult& r : first.checks) {
    if (r.verdict != Verdict::fail) continue;
    if (check.empty()) check = r.name;
    if (r.name == check) {
      margin = r.margin;
      break;
    }
  }
  const bool fails = std::any_of(first.checks.begin(), first.checks.end(),
                                 [&](const CheckResult& r) { return r.name == check && r.verdict == Verdict::fail; });
  if (!fails) {
    throw CaseError("nothing to shrink: " + c.source + " " +
                    (options.check.empty() ? "passes" : "does not fail check " + options.check) + " with --impl " +
                    options.implementation);
  }
  if (options.progress) {
    options.progress("start: " + check + " fails (margin " + margin_text(margin) +
                     ") at N=" + std::to_string(c.shape.tokens) + " V=" + std::to_string(c.shape.vocab) + " " +
                     layout_text(c.layout) + ", " + std::to_string(c.batch.sequence_lengths.size()) + " sequence(s)");
  }
  // Work on the resolved case without its sweep and default tolerances (the trials run one layout).
  Case plain = c;
  plain.sweep = SweepSpec{};
  json doc = plain.resolved();
  doc.erase("tolerances");
  if (!c.tolerance_overrides.empty()) doc["tolerances"] = compact_case_json(c)["tolerances"];

  const bool finite_outputs = std::any_of(first.checks.begin(), first.checks.end(), [](const CheckResult& r) {
    return r.name == "finite" && r.verdict == Verdict::pass;
  });
  Shrinker shrinker(options, check, std::isfinite(margin), finite_outputs, start);
  shrinker.count_trial();  // the first run
  ShrinkResult result = shrinker.run(doc, margin);
  result.check = check;
  result.before = size_of(c);
  result.after = size_of(result.minimized_case);
  result.margin_before = margin;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();

  Case named = result.minimized_case;
  named.name = c.name + "-shrunk";
  std::string what = "Shrunk by lossverify shrink --impl " + options.implementation + " from " +
                     std::filesystem::path(c.source).filename().string() + " (N=" + std::to_string(c.shape.tokens) +
                     " V=" + std::to_string(c.shape.vocab) + " " + layout_text(c.layout) + "): still fails check " +
                     check + " (margin " + margin_text(result.margin_after) + ").";
  if (!c.description.empty()) what += " Original description: " + c.description;
  named.description = what;
  named.source = c.source;
  result.minimized_case = named;
  result.minimized = compact_case_json(named);
  return result;
}

}  // namespace lossverify
