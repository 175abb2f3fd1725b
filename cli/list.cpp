#include "list.hpp"

#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "lossverify/checks/checks.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "options.hpp"

namespace lossverify::cli {

namespace {

// One setting of a kind's table as `list --json` gives it (the Python package reads the fallbacks from here).
nlohmann::json describe_setting(const Setting& s) {
  static const char* const kTypes[] = {"number", "integer", "boolean", "choice"};
  nlohmann::json d = {{"key", s.key},
                      {"type", kTypes[static_cast<int>(s.type)]},
                      {"default", s.fallback},
                      {"allowed", s.allowed()},
                      {"meaning", s.meaning}};
  if (!s.fallback_from.empty()) d["default_from"] = s.fallback_from;
  if (s.type == Setting::Type::choice) d["choices"] = s.choices;
  if (s.applies) {
    d["applies_to"] = s.applies->words;
    d["applies_when"] = {{"key", s.applies->key}, {"values", s.applies->values}};
  }
  return d;
}

// A kind's or a stage's entry: its name, summary and settings table.
nlohmann::json describe_table(std::string_view name, std::string_view summary, const SettingTable& table) {
  nlohmann::json settings = nlohmann::json::array();
  for (const Setting& s : table) settings.push_back(describe_setting(s));
  return {{"name", std::string(name)}, {"summary", std::string(summary)}, {"settings", settings}};
}

void print_tables(const nlohmann::json& entries) {
  for (const auto& l : entries) {
    std::cout << "  " << l["name"].get<std::string>() << "  " << l["summary"].get<std::string>() << "\n";
    for (const auto& s : l["settings"]) {
      std::cout << "      " << s["key"].get<std::string>() << ": " << s["allowed"].get<std::string>() << ", default "
                << s["default"].dump()
                << (s.contains("applies_to") ? ", under " + s["applies_to"].get<std::string>() : "")
                << (s["meaning"].get<std::string>().empty() ? "" : " -- " + s["meaning"].get<std::string>()) << "\n";
    }
  }
}

}  // namespace

int run_list(bool as_json) {
  nlohmann::json doc;
  doc["losses"] = nlohmann::json::array();
  for (const LossKind* kind : loss_kinds()) {
    doc["losses"].push_back(describe_table(kind->name(), kind->summary(), kind->settings()));
  }
  doc["stages"] = nlohmann::json::array();
  for (const Stage* stage : stages()) {
    doc["stages"].push_back(describe_table(stage->name(), stage->summary(), stage->settings()));
  }
  nlohmann::json impls = nlohmann::json::array();
  for (const auto& i : implementations()) {
    impls.push_back({{"name", i.name},
                     {"summary", i.summary},
                     {"source", i.source},
                     {"signal", i.signal},
                     {"caught_by", i.caught_by}});
  }
  doc["implementations"] = impls;
  nlohmann::json controls = nlohmann::json::array();
  for (const auto& i : control_implementations()) controls.push_back({{"name", i.name}, {"summary", i.summary}});
  doc["controls"] = controls;
  nlohmann::json checks = nlohmann::json::array();
  for (const auto& c : check_catalogue()) checks.push_back({{"name", c.name}, {"description", c.description}});
  doc["checks"] = checks;
  if (as_json) {
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  std::cout << "losses (loss.kind) and their settings (loss.KEY):\n";
  print_tables(doc["losses"]);
  std::cout << "\nstages in front of a loss (stage.kind) and their settings (stage.KEY):\n";
  print_tables(doc["stages"]);
  std::cout << "\nimplementations (--impl):\n";
  for (const auto& i : implementations()) {
    std::cout << "  " << i.name << "\n      " << i.summary << "\n";
    if (i.name != "correct") {
      std::string caught;
      for (const auto& c : i.caught_by) append_to_list(caught, c);
      std::cout << "      source: " << i.source << "\n      signal: " << i.signal << "\n      caught by: " << caught
                << "\n";
    }
  }
  std::cout << "\ncontrols (--impl; the control band's, not bugs: docs/checks.md):\n";
  for (const auto& i : control_implementations()) std::cout << "  " << i.name << "\n      " << i.summary << "\n";
  std::cout << "\nchecks:\n";
  for (const auto& c : check_catalogue()) std::cout << "  " << c.name << "  " << c.description << "\n";
  return 0;
}

void register_list(CLI::App& app, ListCommand& command) {
  command.app = app.add_subcommand("list", "list losses, implementations (correct and catalogued bugs), checks");
  command.app->add_flag("--json", command.json, "machine-readable output");
  command.app->footer(exit_codes("0"));
}

}  // namespace lossverify::cli
