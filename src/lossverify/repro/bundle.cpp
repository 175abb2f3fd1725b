#include "lossverify/repro/bundle.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "lossverify/case/json_reader.hpp"
#include "lossverify/core/build_info.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/report/report.hpp"

namespace lossverify {

using detail::fail_at;
using detail::ObjectReader;
using nlohmann::json;

namespace {

std::uint32_t bits_of(double value, DType dtype) {
  const auto f = static_cast<float>(value);
  switch (dtype) {
    case DType::bf16:
      return Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(f));
    case DType::fp16:
      return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(f));
    case DType::fp32:
    default: {
      std::uint32_t u = 0;
      std::memcpy(&u, &f, sizeof(u));
      return u;
    }
  }
}

double value_of(std::uint32_t bits, DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return static_cast<double>(
          static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(static_cast<std::uint16_t>(bits))));
    case DType::fp16:
      return static_cast<double>(
          static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(static_cast<std::uint16_t>(bits))));
    case DType::fp32:
    default: {
      float f = 0.0f;
      std::memcpy(&f, &bits, sizeof(f));
      return static_cast<double>(f);
    }
  }
}

int hex_digits(DType dtype) { return dtype == DType::fp32 ? 8 : 4; }

std::string hex_word(std::uint32_t bits, DType dtype) {
  char buffer[12];
  std::snprintf(buffer, sizeof(buffer), "%0*x", hex_digits(dtype), bits);
  return buffer;
}

std::vector<double> student_row(const InputSource& inputs, std::int64_t token) {
  std::vector<double> row(static_cast<std::size_t>(inputs.vocab()));
  inputs.logits(token, 0, inputs.vocab(), row.data());
  return row;
}

std::vector<double> teacher_row(const InputSource& inputs, std::int64_t token) {
  std::vector<double> row(static_cast<std::size_t>(inputs.vocab()));
  inputs.teacher_logits(token, 0, inputs.vocab(), row.data());
  return row;
}

// The stage's own input row of a token (an LM head's h_t), empty when the case has no such stage.
std::vector<double> stage_input_row(const Case& c, const InputSource& inputs, std::int64_t token) {
  const std::int64_t width = c.loss.stage != nullptr ? c.loss.stage->token_input_width(c) : 0;
  std::vector<double> row(static_cast<std::size_t>(width));
  if (width > 0) c.loss.stage->token_input(c, inputs, token, row.data());
  return row;
}

bool has_own_teacher(const Case& c) {
  return kind_of(c.loss).inputs().teacher_logits && !c.inputs.teacher.same_as_student;
}

// Rewrites "SOURCE: $.x: ..." from the case reader into "SOURCE: $.case.x: ..." (the case sits in $.case).
[[noreturn]] void rethrow_in_case(const CaseError& e, const std::string& source) {
  const std::string message = e.what();
  const std::string prefix = source + ": $";
  if (message.rfind(prefix, 0) == 0) throw CaseError(source + ": $.case" + message.substr(prefix.size()));
  throw CaseError(source + ": $.case: " + message);
}

Verdict parse_verdict(const json& value, const std::string& source, const std::string& path) {
  if (value.is_string()) {
    const std::string v = value.get<std::string>();
    if (v == "pass") return Verdict::pass;
    if (v == "fail") return Verdict::fail;
    if (v == "not_applicable") return Verdict::not_applicable;
  }
  fail_at(source, path, "expected one of pass|fail|not_applicable, got " + value.dump());
}

double parse_margin(const json& value, const std::string& source, const std::string& path) {
  if (value.is_string()) {
    const std::string v = value.get<std::string>();
    if (v == "NaN" || v == "Infinity") return decode_number(value);
  } else if (value.is_number()) {
    const double m = value.get<double>();
    if (m >= 0.0) return m;
  }
  fail_at(source, path, "expected a margin >= 0 (a number, \"NaN\" or \"Infinity\"), got " + value.dump());
}

std::optional<std::int64_t> optional_index(const json& value, const std::string& source, const std::string& path) {
  if (value.is_null()) return std::nullopt;
  return detail::as_integer(value, path, source);
}

