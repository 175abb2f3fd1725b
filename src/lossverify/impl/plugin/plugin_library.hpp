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
#include <vector>

#include "lossverify/plugin.h"

namespace lossverify {

struct Implementation;
struct LossSpec;
class LossKind;

struct PluginLibrary {
  std::string spec;    // "plugin:/absolute/path.so?params" (the path %-encoded as above)
  std::string path;    // absolute path of the library
  std::string params;  // the text after '?', "" when none
  std::string name;    // the plugin's own short name
  std::string description;
  lv_memory memory = LV_MEMORY_HOST;
  std::uint32_t losses = 0;        // LV_SUPPORTS_* bits
  std::vector<std::string> names;  // lossverify_plugin_names(): kinds and "kind.setting"s it computes beyond them
  bool names_entry(std::string_view entry) const;
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

// Whether the plugin computes the kind: it sets the kind's lv_loss_kind bit, or names the kind.
bool plugin_computes_kind(const PluginLibrary& plugin, const LossKind& kind);

// A setting of the case the plugin has not said it knows, in words naming the setting and how a plugin says it; ""
// when the plugin declares all the case needs. A setting in the v1 structures is known to every plugin of its kind;
// another, at a value other than its fallback, needs its capability bit or the name "kind.key" (plugin.h).
std::string missing_plugin_capability(const PluginLibrary& plugin, const LossSpec& loss);

}  // namespace lossverify
