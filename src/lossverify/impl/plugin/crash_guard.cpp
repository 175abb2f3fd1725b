#include "lossverify/impl/plugin/crash_guard.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace lossverify {

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kSignalCount = sizeof(kSignals) / sizeof(kSignals[0]);
struct sigaction previous_actions[kSignalCount];

thread_local const char* current_plugin = nullptr;
thread_local int current_rank = -1;
std::atomic<const char*> any_plugin{nullptr};  // a plugin some thread is inside (for threads it started)
std::atomic<int> calls_inside{0};

// Async-signal-safe output: write(2) of fixed strings and a hand-formatted integer.
void say(const char* text) {
  const std::size_t n = std::strlen(text);
  ssize_t ignored = ::write(STDERR_FILENO, text, n);
  (void)ignored;
}
void say_number(int value) {
  char digits[16];
  int k = 0;
  unsigned v = value < 0 ? 0u : static_cast<unsigned>(value);
  do {
    digits[k++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0 && k < 15);
  char text[17];
  for (int i = 0; i < k; ++i) text[i] = digits[k - 1 - i];
  text[k] = '\0';
  say(text);
}
const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV (invalid memory access)";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE (arithmetic fault)";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT (abort, e.g. an uncaught C++ exception)";
    default:
      return "a fatal signal";
  }
}

void pass_on(int sig, siginfo_t* info, void* context) {
  for (int i = 0; i < kSignalCount; ++i) {
    if (kSignals[i] != sig) continue;
    const struct sigaction& old = previous_actions[i];
    if ((old.sa_flags & SA_SIGINFO) != 0 && old.sa_sigaction != nullptr) {
      old.sa_sigaction(sig, info, context);
      return;
    }
    if (old.sa_handler == SIG_IGN) return;
    if (old.sa_handler != SIG_DFL && old.sa_handler != nullptr) {
      old.sa_handler(sig);
      return;
    }
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  const char* plugin = current_plugin != nullptr ? current_plugin : any_plugin.load();
  if (plugin == nullptr || (current_plugin == nullptr && calls_inside.load() == 0)) {
    pass_on(sig, info, context);
    return;
  }
  say("lossverify: internal error: plugin ");
  say(plugin);
  if (current_plugin != nullptr) {
    say(" crashed in rank ");
    say_number(current_rank);
  } else {
    say(" crashed on a thread it started (while ranks were inside it)");
  }
  say(": ");
  say(signal_name(sig));
  say("\n");
  ::_exit(3);
}

}  // namespace

void install_plugin_crash_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int i = 0; i < kSignalCount; ++i) {
      struct sigaction action {};
      action.sa_sigaction = on_fatal_signal;
      action.sa_flags = SA_SIGINFO;
      sigemptyset(&action.sa_mask);
      sigaction(kSignals[i], &action, &previous_actions[i]);
    }
  });
}

PluginCallScope::PluginCallScope(const char* plugin, int rank)
    : previous_plugin_(current_plugin), previous_rank_(current_rank) {
  current_plugin = plugin;
  current_rank = rank;
  any_plugin.store(plugin);
  calls_inside.fetch_add(1);
}

PluginCallScope::~PluginCallScope() {
  calls_inside.fetch_sub(1);
  current_plugin = previous_plugin_;
  current_rank = previous_rank_;
}

}  // namespace lossverify