std::string element_text(const RecordedElement& e) {
  return "(token " + (e.token >= 0 ? std::to_string(e.token) : std::string("-")) + ", column " +
         (e.column >= 0 ? std::to_string(e.column) : std::string("-")) + ", rank " + std::to_string(e.rank) + ")";
}

std::string margin_text(double m) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3g", m);
  return buffer;
}

}  // namespace

std::string encode_row_bits(const std::vector<double>& values, DType dtype) {
  std::string out;
  out.reserve(values.size() * static_cast<std::size_t>(hex_digits(dtype) + 1));
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ' ';
    out += hex_word(bits_of(values[i], dtype), dtype);
  }
  return out;
}

std::vector<double> decode_row_bits(const std::string& text, DType dtype, std::int64_t expected_count,
                                    const std::string& source, const std::string& path, const std::string& width_name) {
  std::vector<double> values;
  std::istringstream words(text);
  std::string word;
  const int digits = hex_digits(dtype);
  while (words >> word) {
    const std::string where = path + ": word " + std::to_string(values.size()) + " \"" + word.substr(0, 16) + "\"";
    if (static_cast<int>(word.size()) != digits ||
        !std::all_of(word.begin(), word.end(), [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)); })) {
      throw CaseError(source + ": " + where + ": expected " + std::to_string(digits) + " hex digits (the raw bits of " +
                      std::string(to_string(dtype)) + ")");
    }
    const auto bits = static_cast<std::uint32_t>(std::stoul(word, nullptr, 16));
    const double v = value_of(bits, dtype);
    if (!std::isfinite(v)) throw CaseError(source + ": " + where + ": not a finite " + std::string(to_string(dtype)));
    values.push_back(v);
  }
  if (static_cast<std::int64_t>(values.size()) != expected_count) {
    fail_at(source, path,
            "has " + std::to_string(values.size()) + " values, expected " + width_name + " = " +
                std::to_string(expected_count));
  }
  return values;
}

