#pragma once
// `lossverify list [--json]`: the losses, the implementations (correct and the catalogued bugs), the checks.
#include <CLI/CLI.hpp>

namespace lossverify::cli {

struct ListCommand {
  CLI::App* app = nullptr;
  bool json = false;
  bool selected() const { return app != nullptr && app->parsed(); }
};

// Adds the subcommand to `app`; the returned object must outlive app.parse().
void register_list(CLI::App& app, ListCommand& command);
// Prints the listing; returns 0.
int run_list(bool as_json);

}  // namespace lossverify::cli
