#include "lossverify/report/junit.hpp"

#include <sstream>

#include "lossverify/core/strings.hpp"

namespace lossverify {

using nlohmann::json;

namespace {

std::string text_of(const json& value) { return value.is_string() ? value.get<std::string>() : value.dump(); }

// As run_case's layout_name: tp2-sp-cp1-dp1-ga1 under sequence parallelism.
std::string layout_text(const json& layout) {
  const bool sp = layout.value("sp", false);
  return "tp" + text_of(layout.at("tp")) + (sp ? "-sp" : "") + "-cp" + text_of(layout.at("cp")) + "-dp" +
         text_of(layout.at("dp")) + "-ga" + text_of(layout.at("ga"));
}

void property(std::ostringstream& x, const std::string& name, const json& value) {
  x << "        <property name=\"" << xml_escape(name) << "\" value=\"" << xml_escape(text_of(value)) << "\"/>\n";
}

// A check's properties: its margin, and each control's margin with the band's reading.
void check_properties(std::ostringstream& x, const json& check) {
  x << "      <properties>\n";
  property(x, "margin", check.at("margin"));
  const json& control = check.value("control", json());
  if (control.is_object()) {
    for (const auto& [name, margin] : control.at("margins").items()) property(x, "control." + name, margin);
    property(x, "control.reading", control.at("reading"));
  }
  x << "      </properties>\n";
}

void run_suite(std::ostringstream& x, const json& run) {
  const std::string name = text_of(run.at("case").value("name", json("case"))) + "@" + layout_text(run.at("layout")) +
                           " " + text_of(run.at("implementation").at("name"));
  std::size_t tests = 0, failures = 0;
  for (const json& check : run.at("checks")) {
    ++tests;
    failures += check.at("verdict") == "fail";
  }
  x << "  <testsuite name=\"" << xml_escape(name) << "\" tests=\"" << tests << "\" failures=\"" << failures << "\">\n";
  for (const json& check : run.at("checks")) {
    x << "    <testcase classname=\"" << xml_escape(name) << "\" name=\"" << xml_escape(text_of(check.at("name")))
      << "\">\n";
    check_properties(x, check);
    const std::string verdict = text_of(check.at("verdict"));
    if (verdict == "fail") {
      const std::string message = "margin " + text_of(check.at("margin")) + ": " + text_of(check.value("summary", ""));
      x << "      <failure message=\"" << xml_escape(message) << "\"/>\n";
    } else if (verdict == "not_applicable") {
      x << "      <skipped message=\"" << xml_escape(text_of(check.value("summary", "not applicable"))) << "\"/>\n";
    }
    x << "    </testcase>\n";
  }
  x << "  </testsuite>\n";
}

}  // namespace

std::string report_junit(const json& report) {
  std::ostringstream x;
  std::size_t tests = 0, failures = 0;
  for (const json& run : report.value("runs", json::array())) {
    for (const json& check : run.at("checks")) {
      ++tests;
      failures += check.at("verdict") == "fail";
    }
  }
  x << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  x << "<testsuites name=\"lossverify " << xml_escape(text_of(report.at("command"))) << "\" tests=\"" << tests
    << "\" failures=\"" << failures << "\">\n";
  for (const json& run : report.value("runs", json::array())) run_suite(x, run);
  x << "</testsuites>\n";
  return x.str();
}

}  // namespace lossverify