json make_bundle(const RunResult& run, const BundleContext& context, const BundleLimits& limits) {
  const Case& c = run.the_case;
  const std::int64_t vocab = c.shape.vocab;
  const bool labelled = kind_of(c.loss).inputs().labels;
  const InputSource inputs(c);
  const json run_json = run_to_json(run);

  // Which rows: the worst element of every failing check, then the tokens of largest margin.
  std::vector<std::int64_t> tokens;
  std::map<std::int64_t, std::vector<std::string>> worst_of;
  auto fits = [&](std::size_t rows) {
    return rows == 0 || (static_cast<int>(rows) < limits.max_rows &&
                         static_cast<std::int64_t>(rows + 1) * vocab <= limits.max_values);
  };
  for (const CheckResult& check : run.checks) {
    if (check.verdict != Verdict::fail || !check.worst || check.worst->token < 0) continue;
    const std::int64_t t = check.worst->token;
    if (t >= c.shape.tokens) continue;
    if (!worst_of.count(t)) {
      if (!fits(tokens.size())) continue;
      tokens.push_back(t);
    }
    worst_of[t].push_back(check.name);
  }
  const ErrorMap& map = run.error_map;
  auto token_margin = [&](std::size_t t) {
    const double g = t < map.token_grad_margin.size() ? map.token_grad_margin[t] : 0.0;
    const double l = t < map.token_loss_margin.size() ? map.token_loss_margin[t] : 0.0;
    if (std::isnan(g) || std::isnan(l)) return std::numeric_limits<double>::infinity();
    return std::max(g, l);
  };
  std::vector<std::pair<double, std::int64_t>> ranked;
  for (std::size_t t = 0; t < std::max(map.token_grad_margin.size(), map.token_loss_margin.size()); ++t) {
    const double m = token_margin(t);
    if (m > 1.0) ranked.emplace_back(m, static_cast<std::int64_t>(t));
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [margin, t] : ranked) {
    if (worst_of.count(t)) continue;
    if (!fits(tokens.size())) break;
    tokens.push_back(t);
    worst_of[t] = {};
  }

  // The resolved case with the rows pinned inline.
  json the_case = c.resolved();
  json& overrides = the_case["inputs"]["overrides"];
  if (overrides.is_null()) overrides = json::array();
  json rows = json::array();
  for (const std::int64_t t : tokens) {
    const std::vector<double> logits = student_row(inputs, t);
    json row = {{"token", t}};
    const TokenPlace place = locate_token(inputs.batch(), c.batch, c.layout, t);
    row["place"] = {{"sequence", place.sequence},       {"position", place.position}, {"dp_rank", place.dp},
                    {"micro_batch", place.micro_batch}, {"cp_rank", place.cp},        {"chunk", place.chunk}};
    row["worst_of"] = worst_of[t];
    row["grad_margin"] = static_cast<std::size_t>(t) < map.token_grad_margin.size()
                             ? map.token_grad_margin[static_cast<std::size_t>(t)]
                             : 0.0;
    row["loss_margin"] = static_cast<std::size_t>(t) < map.token_loss_margin.size()
                             ? map.token_loss_margin[static_cast<std::size_t>(t)]
                             : 0.0;
    if (labelled) row["label"] = inputs.label(t);
    row["valid"] = inputs.is_valid(t);
    // Pin the row: an override of its own, or the logits added to a label-only override of the case.
    json* existing = nullptr;
    for (json& o : overrides) {
      if (o.at("token").get<std::int64_t>() == t) existing = &o;
    }
    bool pinned = false;
    bool pinned_label = false;
    if (existing == nullptr) {
      json o = {{"token", t}, {"logits", logits}};
      if (labelled) {
        o["label"] = inputs.label(t);
        pinned_label = true;
      }
      overrides.push_back(o);
      pinned = true;
    } else if (!existing->contains("logits")) {
      (*existing)["logits"] = logits;
      pinned = true;
    }
    row["pinned"] = pinned;
    row["pinned_label"] = pinned_label;
    row["dtype"] = std::string(to_string(c.inputs.dtype));
    row["logits_bits"] = encode_row_bits(logits, c.inputs.dtype);
    if (has_own_teacher(c)) row["teacher_bits"] = encode_row_bits(teacher_row(inputs, t), c.inputs.dtype);
    if (const std::vector<double> own = stage_input_row(c, inputs, t); !own.empty()) {
      row["stage_input_bits"] = encode_row_bits(own, c.inputs.dtype);
    }
    rows.push_back(row);
  }
  if (overrides.empty()) the_case["inputs"].erase("overrides");
  // The pinned case must read back as a valid case (it is what replay and `run` will read).
  parse_case(the_case, "<bundle>");

  json backend = {{"device", context.device},
                  {"launcher", context.launcher},
                  {"processes", context.processes},
                  {"gpus", context.gpus}};
  if (run_json.contains("execution")) backend["execution"] = run_json["execution"];

  json ranks = json::array();
  for (const RankErrorCell& cell : map.ranks) {
    ranks.push_back({{"rank", cell.rank},
                     {"tp", cell.tp},
                     {"cp", cell.cp},
                     {"dp", cell.dp},
                     {"vocab_begin", cell.vocab_begin},
                     {"vocab_end", cell.vocab_end},
                     {"grad_margin", cell.grad_margin},
                     {"loss_margin", cell.loss_margin},
                     {"grad_mismatches", cell.grad_mismatches}});
  }
  json bundle = {
      {"format", kBundleFormat},
      {"tool",
       {{"name", "lossverify"},
        {"version", build_info::version},
        {"git_revision", build_info::git_revision},
        {"compiler", build_info::compiler},
        {"build_type", build_info::build_type}}},
      {"implementation", run.implementation->name},
      {"backend", backend},
      {"provenance",
       {{"case_file", c.source}, {"set_overrides", context.set_overrides}, {"command_line", context.command_line}}},
      {"seeds", {{"inputs", c.inputs.seed}, {"generator", "philox4x32-10"}}},
      {"case", the_case},
      {"failing_rows", rows},
      {"outcome",
       {{"verdict", std::string(to_string(run.verdict))},
        {"exit_code", run.verdict == Verdict::fail ? 1 : 0},
        {"checks", run_json.at("checks")},
        {"error_map", {{"ranks", ranks}}}}}};
  return encode_nonfinite(std::move(bundle));
}

