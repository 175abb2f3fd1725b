#pragma once
// lossverify's side of a plugin host (host_protocol.hpp): the process a plugin's code runs in. This file
// starts `lossverify-plugin-host`, exchanges its messages under deadlines, and says how it ended when it ends
// without the message it owed (exit(0) included: an exit is never a result).
#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>

#include "lossverify/impl/plugin/host_protocol.hpp"

namespace lossverify {

// "SIGSEGV (invalid memory access)" and the like.
std::string signal_description(int sig);

// The host executable: LOSSVERIFY_PLUGIN_HOST, else beside this executable, else where `cmake --install` puts
// it, else where this build made it. Throws InternalError naming the places it looked.
std::string plugin_host_path();

class PluginHostProcess {
 public:
  enum class Mode { probe, serve };
  // Starts the host for `library` with `params`; it loads the library at once and says hello.
  PluginHostProcess(const std::string& library, const std::string& params, Mode mode);
  ~PluginHostProcess();  // the host and whatever it started are killed, and reaped
  PluginHostProcess(const PluginHostProcess&) = delete;
  PluginHostProcess& operator=(const PluginHostProcess&) = delete;

  template <class T>
  void send(const T& message, int pass_fd = -1) {
    send_bytes(&message, sizeof(T), pass_fd);
  }

  struct Received {
    enum class Kind { message, ended, timed_out, abandoned } kind = Kind::ended;
    plugin_host::Message type{};
    std::array<std::byte, sizeof(plugin_host::Hello) + 64> bytes{};
    std::size_t size = 0;
    template <class T>
    bool is() const {
      return kind == Kind::message && type == T{}.header.type && size == sizeof(T);
    }
    template <class T>
    T as() const {
      T message{};
      std::memcpy(&message, bytes.data(), sizeof(T));
      return message;
    }
  };
  // The next message, waiting at most `seconds` of silence; `abandon` is asked every 50 ms and ends the wait
  // when it says so. When the host has ended, ended_how() says how.
  Received next(double seconds, const std::function<bool()>& abandon = {});
  // "exited with status 0" or "was killed by signal 11 (SIGSEGV)"; waits (briefly) for the host to end.
  std::string ended_how();
  int signal_number();  // the signal that ended it, or 0
  pid_t pid() const { return pid_; }

 private:
  void send_bytes(const void* data, std::size_t bytes, int pass_fd);
  void reap(double seconds);

  pid_t pid_ = -1;
  int socket_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

}  // namespace lossverify
