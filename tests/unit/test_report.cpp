#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "lossverify/report/report.hpp"

using namespace lossverify;

TEST_CASE("non_finite_numbers_are_encoded_explicitly_and_decode_back") {
  nlohmann::json j = {{"a", std::numeric_limits<double>::infinity()},
                      {"b", {-std::numeric_limits<double>::infinity(), std::nan("")}},
                      {"c", 0.1}};
  const nlohmann::json e = encode_nonfinite(j);
  CHECK(e["a"] == "Infinity");
  CHECK(e["b"][0] == "-Infinity");
  CHECK(e["b"][1] == "NaN");
  CHECK(std::isnan(decode_number(e["b"][1])));
  CHECK(decode_number(e["a"]) == std::numeric_limits<double>::infinity());
  const std::string text = e.dump();
  CHECK(nlohmann::json::parse(text) == e);  // valid JSON
}

TEST_CASE("finite_doubles_round_trip_through_the_report_text") {
  const double values[] = {0.1 + 0.2, 1.0 / 3.0, 5e-324, 1.7976931348623157e308, -2.2250738585072014e-308};
  for (double v : values) {
    const nlohmann::json parsed = nlohmann::json::parse(encode_nonfinite(nlohmann::json(v)).dump());
    CHECK(parsed.get<double>() == v);
  }
}

TEST_CASE("reports_are_written_atomically_and_leave_no_temporary_file") {
  const auto dir = std::filesystem::temp_directory_path() / "lossverify_report_test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto path = (dir / "r.json").string();
  write_file_atomically(path, "{\"old\": 1}\n");
  write_file_atomically(path, "{\"new\": 2}\n");
  std::ifstream in(path);
  CHECK(nlohmann::json::parse(in)["new"] == 2);
  CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator{}) == 1);
  CHECK_THROWS_AS(write_file_atomically((dir / "missing" / "r.json").string(), "{}"), CaseError);  // exit 2
  std::filesystem::remove_all(dir);
}