Bundle parse_bundle(const json& document, const std::string& source) {
  Bundle b;
  b.path = source;
  b.document = document;
  ObjectReader root(document, "$", source);
  const std::string format = root.string("format");
  if (format != kBundleFormat) {
    root.fail("format", "unsupported bundle format \"" + format + "\" (this version reads " + kBundleFormat + ")");
  }
  {
    ObjectReader tool = root.object("tool");
    b.tool_version = tool.string("version");
    b.git_revision = tool.string("git_revision");
  }
  b.implementation = root.string("implementation");
  // A plugin is only named here: a bundle is data, and never loads a library (replay needs --impl for that).
  if (!is_plugin_spec(b.implementation) && find_implementation(b.implementation) == nullptr) {
    root.fail("implementation", "unknown implementation \"" + b.implementation + "\" (see `lossverify list`)");
  }
  {
    ObjectReader backend = root.object("backend");
    b.device = backend.string("device", "cpu");
    if (b.device != "cpu" && b.device != "cuda") {
      backend.fail("device", "expected cpu|cuda, got \"" + b.device + "\"");
    }
  }
  root.object("provenance");
  root.object("seeds");
  const json& case_document = root.raw("case");
  try {
    b.the_case = parse_case(case_document, source);
  } catch (const CaseError& e) {
    rethrow_in_case(e, source);
  }
  const Case& c = b.the_case;
  const bool labelled = kind_of(c.loss).inputs().labels;

  const json& rows = root.raw("failing_rows");
  if (!rows.is_array()) fail_at(source, "$.failing_rows", "expected array, got " + detail::json_type_name(rows));
  std::set<std::int64_t> seen;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::string path = "$.failing_rows[" + std::to_string(i) + "]";
    ObjectReader r(rows[i], path, source);
    RecordedRow row;
    row.token = r.integer("token");
    if (row.token < 0 || row.token >= c.shape.tokens) {
      r.fail("token", "token " + std::to_string(row.token) + " outside [0, " + std::to_string(c.shape.tokens) + ")");
    }
    if (!seen.insert(row.token).second) r.fail("token", "token " + std::to_string(row.token) + " recorded twice");
    row.pinned = r.boolean("pinned", false);
    r.boolean("pinned_label", false);
    const std::string dtype = r.string("dtype");
    if (dtype != to_string(c.inputs.dtype)) {
      r.fail("dtype",
             "\"" + dtype + "\" but $.case.inputs.dtype is \"" + std::string(to_string(c.inputs.dtype)) + "\"");
    }
    const json& bits = r.raw("logits_bits");
    if (!bits.is_string()) r.fail("logits_bits", "expected a string of hex words, got " + detail::json_type_name(bits));
    row.logits =
        decode_row_bits(bits.get<std::string>(), c.inputs.dtype, c.shape.vocab, source, r.path_of("logits_bits"));
    if (r.has("teacher_bits")) {
      if (!has_own_teacher(c))
        r.fail("teacher_bits",
               "only a case whose kind reads teacher logits, with its own teacher, records teacher rows");
      const json& t = r.raw("teacher_bits");
      if (!t.is_string()) r.fail("teacher_bits", "expected a string of hex words, got " + detail::json_type_name(t));
      row.teacher =
          decode_row_bits(t.get<std::string>(), c.inputs.dtype, c.shape.vocab, source, r.path_of("teacher_bits"));
    } else {
      r.allow("teacher_bits");
    }
    if (r.has("stage_input_bits")) {
      const std::int64_t width = c.loss.stage != nullptr ? c.loss.stage->token_input_width(c) : 0;
      if (width == 0) r.fail("stage_input_bits", "only a case whose stage has inputs of its own records their rows");
      const json& s = r.raw("stage_input_bits");
      if (!s.is_string()) {
        r.fail("stage_input_bits", "expected a string of hex words, got " + detail::json_type_name(s));
      }
      row.stage_input = decode_row_bits(s.get<std::string>(), c.inputs.dtype, width, source,
                                        r.path_of("stage_input_bits"), "the stage's input width");
    } else {
      r.allow("stage_input_bits");
    }
    if (r.has("label")) {
      if (!labelled) r.fail("label", std::string(kind_of(c.loss).name()) + " rows take no labels");
      row.label = r.integer("label");
    } else {
      r.allow("label");
    }
    for (const char* key : {"place", "worst_of", "grad_margin", "loss_margin", "valid"}) r.allow(key);
    if (r.has("place")) r.object("place");
    r.reject_unknown_keys();
    // The case must hold exactly these values for the token: the row pinned there, or the case's own row.
    const RowOverride* pinned = nullptr;
    std::size_t pinned_index = 0;
    for (std::size_t k = 0; k < c.inputs.overrides.size(); ++k) {
      if (c.inputs.overrides[k].token == row.token) {
        pinned = &c.inputs.overrides[k];
        pinned_index = k;
      }
    }
    if (row.pinned && (pinned == nullptr || pinned->logits.empty())) {
      fail_at(
          source, path + ".pinned",
          "the row is marked pinned but $.case.inputs.overrides has no logits for token " + std::to_string(row.token));
    }
    if (pinned != nullptr && !pinned->logits.empty()) {
      for (std::size_t v = 0; v < row.logits.size(); ++v) {
        if (bits_of(pinned->logits[v], c.inputs.dtype) != bits_of(row.logits[v], c.inputs.dtype)) {
          fail_at(source, path + ".logits_bits",
                  "word " + std::to_string(v) + " (" +
                      hex_word(bits_of(row.logits[v], c.inputs.dtype), c.inputs.dtype) +
                      ") disagrees with $.case.inputs.overrides[" + std::to_string(pinned_index) + "].logits[" +
                      std::to_string(v) + "] = " + json(pinned->logits[v]).dump() +
                      ": the bundle was edited; restore one from the other");
        }
      }
    }
    if (row.label && pinned != nullptr && pinned->label && *pinned->label != *row.label) {
      fail_at(source, path + ".label",
              std::to_string(*row.label) + " disagrees with $.case.inputs.overrides[" + std::to_string(pinned_index) +
                  "].label = " + std::to_string(*pinned->label));
    }
    b.rows.push_back(std::move(row));
  }

  ObjectReader outcome = root.object("outcome");
  b.verdict = parse_verdict(outcome.raw("verdict"), source, outcome.path_of("verdict"));
  const json& checks = outcome.raw("checks");
  if (!checks.is_array() || checks.empty()) {
    fail_at(source, outcome.path_of("checks"), "expected a non-empty array of checks");
  }
  std::set<std::string> names;
  bool any_fail = false;
  for (std::size_t i = 0; i < checks.size(); ++i) {
    const std::string path = outcome.path_of("checks") + "[" + std::to_string(i) + "]";
    ObjectReader r(checks[i], path, source);
    RecordedCheck check;
    check.name = r.string("name");
    if (!names.insert(check.name).second) r.fail("name", "check \"" + check.name + "\" recorded twice");
    check.verdict = parse_verdict(r.raw("verdict"), source, r.path_of("verdict"));
    check.margin = parse_margin(r.raw("margin"), source, r.path_of("margin"));
    any_fail = any_fail || check.verdict == Verdict::fail;
    if (r.has("worst") && !r.raw("worst").is_null()) {
      ObjectReader w = r.object("worst");
      RecordedElement e;
      e.token = optional_index(w.raw("token"), source, w.path_of("token")).value_or(-1);
      e.column = optional_index(w.raw("column"), source, w.path_of("column")).value_or(-1);
      const std::int64_t rank = w.integer("rank");
      if (rank < 0 || rank >= c.layout.world_size()) {
        w.fail("rank", "rank " + std::to_string(rank) + " outside [0, " + std::to_string(c.layout.world_size()) + ")");
      }
      e.rank = static_cast<int>(rank);
      check.worst = e;
    }
    b.checks.push_back(std::move(check));
  }
  if (any_fail != (b.verdict == Verdict::fail)) {
    fail_at(source, outcome.path_of("verdict"),
            std::string("\"") + std::string(to_string(b.verdict)) + "\" contradicts the recorded checks (" +
                (any_fail ? "one fails" : "none fails") + ")");
  }
  outcome.allow("exit_code");
  outcome.allow("error_map");
  outcome.reject_unknown_keys();
  root.reject_unknown_keys();
  return b;
}

