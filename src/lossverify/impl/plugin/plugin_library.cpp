#include "lossverify/impl/plugin/plugin_library.hpp"

#include "lossverify/case/case.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/kind_api/stage.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/plugin/plugin_host.hpp"

namespace lossverify {

namespace {

// Loading a library may initialise a GPU runtime: the probe gets minutes, not the deadlock guard's seconds.
constexpr double kProbeSeconds = 300.0;

struct LoadedPlugin {
  PluginLibrary library;
  Implementation implementation;
};

[[noreturn]] void refuse(const std::string& spec, const std::string& why) {
  throw CaseError("--impl " + printable(spec) + ": " + why);
}

// %3F -> '?', %25 -> '%' (any other '%' stays as it is).
std::string decode_path(const std::string& text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, 3, "%3F") == 0 || text.compare(i, 3, "%3f") == 0) {
      out += '?';
      i += 2;
    } else if (text.compare(i, 3, "%25") == 0) {
      out += '%';
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

std::string encode_path(const std::string& path) {
  std::string out;
  for (const char c : path) out += c == '?' ? "%3F" : c == '%' ? "%25" : std::string(1, c);
  return out;
}

// "plugin:PATH?PARAMS" -> absolute path and params; the library must be a regular file.
PluginLibrary parse_spec(std::string_view spec) {
  const std::string text(spec);
  std::string rest = text.substr(kPluginPrefix.size());
  PluginLibrary lib;
  const auto question = rest.find('?');
  if (question != std::string::npos) {
    lib.params = rest.substr(question + 1);
    rest = rest.substr(0, question);
  }
  rest = decode_path(rest);
  if (rest.empty()) refuse(text, "no library path (expected plugin:PATH.so[?PARAMS])");
  std::error_code error;
  const auto status = std::filesystem::status(rest, error);
  if (!std::filesystem::exists(status)) refuse(text, "no such file: " + printable(rest));
  if (!std::filesystem::is_regular_file(status)) refuse(text, printable(rest) + " is not a regular file");
  lib.path = std::filesystem::canonical(rest, error).string();
  if (error) refuse(text, printable(rest) + ": " + error.message());
  lib.spec = std::string(kPluginPrefix) + encode_path(lib.path) + (lib.params.empty() ? "" : "?" + lib.params);
  return lib;
}

// A host loads the library, validates it and says hello; it ends at once.
void probe(PluginLibrary& lib) {
  PluginHostProcess host(lib.path, lib.params, PluginHostProcess::Mode::probe);
  const auto reply = host.next(kProbeSeconds);
  if (reply.is<plugin_host::Hello>()) {
    const plugin_host::Hello hello = reply.as<plugin_host::Hello>();
    if (hello.ok != 1)
      refuse(lib.spec, printable(std::string(hello.message, strnlen(hello.message, sizeof(hello.message)))));
    lib.name = std::string(hello.name, strnlen(hello.name, sizeof(hello.name)));
    if (lib.name.empty()) lib.name = lib.path;
    lib.description = std::string(hello.description, strnlen(hello.description, sizeof(hello.description)));
    lib.memory = static_cast<lv_memory>(hello.memory);
    lib.losses = hello.losses;
    const std::string names(hello.names, strnlen(hello.names, sizeof(hello.names)));
    for (std::size_t at = 0, end; (end = names.find('\n', at)) != std::string::npos; at = end + 1) {
      lib.names.push_back(names.substr(at, end - at));
    }
    return;
  }
  const std::string where = "plugin " + printable(lib.spec) + " ";
  if (reply.kind == PluginHostProcess::Received::Kind::timed_out) {
    throw TimeoutError(where + "did not finish loading within " + std::to_string(static_cast<int>(kProbeSeconds)) +
                       " s (a static constructor, lossverify_plugin() or check_params that hangs)");
  }
  throw InternalError(where + "ended its process while loading: the host " + host.ended_how() +
                      " before the plugin was validated (a static constructor, lossverify_plugin() or check_params "
                      "that exits or crashes)");
}

Implementation implementation_of(const PluginLibrary& lib) {
  Implementation impl;
  impl.name = lib.spec;
  impl.summary = (lib.description.empty() ? std::string("a native plugin") : lib.description) +
                 (lib.params.empty() ? "" : " [" + lib.params + "]");
  impl.source = lib.path;
  impl.signal = "";
  // The kinds whose lv_loss_kind bit the plugin sets, or that it names.
  impl.applies.scope = Applies::Scope::kinds;
  for (const LossKind* kind : loss_kinds()) {
    if (plugin_computes_kind(lib, *kind)) impl.applies.kinds.emplace_back(kind->name());
  }
  return impl;
}

}  // namespace

std::string canonical_plugin_spec(std::string_view spec) { return parse_spec(spec).spec; }

const Implementation* load_plugin_implementation(std::string_view spec) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<LoadedPlugin>> loaded;  // by canonical spec; probed once
  PluginLibrary lib = parse_spec(spec);
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(lib.spec);
  if (it == loaded.end()) {
    probe(lib);
    auto entry = std::make_unique<LoadedPlugin>();
    entry->library = std::move(lib);
    entry->implementation = implementation_of(entry->library);
    entry->implementation.plugin = &entry->library;
    it = loaded.emplace(entry->library.spec, std::move(entry)).first;
  }
  return &it->second->implementation;
}

