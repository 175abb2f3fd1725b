#include "lossverify/report/report.hpp"
#include "lossverify/core/strings.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <thread>

#include "lossverify/core/atomic_file.hpp"
#include "lossverify/core/build_info.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/runner/control_band.hpp"

namespace lossverify {

using nlohmann::json;

namespace {

// The worst element, located in the global problem and in the layout: for a CP layout a reviewer reads
// "sequence 5, position 17, CP rank 1, chunk 2" rather than a bare token index.
json record_to_json(const std::optional<ElementRecord>& r, const Case& c, const GlobalBatch& batch) {
  if (!r) return nullptr;
  json j = {{"rank", r->rank}, {"expected", r->expected}, {"got", r->got}, {"tolerance", r->tolerance}};
  j["token"] = r->token >= 0 ? json(r->token) : json(nullptr);
  j["column"] = r->column >= 0 ? json(r->column) : json(nullptr);
  if (r->token >= 0) {
    const TokenPlace p = locate_token(batch, c.batch, c.layout, r->token);
    j["sequence"] = p.sequence;
    j["position"] = p.position;
    j["dp_rank"] = p.dp;
    j["micro_batch"] = p.micro_batch;
    j["cp_rank"] = p.cp;
    j["chunk"] = p.chunk;
  } else if (r->padding_sequence >= 0) {
    j["padding"] = true;
    j["sequence"] = r->padding_sequence;
    j["position"] = r->padding_position;
  }
  return j;
}

std::string format_number(double v, int precision = 3) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s << std::setprecision(precision) << v;
  return s.str();
}

}  // namespace

// The control column: "control f32 / bf16" and each check's "0.0213 / 0.48" ("... above" where it reads so).
std::string control_column_header(const RunResult& run) {
  if (run.controls.empty()) return {};
  std::string header = "control";
  for (std::size_t k = 0; k < run.controls.size(); ++k) {
    header += (k == 0 ? " " : " / ") + (run.controls[k].name == "float32" ? std::string("f32") : run.controls[k].name);
  }
  return header;
}

std::string control_cell(const RunResult& run, const CheckResult& check) {
  const std::optional<CheckBand> band = band_of(run, check);
  if (!band) return "-";
  std::string cell;
  for (std::size_t k = 0; k < band->margins.size(); ++k)
    cell += (k == 0 ? "" : " / ") + format_number(band->margins[k]);
  if (band->reading != BandReading::within) cell += band->reading == BandReading::above ? " above" : " far above";
  return cell;
}

std::size_t control_column_width(const RunResult& run) {
  std::size_t width = control_column_header(run).size();
  for (const CheckResult& check : run.checks) width = std::max(width, control_cell(run, check).size());
  return width + 2;
}

std::int64_t peak_resident_bytes() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;  // Linux reports kilobytes
}

json encode_nonfinite(json value) {
  if (value.is_number_float()) {
    const double v = value.get<double>();
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
    return value;
  }
  if (value.is_object() || value.is_array()) {
    for (auto& item : value) item = encode_nonfinite(std::move(item));
  }
  return value;
}

