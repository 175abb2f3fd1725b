#include "lossverify/runner/gate.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <sstream>
#include <thread>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/report/report.hpp"

namespace lossverify {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A run's report in the gate's --run-reports folder, named after its case and implementation (any character
// a file name should not hold becomes '_': a plugin's path).
void write_run_report(const std::string& dir, const std::string& case_name, const std::string& what,
                      const std::vector<RunResult>& runs, const std::string& command) {
  if (dir.empty()) return;
  std::string name = case_name + "__" + what;
  for (char& ch : name) {
    const bool plain = std::isalnum(static_cast<unsigned char>(ch)) != 0 || ch == '-' || ch == '_' || ch == '.';
    if (!plain) ch = '_';
  }
  std::vector<json> reports;
  bool failed = false;
  for (const RunResult& run : runs) {
    reports.push_back(run_to_json(run));
    failed = failed || run.verdict == Verdict::fail;
  }
  const json report = make_report(command, reports, failed ? ExitCode::check_failed : ExitCode::pass);
  write_file_atomically((fs::path(dir) / (name + ".json")).string(), json_text(report, 2) + "\n");
}

json outcome_json(const GateCell& cell) {
  if (cell.verdict == "not_applicable") return {{"verdict", "not_applicable"}};
  return {{"verdict", cell.verdict}, {"failing_checks", cell.failing_checks}};
}

std::optional<json> read_golden(const fs::path& path) {
  if (!fs::exists(path)) return std::nullopt;
  std::ifstream in(path);
  try {
    json doc = json::parse(in);
    if (doc.value("format", "") != "lossverify.golden/1") {
      throw CaseError(path.string() + ": $.format: expected lossverify.golden/1");
    }
    return doc;
  } catch (const json::exception& e) {
    throw CaseError(path.string() + ": not valid golden JSON: " + e.what());
  }
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : std::string(",")) + item;
  return out;
}

}  // namespace

