#pragma once
// Native plugins (`--impl plugin:PATH.so[?PARAMS]`): a shared library implementing include/lossverify/plugin.h.
// lossverify never loads one: a plugin host process does (plugin_host.hpp). A spec is probed once per process
// (a host loads and validates the library and reports its declaration); it becomes an Implementation like the
// catalogued ones, so run, sweeps, the gate and reproducer bundles take it by name. Its name is the canonical
// spec (absolute path), so a bundle replays it from any folder. A '?' or '%' in the library's path is written
// %3F or %25 (the first bare '?' starts PARAMS).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "lossverify/plugin.h"

namespace lossverify {

struct Implementation;
struct LossSpec;

struct PluginLibrary {
  std::string spec;    // "plugin:/absolute/path.so?params" (the path %-encoded as above)
  std::string path;    // absolute path of the library
  std::string params;  // the text after '?', "" when none
  std::string name;    // the plugin's own short name
  std::string description;
  lv_memory memory = LV_MEMORY_HOST;
  std::uint32_t losses = 0;  // LV_SUPPORTS_* bits
  bool device_memory() const { return memory == LV_MEMORY_CUDA; }
};

inline constexpr std::string_view kPluginPrefix = "plugin:";
inline bool is_plugin_spec(std::string_view name) { return name.substr(0, kPluginPrefix.size()) == kPluginPrefix; }

// The canonical spec (absolute path, %-encoded) of `spec`, without loading anything; CaseError when the library
// is not a regular file.
std::string canonical_plugin_spec(std::string_view spec);

// The implementation a plugin spec names, probing the library on first use. Throws CaseError (exit code 2)
// naming the library when it cannot be loaded, lacks the entry point, has another ABI version, declares
// something impossible or refuses its parameters; InternalError (exit code 3) when its code ends the host
// while it loads (an exit or a crash in a static constructor, lossverify_plugin() or check_params).
const Implementation* load_plugin_implementation(std::string_view spec);

// A setting of the case that needs a capability bit beyond its kind's (plugin.h) which the plugin does not set, in
// words naming the setting and the bit; "" when the plugin declares all the case needs.
std::string missing_plugin_capability(const PluginLibrary& plugin, const LossSpec& loss);

}  // namespace lossverify