double decode_number(const json& value) {
  if (value.is_string()) {
    const auto s = value.get<std::string>();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return value.get<double>();
}

namespace {

json check_json(const CheckResult& c, const Case& the_case, const GlobalBatch& batch) {
  json j = {{"name", c.name},       {"verdict", std::string(to_string(c.verdict))},
            {"margin", c.margin},   {"summary", c.summary},
            {"metrics", c.metrics}, {"worst", record_to_json(c.worst, the_case, batch)}};
  j["tolerance"] = nullptr;
  if (c.tolerance) {
    j["tolerance"] = {{"atol", c.tolerance->atol}, {"rtol", c.tolerance->rtol}};
    if (c.tolerance->max_ulp > 0) j["tolerance"]["max_ulp"] = c.tolerance->max_ulp;
  }
  return j;
}

}  // namespace

json check_to_json(const CheckResult& check, const Case& the_case) {
  return encode_nonfinite(check_json(check, the_case, GlobalBatch(the_case.batch)));
}

namespace {
// This process's high-water mark, and each rank's when every rank is a process of its own (MPI).
json resources_json(const RunResult& run) {
  json resources = {{"peak_rss_bytes", peak_resident_bytes()}};
  if (!run.peak_rss_per_rank.empty()) resources["peak_rss_bytes_per_rank"] = run.peak_rss_per_rank;
  return resources;
}
}  // namespace

namespace {
// A check's control band: each control's margin, the band's ends and how the check's margin reads.
json band_json(const RunResult& run, const CheckResult& check) {
  const std::optional<CheckBand> band = band_of(run, check);
  if (!band) return nullptr;
  json margins = json::object();
  for (std::size_t k = 0; k < run.controls.size(); ++k) margins[run.controls[k].name] = band->margins[k];
  return {{"margins", margins}, {"low", band->low}, {"high", band->high}, {"reading", to_string(band->reading)}};
}

// The run's controls: what each computed and how long it took, and the band's notes.
json controls_json(const RunResult& run) {
  json controls = json::array();
  for (const ControlRun& control : run.controls) {
    controls.push_back(
        {{"name", control.name}, {"implementation", control.implementation}, {"seconds", control.seconds}});
  }
  return {{"controls", controls}, {"notes", band_notes(run)}};
}
}  // namespace

json run_to_json(const RunResult& run) {
  const GlobalBatch batch(run.the_case.batch);
  json checks = json::array();
  for (const CheckResult& c : run.checks) {
    checks.push_back(check_json(c, run.the_case, batch));
    if (!run.controls.empty()) checks.back()["control"] = band_json(run, c);
  }
  const Implementation& impl = *run.implementation;
  json run_json = {{"case", run.the_case.resolved()},
                   {"case_file", run.the_case.source},
                   {"implementation",
                    {{"name", impl.name},
                     {"summary", impl.summary},
                     {"source", impl.source},
                     {"expected_failures", impl.caught_by}}},
                   {"layout",
                    {{"tp", run.the_case.layout.tp},
                     {"cp", run.the_case.layout.cp},
                     {"dp", run.the_case.layout.dp},
                     {"ga", run.the_case.layout.ga},
                     {"sp", run.the_case.layout.sp},
                     {"ranks", run.ranks}}},
                   {"verdict", std::string(to_string(run.verdict))},
                   {"execution",
                    {{"device", run.execution.device},
                     {"gpus", run.execution.gpus},
                     {"collectives", run.execution.collectives},
                     {"reference", run.execution.reference}}},
                   {"checks", checks},
                   {"resources", resources_json(run)},
                   {"timings_seconds",
                    {{"ranks_wall", run.timings.ranks_wall},
                     {"generate_max_rank", run.timings.generate_max},
                     {"compute_max_rank", run.timings.compute_max},
                     {"collectives_max_rank", run.timings.collectives_max},
                     {"reference_and_checks", run.timings.reference_and_checks},
                     {"total", run.timings.total}}}};
  if (!run.hints.empty()) run_json["hints"] = run.hints;
  if (!run.controls.empty()) run_json["control"] = controls_json(run);
  return run_json;
}

json make_report(const std::string& command, const std::vector<json>& runs, ExitCode exit_code,
                 const std::string& backend, int processes) {
  std::string verdict = "pass";
  for (const json& r : runs) {
    if (r.at("verdict") == "fail") verdict = "fail";
  }
  json report = {
      {"schema_version", kReportSchemaVersion},
      {"tool", {{"name", "lossverify"}, {"version", build_info::version}, {"git_revision", build_info::git_revision}}},
      {"environment",
       {{"backend", backend},
        {"processes", processes},
        {"compiler", build_info::compiler},
        {"build_type", build_info::build_type},
        {"hardware_threads", std::thread::hardware_concurrency()},
        {"mpi_found_at_build", build_info::have_mpi},
        {"cuda_found_at_build", build_info::have_cuda},
        {"nccl_found_at_build", build_info::have_nccl}}},
      {"command", command},
      {"verdict", verdict},
      {"exit_code", static_cast<int>(exit_code)},
      {"runs", runs}};
  return encode_nonfinite(std::move(report));
}

std::string json_text(const nlohmann::json& document, int indent) {
  return document.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  AtomicFile file(path, "report");
  file.write(contents);
  file.commit();
}

void print_summary(std::ostream& out, const RunResult& run) {
  const Case& c = run.the_case;
  const GlobalBatch batch(c.batch);
  const bool show_place = c.batch.sequence_lengths.size() > 1 || c.layout.cp > 1 || c.layout.dp > 1 || c.layout.ga > 1;
  out << "case " << printable(c.name) << "  [" << to_string(c.loss.kind) << ", N=" << c.shape.tokens
      << " V=" << c.shape.vocab << ", " << to_string(c.inputs.dtype) << ", tp=" << c.layout.tp << " cp=" << c.layout.cp
      << " dp=" << c.layout.dp << " ga=" << c.layout.ga << "]  impl " << printable(run.implementation->name) << "\n";
  const std::string control_header = control_column_header(run);
  const int control_width = static_cast<int>(control_column_width(run));
  out << "  " << std::left << std::setw(16) << "check" << std::setw(16) << "verdict" << std::setw(11) << "margin";
  if (!control_header.empty()) out << std::setw(control_width) << control_header;
  out << std::setw(12) << "max abs err"
      << "worst (token, column, rank: expected -> got)\n";
  for (const CheckResult& check : run.checks) {
    std::string worst = "-";
    if (check.worst && check.margin > 0.0) {
      const ElementRecord& w = *check.worst;
      worst = "(" + (w.token >= 0 ? std::to_string(w.token) : std::string("-")) + ", " +
              (w.column >= 0 ? std::to_string(w.column) : std::string("-")) + ", " + std::to_string(w.rank) + ": " +
              format_number(w.expected, 6) + " -> " + format_number(w.got, 6) + ")";
      if (show_place && w.token >= 0) {
        const TokenPlace p = locate_token(batch, c.batch, c.layout, w.token);
        worst += " seq " + std::to_string(p.sequence) + " pos " + std::to_string(p.position) + ", dp " +
                 std::to_string(p.dp) + " mb " + std::to_string(p.micro_batch) + ", cp " + std::to_string(p.cp) +
                 " chunk " + std::to_string(p.chunk);
      } else if (w.padding_sequence >= 0) {
        worst += " padding of seq " + std::to_string(w.padding_sequence) + " pos " + std::to_string(w.padding_position);
      }
    }
    std::string max_abs = "-";
    if (check.metrics.contains("max_abs_error")) max_abs = format_number(check.metrics["max_abs_error"].get<double>());
    if (check.metrics.contains("per_token")) {
      max_abs = format_number(check.metrics["per_token"]["max_abs_error"].get<double>());
    }
    if (check.name == "finite") max_abs = std::to_string(check.metrics["nonfinite"].get<std::int64_t>()) + " bad";
    const std::string verdict = check.verdict == Verdict::fail ? "FAIL" : std::string(to_string(check.verdict));
    out << "  " << std::left << std::setw(16) << check.name << std::setw(16) << verdict << std::setw(11)
        << format_number(check.margin);
    if (!control_header.empty()) out << std::setw(control_width) << control_cell(run, check);
    out << std::setw(12) << max_abs << worst << "\n";
  }
  for (const std::string& note : band_notes(run)) out << "  note: " << note << "\n";
  out << "  verdict: " << (run.verdict == Verdict::fail ? "FAIL" : "pass") << "   (" << std::fixed
      << std::setprecision(2) << run.timings.total << " s)\n"
      << std::defaultfloat;
}

}  // namespace lossverify