bool PluginLibrary::names_entry(std::string_view entry) const {
  return std::find(names.begin(), names.end(), entry) != names.end();
}

bool plugin_computes_kind(const PluginLibrary& plugin, const LossKind& kind) {
  const std::optional<int> code = kind.plugin_kind();
  return (code && (plugin.losses & (1u << *code)) != 0) || plugin.names_entry(kind.name());
}

// A setting added to a kind after a plugin was built reaches it at a value other than its fallback only when the
// plugin says it knows the setting, by its capability bit or by name: the kind's table tells which.
std::string missing_plugin_capability(const PluginLibrary& plugin, const LossSpec& loss) {
  if (const Stage* stage = loss.stage) {  // a stage in front reaches a plugin that declares its capability bit
    const std::string staged = "a case with the stage " + std::string(stage->name()) + " in front of its kind";
    if (stage->plugin_capability() == 0) return staged + " (the plugin ABI does not carry it)";
    if ((plugin.losses & stage->plugin_capability()) == 0) {
      return staged + " (its lv_plugin.losses lacks " + std::string(stage->plugin_capability_name()) + ")";
    }
    if (!stage->plugin_capability_covers(kind_of(loss).name())) {
      return staged + " " + std::string(kind_of(loss).name()) + " (" + std::string(stage->plugin_capability_name()) +
             " does not cover that kind behind it)";
    }
  }
  const LossKind& kind = kind_of(loss);
  const SettingTable& table = kind.settings();
  for (const Setting& s : table) {
    if (s.in_v1_structs || !setting_applies(table, s, loss)) continue;
    const nlohmann::json value = s.get(loss);
    if (value == s.fallback) continue;
    if (s.plugin_capability != 0 && (plugin.losses & s.plugin_capability) != 0) continue;
    const std::string qualified = std::string(kind.name()) + "." + s.key;
    if (plugin.names_entry(qualified)) continue;
    const std::string shown = value.is_string() ? value.get<std::string>() : value.dump();
    return "the " + std::string(kind.name()) + " setting " + s.key + " " + shown + " (" +
           (s.capability_name.empty() ? "" : "its lv_plugin.losses lacks " + s.capability_name + ", and ") +
           "its " LV_PLUGIN_NAMES_ENTRY_POINT "() does not name \"" + qualified + "\")";
  }
  const std::size_t statistics = kind.logged_statistics(loss).size();
  if (statistics > LV_MAX_LOGGED_STATISTICS) {
    return "a case that logs " + std::to_string(statistics) + " statistics (the ABI carries " +
           std::to_string(LV_MAX_LOGGED_STATISTICS) + ": a router of at most 3 layers)";
  }
  return "";
}

}  // namespace lossverify