namespace {

// `timeout_seconds` > 0 overrides every case's deadlock-guard timeout (gate --timeout).
std::vector<Case> load_cases(const std::string& dir, double timeout_seconds) {
  if (!fs::is_directory(dir)) throw CaseError(dir + ": cases directory not found");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw CaseError(dir + ": no case files");
  std::vector<Case> cases;
  std::vector<std::string> overrides;
  if (timeout_seconds > 0.0) overrides.push_back("timeout_seconds=" + std::to_string(timeout_seconds));
  for (const auto& f : files) cases.push_back(load_case_file(f.string(), overrides));  // all validated before any run
  return cases;
}

// What the gate runs: each implementation and the golden row it must match.
struct GateEntry {
  const Implementation* implementation = nullptr;
  std::string expected_as;
};

std::vector<GateEntry> gate_entries(const GateOptions& options) {
  std::vector<GateEntry> entries;
  if (options.implementations.empty()) {
    for (const Implementation& impl : implementations()) entries.push_back({&impl, impl.name});
    return entries;
  }
  if (options.update_golden)
    throw CaseError("--update-golden rewrites every implementation's outcomes: leave out --impl");
  if (!options.expect.empty() && find_implementation(options.expect) == nullptr) {
    throw CaseError("--expect " + options.expect + ": unknown implementation (see `lossverify list`)");
  }
  for (const std::string& name : options.implementations) {
    const Implementation* impl = find_implementation(name);
    if (impl == nullptr) throw CaseError("--impl " + name + ": unknown implementation (see `lossverify list`)");
    const std::string own = impl->plugin != nullptr ? "correct" : impl->name;
    entries.push_back({impl, options.expect.empty() ? own : options.expect});
  }
  return entries;
}

GateCell run_cell(const Case& c, const GateEntry& entry, const std::optional<json>& golden, const fs::path& golden_path,
                  RunOptions run_options, bool update_golden, const std::string& reports_dir) {
  const Implementation& impl = *entry.implementation;
  GateCell cell;
  cell.case_name = c.name;
  cell.implementation = impl.name;
  cell.expected_as = entry.expected_as;
  const auto start = Clock::now();
  if (golden && golden->at("outcomes").contains(entry.expected_as))
    cell.expected = golden->at("outcomes").at(entry.expected_as);
  // Where golden says the expected behaviour cannot reach this loss, the cell is not run (a plugin carrying a
  // cross-entropy bug on a KD case computes KD correctly, as the built-in switch does).
  const bool inapplicable = cell.expected && cell.expected->value("verdict", "") == "not_applicable";
  const bool runs = applies_to(impl, c.loss) && !inapplicable;
  if (!runs) {
    cell.verdict = "not_applicable";
  } else {
    run_options.implementation = impl.name;
    const RunResult run = run_case(c, run_options);
    write_run_report(reports_dir, c.name, impl.name, {run}, "run");
    cell.verdict = std::string(to_string(run.verdict));
    for (const CheckResult& check : run.checks) {
      if (check.verdict == Verdict::fail) cell.failing_checks.push_back(check.name);
      if (check.verdict != Verdict::not_applicable) cell.margin = std::max(cell.margin, check.margin);
    }
    std::sort(cell.failing_checks.begin(), cell.failing_checks.end());
  }
  cell.seconds = seconds_since(start);
  const json got = outcome_json(cell);
  // A plugin that does not compute this loss is skipped, whatever golden expects of the built-in row.
  const bool unsupported_by_plugin = !runs && impl.plugin != nullptr;
  cell.matches = update_golden || unsupported_by_plugin || (cell.expected && *cell.expected == got);
  if (!cell.matches) {
    cell.detail = cell.expected ? "golden " + cell.expected->dump() +
                                      (entry.expected_as == impl.name ? "" : " (of " + entry.expected_as + ")") +
                                      ", got " + got.dump()
                                : "no golden outcome for this cell (" + golden_path.string() +
                                      "); run `lossverify gate --update-golden` and review the diff";
  }
  return cell;
}

GateSweep run_gate_sweep(const Case& c, const Implementation& impl, const std::optional<json>& golden,
                         RunOptions run_options, bool update_golden, const std::string& reports_dir) {
  GateSweep sweep;
  sweep.case_name = c.name;
  sweep.implementation = impl.name;
  const auto start = Clock::now();
  run_options.implementation = impl.name;
  const std::vector<LayoutSpec> layouts = sweep_layouts(c);
  const SweepResult s = run_sweep(c, layouts, run_options);
  write_run_report(reports_dir, c.name, "sweep", s.runs, "sweep");
  for (const auto& l : layouts) sweep.layouts.push_back(layout_name(l));
  sweep.verdict = std::string(to_string(s.verdict));
  std::vector<std::string> failing;
  for (std::size_t k = 0; k < s.runs.size(); ++k) {
    if (s.runs[k].verdict == Verdict::fail) failing.push_back(sweep.layouts[k]);
  }
  if (s.invariance.verdict == Verdict::fail) failing.push_back("invariance");
  sweep.failing_layouts = join(failing);
  sweep.invariance_margin = s.invariance.margin;
  sweep.seconds = seconds_since(start);
  if (golden && golden->contains("sweep")) sweep.expected = golden->at("sweep").value("verdict", "");
  sweep.matches = update_golden || (sweep.expected && *sweep.expected == sweep.verdict);
  return sweep;
}

// Mutation score: a bug is caught when it fails at least one case; its detection margin is the largest
// margin among the cases that catch it. The gate reports the smallest of those over all bugs. Cells judged
// as the correct implementation give the false alarms and the largest margin of a correct run.
void score(GateResult& result, const std::vector<GateEntry>& entries) {
  result.smallest_detection_margin = std::numeric_limits<double>::infinity();
  for (const GateCell& cell : result.cells) {
    if (cell.expected_as != "correct") continue;
    if (cell.verdict == "fail") ++result.false_alarms;
    result.largest_correct_margin = std::max(result.largest_correct_margin, cell.margin);
  }
  for (const GateSweep& sweep : result.sweeps) result.false_alarms += sweep.verdict == "fail";
  for (const GateEntry& entry : entries) {
    if (entry.expected_as == "correct") continue;
    const std::string& name = entry.implementation->name;
    bool ran = false;
    double best = 0.0;
    std::string where;
    for (const GateCell& cell : result.cells) {
      if (cell.implementation != name || cell.verdict == "not_applicable") continue;
      ran = true;
      if (cell.verdict == "fail" && cell.margin > best) {
        best = cell.margin;
        where = cell.case_name;
      }
    }
    if (!ran) continue;
    ++result.bugs_run;
    if (best > 0.0) {
      ++result.bugs_caught;
      if (best < result.smallest_detection_margin) {
        result.smallest_detection_margin = best;
        result.smallest_detection = name + " on " + where;
      }
    } else {
      result.uncaught_bugs.push_back(name);
    }
  }
}

}  // namespace