Bundle read_bundle(const std::string& path) { return parse_bundle(detail::read_json_file(path, "bundle"), path); }

std::vector<std::string> input_drift(const Bundle& bundle) {
  std::vector<std::string> lines;
  // The case as it was before the rows were pinned: the generator's own values for those tokens.
  Case generated = bundle.the_case;
  for (const RecordedRow& row : bundle.rows) {
    if (!row.pinned) continue;
    for (RowOverride& o : generated.inputs.overrides) {
      if (o.token == row.token) o.logits.clear();
    }
  }
  std::map<std::int64_t, bool> pinned_label;
  for (std::size_t i = 0; i < bundle.rows.size(); ++i) {
    const json& r = bundle.document.at("failing_rows").at(i);
    pinned_label[bundle.rows[i].token] = r.value("pinned_label", false);
  }
  for (RowOverride& o : generated.inputs.overrides) {
    if (pinned_label.count(o.token) && pinned_label[o.token]) o.label.reset();
  }
  std::erase_if(generated.inputs.overrides, [](const RowOverride& o) { return o.logits.empty() && !o.label; });
  const InputSource inputs(generated);
  const DType dtype = generated.inputs.dtype;
  auto compare = [&](const RecordedRow& row, const std::vector<double>& now, const std::vector<double>& recorded,
                     const char* what) {
    for (std::size_t v = 0; v < recorded.size(); ++v) {
      if (bits_of(now[v], dtype) != bits_of(recorded[v], dtype)) {
        lines.push_back("token " + std::to_string(row.token) + ": this build generates " + what +
                        " that differ at column " + std::to_string(v) + " (recorded " +
                        hex_word(bits_of(recorded[v], dtype), dtype) + ", generated " +
                        hex_word(bits_of(now[v], dtype), dtype) + ")");
        return;
      }
    }
  };
  for (const RecordedRow& row : bundle.rows) {
    if (row.pinned) compare(row, student_row(inputs, row.token), row.logits, "logits");
    if (!row.teacher.empty()) compare(row, teacher_row(inputs, row.token), row.teacher, "teacher logits");
    if (!row.stage_input.empty()) {
      compare(row, stage_input_row(generated, inputs, row.token), row.stage_input, "stage inputs");
    }
    if (row.label && pinned_label[row.token] && inputs.label(row.token) != *row.label) {
      lines.push_back("token " + std::to_string(row.token) + ": this build generates label " +
                      std::to_string(inputs.label(row.token)) + ", the bundle recorded " + std::to_string(*row.label));
    }
  }
  return lines;
}

