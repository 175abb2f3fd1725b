#include "lossverify/impl/plugin/plugin_library.hpp"

#include <dlfcn.h>

#include <filesystem>
#include <map>
#include <mutex>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/plugin/crash_guard.hpp"

namespace lossverify {

namespace {

struct LoadedPlugin {
  PluginLibrary library;
  Implementation implementation;
};

[[noreturn]] void refuse(const std::string& spec, const std::string& why) {
  throw CaseError("--impl " + spec + ": " + why);
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
  if (rest.empty()) refuse(text, "no library path (expected plugin:PATH.so[?PARAMS])");
  std::error_code error;
  const auto status = std::filesystem::status(rest, error);
  if (!std::filesystem::exists(status)) refuse(text, "no such file: " + rest);
  if (!std::filesystem::is_regular_file(status)) refuse(text, rest + " is not a regular file");
  lib.path = std::filesystem::canonical(rest, error).string();
  if (error) refuse(text, rest + ": " + error.message());
  lib.spec = std::string(kPluginPrefix) + lib.path + (lib.params.empty() ? "" : "?" + lib.params);
  return lib;
}

void open_library(PluginLibrary& lib, const std::string& spec) {
  lib.handle = ::dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib.handle == nullptr) refuse(spec, std::string("cannot load the library: ") + ::dlerror());
  ::dlerror();
  void* symbol = ::dlsym(lib.handle, LV_PLUGIN_ENTRY_POINT);
  if (symbol == nullptr) {
    refuse(spec, std::string("the library has no entry point ") + LV_PLUGIN_ENTRY_POINT +
                     " (see include/lossverify/plugin.h; was it declared extern \"C\"?)");
  }
  const auto entry = reinterpret_cast<lv_plugin_entry>(symbol);
  lib.entry = entry();
  if (lib.entry == nullptr) refuse(spec, std::string(LV_PLUGIN_ENTRY_POINT) + "() returned NULL");
}

void validate_entry(const PluginLibrary& lib, const std::string& spec) {
  const lv_plugin& p = *lib.entry;
  if (p.abi_version != LV_PLUGIN_ABI_VERSION) {
    refuse(spec, "plugin ABI version " + std::to_string(p.abi_version) + ", but this lossverify implements version " +
                     std::to_string(LV_PLUGIN_ABI_VERSION) +
                     " (rebuild the plugin against this include/lossverify/plugin.h)");
  }
  if (p.run_rank == nullptr) refuse(spec, "the plugin's run_rank is NULL");
  if (p.memory != LV_MEMORY_HOST && p.memory != LV_MEMORY_CUDA) {
    refuse(spec, "the plugin declares memory " + std::to_string(static_cast<int>(p.memory)) + " (host 0 or CUDA 1)");
  }
  if ((p.losses & (LV_SUPPORTS_CROSS_ENTROPY | LV_SUPPORTS_KD)) == 0) {
    refuse(spec, "the plugin supports no loss (set LV_SUPPORTS_CROSS_ENTROPY and/or LV_SUPPORTS_KD in losses)");
  }
  if (p.check_params != nullptr) {
    char error[1024] = {};
    if (p.check_params(lib.params.c_str(), error, sizeof(error)) != 0) {
      error[sizeof(error) - 1] = '\0';
      refuse(spec, "the plugin refuses its parameters \"" + lib.params + "\"" +
                       (error[0] != '\0' ? ": " + std::string(error) : ""));
    }
  }
}

Implementation implementation_of(const PluginLibrary& lib) {
  const lv_plugin& p = *lib.entry;
  Implementation impl;
  impl.name = lib.spec;
  impl.summary = std::string(p.description != nullptr ? p.description : "a native plugin") +
                 (lib.params.empty() ? "" : " [" + lib.params + "]");
  impl.source = lib.path;
  impl.signal = "";
  const bool ce = (p.losses & LV_SUPPORTS_CROSS_ENTROPY) != 0;
  const bool kd = (p.losses & LV_SUPPORTS_KD) != 0;
  impl.applies = ce && kd ? Applies::any : ce ? Applies::cross_entropy : Applies::kd;
  return impl;
}

}  // namespace

const Implementation* load_plugin_implementation(std::string_view spec) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<LoadedPlugin>> loaded;  // by canonical spec; never unloaded
  PluginLibrary lib = parse_spec(spec);
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(lib.spec);
  if (it == loaded.end()) {
    open_library(lib, std::string(spec));
    validate_entry(lib, std::string(spec));
    lib.name = lib.entry->name != nullptr ? lib.entry->name : lib.path;
    install_plugin_crash_handlers();
    auto entry = std::make_unique<LoadedPlugin>();
    entry->library = std::move(lib);
    entry->implementation = implementation_of(entry->library);
    entry->implementation.plugin = &entry->library;
    it = loaded.emplace(entry->library.spec, std::move(entry)).first;
  }
  return &it->second->implementation;
}

}  // namespace lossverify
