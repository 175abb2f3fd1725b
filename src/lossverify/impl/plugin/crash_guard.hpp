#pragma once
// A plugin that crashes must not take lossverify down silently: while a rank is inside a plugin, a fatal
// signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints which plugin crashed in which rank and exits with
// code 3. Outside plugin calls the handlers hand the signal to whatever handled it before.
namespace lossverify {

// Idempotent; called when the first plugin is loaded.
void install_plugin_crash_handlers();

// Marks the calling thread as running `plugin` for world rank `rank` for the scope's lifetime. A crash on a
// thread the plugin started itself is reported without a rank.
class PluginCallScope {
 public:
  PluginCallScope(const char* plugin, int rank);
  ~PluginCallScope();
  PluginCallScope(const PluginCallScope&) = delete;
  PluginCallScope& operator=(const PluginCallScope&) = delete;

 private:
  const char* previous_plugin_;
  int previous_rank_;
};

}  // namespace lossverify