GateResult run_gate(const GateOptions& options) {
  const auto start = Clock::now();
  GateResult result;
  const std::vector<Case> cases = load_cases(options.cases_dir, options.timeout_seconds);
  const std::vector<GateEntry> entries = gate_entries(options);
  for (const GateEntry& entry : entries) result.implementations.push_back(entry.implementation->name);

  if (options.update_golden && options.device == RunOptions::Device::cuda) {
    throw CaseError(
        "--update-golden --backend cuda: golden outcomes are written from the CPU backend; "
        "the GPU gate is judged against them");
  }
  RunOptions run_options;
  run_options.threads = options.threads;
  run_options.device = options.device;
  run_options.gpus = options.gpus;
  if (options.device == RunOptions::Device::cuda) {
    result.backend = "cuda";
    result.gpus = options.gpus;
  }
  for (const Case& c : cases) {
    result.cases.push_back(c.name);
    const fs::path golden_path = fs::path(options.golden_dir) / (c.name + ".json");
    const std::optional<json> golden = options.update_golden ? std::nullopt : read_golden(golden_path);
    json new_golden = {{"format", "lossverify.golden/1"}, {"case", c.name}, {"outcomes", json::object()}};
    // One input set per case, generated once and shared by every implementation and sweep layout.
    InputSource inputs(c);
    inputs.materialize(options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency()),
                       kMaterializeLimitBytes);
    run_options.shared_inputs = &inputs;
    for (const GateEntry& entry : entries) {
      GateCell cell =
          run_cell(c, entry, golden, golden_path, run_options, options.update_golden, options.run_reports_dir);
      new_golden["outcomes"][cell.implementation] = outcome_json(cell);
      result.mismatches += !cell.matches;
      result.cells.push_back(std::move(cell));
      if (!options.quiet) std::cerr << "." << std::flush;
    }
    if (!c.sweep.empty()) {
      for (const GateEntry& entry : entries) {
        if (entry.expected_as != "correct" || !applies_to(*entry.implementation, c.loss)) continue;
        GateSweep sweep = run_gate_sweep(c, *entry.implementation, golden, run_options, options.update_golden,
                                         options.run_reports_dir);
        new_golden["sweep"] = {{"verdict", sweep.verdict}, {"layouts", sweep.layouts}};
        result.mismatches += !sweep.matches;
        result.sweeps.push_back(std::move(sweep));
      }
    }
    if (options.update_golden) {
      fs::create_directories(options.golden_dir);
      write_file_atomically(golden_path.string(), json_text(new_golden, 2) + "\n");
      result.golden_updated = true;
    }
  }
  if (!options.quiet) std::cerr << "\n";
  score(result, entries);
  result.wall_seconds = seconds_since(start);
  return result;
}

void print_gate_matrix(std::ostream& out, const GateResult& r) {
  out << "lossverify gate: " << r.cases.size() << " cases x " << r.implementations.size() << " implementations"
      << (r.backend == "cuda" ? " on CUDA (" + std::to_string(r.gpus) + " GPU" + (r.gpus > 1 ? "s)" : ")") : "")
      << "\n";
  out << "cases:\n";
  for (std::size_t k = 0; k < r.cases.size(); ++k)
    out << "  " << std::setw(2) << k + 1 << " " << printable(r.cases[k]) << "\n";
  out << "\n" << std::left << std::setw(30) << "implementation";
  for (std::size_t k = 0; k < r.cases.size(); ++k) out << std::right << std::setw(3) << k + 1;
  out << "\n";
  for (const std::string& impl : r.implementations) {
    out << std::left << std::setw(30) << printable(impl);
    for (const std::string& name : r.cases) {
      const auto it = std::find_if(r.cells.begin(), r.cells.end(),
                                   [&](const GateCell& c) { return c.case_name == name && c.implementation == impl; });
      char mark = '?';
      if (it != r.cells.end()) {
        mark = it->verdict == "not_applicable" ? '-' : it->verdict == "pass" ? '.' : 'X';
        if (!it->matches) mark = '!';
      }
      out << std::right << std::setw(3) << mark;
    }
    out << "\n";
  }
  out << "  . pass   X caught (fails as golden says)   - not applicable   ! differs from golden\n";
  for (const GateSweep& s : r.sweeps) {
    out << "sweep " << printable(s.case_name) << ": " << s.layouts.size() << " layouts, " << s.verdict
        << (s.failing_layouts.empty() ? "" : " (" + s.failing_layouts + ")") << ", invariance margin "
        << std::setprecision(3) << s.invariance_margin << (s.matches ? "" : "  ! differs from golden") << "\n";
  }
  for (const GateCell& c : r.cells) {
    if (!c.matches) {
      out << "MISMATCH " << printable(c.case_name) << " --impl " << printable(c.implementation) << ": "
          << printable(c.detail) << "\n";
    }
  }
  for (const auto& bug : r.uncaught_bugs) out << "UNCAUGHT " << bug << ": passes every shipped case\n";
  out << std::defaultfloat << std::setprecision(4);
  out << "mutation score: " << r.bugs_caught << "/" << r.bugs_run << " bugs caught\n";
  out << "false alarms on the correct implementation: " << r.false_alarms << "\n";
  out << "smallest detection margin: " << r.smallest_detection_margin << " (" << r.smallest_detection << ")\n";
  out << "largest margin of the correct implementation: " << r.largest_correct_margin << " (must stay < 1)\n";
  out << "golden: " << (r.golden_updated ? "rewritten" : std::to_string(r.mismatches) + " mismatches") << "\n";
  out << std::setprecision(1) << std::fixed << "wall time: " << r.wall_seconds << " s\n" << std::defaultfloat;
  if (r.ran() == 0) out << "NOTHING RAN: every cell was skipped (no case of a loss the implementations compute)\n";
  out << "gate: " << (r.passed() ? "PASS" : "FAIL") << "\n";
}

