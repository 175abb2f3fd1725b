#pragma once
// The JSON report (schema/report.schema.json, "lossverify.report/1") and the human summary.
// Non-finite numbers are written as the strings "NaN", "Infinity" and "-Infinity" (the protobuf JSON
// mapping's convention), never as invalid JSON or as a silent null; finite doubles round-trip.
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/core/errors.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify {

inline constexpr const char* kReportSchemaVersion = "lossverify.report/1";

nlohmann::json run_to_json(const RunResult& run);
// One check as the report writes it (a sweep's invariance check); worst elements are located in `the_case`.
nlohmann::json check_to_json(const CheckResult& check, const Case& the_case);

// The whole report of one command: tool, environment, every run, overall verdict and exit code.
nlohmann::json make_report(const std::string& command, const std::vector<nlohmann::json>& runs, ExitCode exit_code,
                           const std::string& backend = "cpu-threads", int processes = 1);

// Replaces NaN and infinities anywhere in the document by their string encodings.
nlohmann::json encode_nonfinite(nlohmann::json value);
// Number from a report field written by encode_nonfinite.
double decode_number(const nlohmann::json& value);

// Writes to a temporary file in the same directory, flushes it to disk and renames it over `path`:
// readers see the old file or the whole new one, never a partial report.
void write_file_atomically(const std::string& path, const std::string& contents);

// A JSON document as text; bytes that are not UTF-8 (a case path, a --set value) become U+FFFD instead of
// throwing.
std::string json_text(const nlohmann::json& document, int indent = -1);

// Peak resident set of this process so far (the high-water mark), in bytes.
std::int64_t peak_resident_bytes();

void print_summary(std::ostream& out, const RunResult& run);

// The terminal table's control column (runner/control_band.hpp): its header ("control f32 / bf16"; empty
// without controls), a check's cell ("0.0213 / 0.48", then "above" or "far above" where it reads so), and
// the width that holds them all.
std::string control_column_header(const RunResult& run);
std::string control_cell(const RunResult& run, const CheckResult& check);
std::size_t control_column_width(const RunResult& run);

}  // namespace lossverify
