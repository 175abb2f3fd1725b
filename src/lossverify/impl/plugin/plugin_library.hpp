#pragma once
// Native plugins (`--impl plugin:PATH.so[?PARAMS]`): a shared library implementing include/lossverify/plugin.h.
// A spec is loaded once per process and stays loaded; it becomes an Implementation like the catalogued ones,
// so run, sweeps, the gate and reproducer bundles take it by name. Its name is the canonical spec (absolute
// path), so a bundle replays it from any folder.
#include <memory>
#include <string>
#include <string_view>

#include "lossverify/plugin.h"

namespace lossverify {

struct Implementation;

struct PluginLibrary {
  std::string spec;    // "plugin:/absolute/path.so?params"
  std::string path;    // absolute path of the library
  std::string params;  // the text after '?', "" when none
  std::string name;    // the plugin's own short name
  const lv_plugin* entry = nullptr;
  void* handle = nullptr;
  bool device_memory() const { return entry->memory == LV_MEMORY_CUDA; }
};

inline constexpr std::string_view kPluginPrefix = "plugin:";
inline bool is_plugin_spec(std::string_view name) { return name.substr(0, kPluginPrefix.size()) == kPluginPrefix; }

// The implementation a plugin spec names, loading the library on first use. Throws CaseError (exit code 2)
// naming the library when it cannot be loaded, lacks the entry point, has another ABI version or declares
// something impossible.
const Implementation* load_plugin_implementation(std::string_view spec);

}  // namespace lossverify