json gate_report(const GateResult& r) {
  json cells = json::array();
  for (const GateCell& c : r.cells) {
    cells.push_back({{"case", c.case_name},
                     {"implementation", c.implementation},
                     {"verdict", c.verdict},
                     {"failing_checks", c.failing_checks},
                     {"margin", c.margin},
                     {"expected", c.expected ? *c.expected : json(nullptr)},
                     {"matches", c.matches},
                     {"seconds", c.seconds}});
  }
  json sweeps = json::array();
  for (const GateSweep& s : r.sweeps) {
    sweeps.push_back({{"case", s.case_name},
                      {"layouts", s.layouts},
                      {"verdict", s.verdict},
                      {"failing", s.failing_layouts},
                      {"invariance_margin", s.invariance_margin},
                      {"expected", s.expected ? json(*s.expected) : json(nullptr)},
                      {"matches", s.matches},
                      {"seconds", s.seconds}});
  }
  json report = make_report("gate", {}, r.passed() ? ExitCode::pass : ExitCode::check_failed);
  report.erase("runs");
  report["gate"] = {{"cases", r.cases},
                    {"implementations", r.implementations},
                    {"bugs_run", r.bugs_run},
                    {"bugs_caught", r.bugs_caught},
                    {"mutation_score", r.bugs_run > 0 ? static_cast<double>(r.bugs_caught) / r.bugs_run : 0.0},
                    {"uncaught_bugs", r.uncaught_bugs},
                    {"false_alarms", r.false_alarms},
                    {"mismatches", r.mismatches},
                    {"smallest_detection_margin", r.smallest_detection_margin},
                    {"smallest_detection", r.smallest_detection},
                    {"largest_correct_margin", r.largest_correct_margin},
                    {"wall_seconds", r.wall_seconds},
                    {"backend", r.backend},
                    {"gpus", r.gpus},
                    {"peak_rss_bytes", peak_resident_bytes()},
                    {"cells", cells},
                    {"sweeps", sweeps}};
  report["verdict"] = r.passed() ? "pass" : "fail";
  return encode_nonfinite(report);
}

std::string gate_junit(const GateResult& r) {
  std::ostringstream x;
  std::size_t tests = 0;
  std::size_t failures = 0;
  for (const GateCell& c : r.cells) {
    ++tests;
    failures += !c.matches;
  }
  for (const GateSweep& s : r.sweeps) {
    ++tests;
    failures += !s.matches;
  }
  x << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  x << "<testsuites name=\"lossverify gate\" tests=\"" << tests << "\" failures=\"" << failures << "\" time=\""
    << r.wall_seconds << "\">\n";
  for (const std::string& name : r.cases) {
    std::size_t case_tests = 0;
    std::size_t case_failures = 0;
    for (const GateCell& c : r.cells) {
      if (c.case_name != name) continue;
      ++case_tests;
      case_failures += !c.matches;
    }
    x << "  <testsuite name=\"" << xml_escape(name) << "\" tests=\"" << case_tests << "\" failures=\"" << case_failures
      << "\">\n";
    for (const GateCell& c : r.cells) {
      if (c.case_name != name) continue;
      x << "    <testcase classname=\"" << xml_escape(name) << "\" name=\"" << xml_escape(c.implementation)
        << "\" time=\"" << c.seconds << "\"";
      if (c.matches && c.verdict != "not_applicable") {
        x << "/>\n";
        continue;
      }
      x << ">\n";
      if (!c.matches) {
        x << "      <failure message=\"" << xml_escape(c.detail) << "\">" << xml_escape(c.detail) << "</failure>\n";
      } else {
        x << "      <skipped message=\"the bug's switches do not reach this loss\"/>\n";
      }
      x << "    </testcase>\n";
    }
    for (const GateSweep& s : r.sweeps) {
      if (s.case_name != name) continue;
      x << "    <testcase classname=\"" << xml_escape(name) << "\" name=\"sweep\" time=\"" << s.seconds << "\"";
      if (s.matches) {
        x << "/>\n";
      } else {
        x << ">\n      <failure message=\"sweep " << xml_escape(s.verdict + " " + s.failing_layouts)
          << "\"/>\n    </testcase>\n";
      }
    }
    x << "  </testsuite>\n";
  }
  x << "</testsuites>\n";
  return x.str();
}

}  // namespace lossverify