ReplayComparison compare_outcome(const Bundle& bundle, const RunResult& run, bool compare_worst) {
  ReplayComparison out;
  std::set<std::string> recorded;
  for (const RecordedCheck& rec : bundle.checks) {
    recorded.insert(rec.name);
    const auto it =
        std::find_if(run.checks.begin(), run.checks.end(), [&](const CheckResult& c) { return c.name == rec.name; });
    if (it == run.checks.end()) {
      out.differences.push_back("check " + rec.name + " was " + std::string(to_string(rec.verdict)) +
                                ", and this build has no such check");
      continue;
    }
    if (it->verdict != rec.verdict) {
      out.differences.push_back("check " + rec.name + " was " + std::string(to_string(rec.verdict)) + ", now " +
                                std::string(to_string(it->verdict)) + " (margin " + margin_text(rec.margin) + " -> " +
                                margin_text(it->margin) + ")");
      continue;
    }
    if (rec.verdict == Verdict::fail && compare_worst && rec.worst && it->worst) {
      const RecordedElement now{it->worst->token, it->worst->column, it->worst->rank};
      if (now.token != rec.worst->token || now.column != rec.worst->column || now.rank != rec.worst->rank) {
        out.differences.push_back("check " + rec.name + " still fails but its worst element moved from " +
                                  element_text(*rec.worst) + " to " + element_text(now));
        continue;
      }
    }
    const bool same_margin = rec.margin == it->margin || (std::isnan(rec.margin) && std::isnan(it->margin));
    if (!same_margin) {
      out.notes.push_back("check " + rec.name + ": margin " + margin_text(rec.margin) + " recorded, " +
                          margin_text(it->margin) + " now");
    }
  }
  for (const CheckResult& c : run.checks) {
    if (!recorded.count(c.name)) {
      out.notes.push_back("check " + c.name + " is new in this build (" + std::string(to_string(c.verdict)) + ")");
    }
  }
  out.reproduced = out.differences.empty();
  return out;
}

}  // namespace lossverify
