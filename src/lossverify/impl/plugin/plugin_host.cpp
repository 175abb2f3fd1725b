#include "lossverify/impl/plugin/plugin_host.hpp"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/core/errors.hpp"

extern char** environ;

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;

bool executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

std::string beside_this_executable() {
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "";
  self[n] = '\0';
  return (std::filesystem::path(self).parent_path() / "lossverify-plugin-host").string();
}

}  // namespace

std::string signal_description(int sig) {
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
    case SIGKILL:
      return "SIGKILL";
    default:
      return "signal " + std::to_string(sig);
  }
}

std::string plugin_host_path() {
  static std::once_flag once;
  static std::string found;
  static std::string looked;
  std::call_once(once, [] {
    std::vector<std::pair<std::string, std::string>> candidates;
    if (const char* env = std::getenv("LOSSVERIFY_PLUGIN_HOST"); env != nullptr && *env != '\0') {
      candidates.emplace_back(env, "LOSSVERIFY_PLUGIN_HOST");
    }
    candidates.emplace_back(beside_this_executable(), "beside this executable");
#ifdef LOSSVERIFY_PLUGIN_HOST_INSTALLED
    candidates.emplace_back(LOSSVERIFY_PLUGIN_HOST_INSTALLED, "installed");
#endif
#ifdef LOSSVERIFY_PLUGIN_HOST_BUILT
    candidates.emplace_back(LOSSVERIFY_PLUGIN_HOST_BUILT, "built");
#endif
    for (const auto& [path, origin] : candidates) {
      if (executable(path)) {
        found = path;
        return;
      }
      looked += (looked.empty() ? "" : ", ") + path + " (" + origin + ")";
    }
  });
  if (found.empty()) {
    throw InternalError("the plugin host lossverify-plugin-host was not found (looked at " + looked +
                        "): a plugin's code runs in it, never in lossverify itself");
  }
  return found;
}

namespace {

// The read end of a pipe whose write end this process holds (close-on-exec) until it ends: every host reads it,
// and its EOF tells the host that lossverify is gone.
int alive_pipe_read_end() {
  static int read_end = [] {
    int ends[2];
    if (::pipe2(ends, O_CLOEXEC) != 0) throw InternalError(std::string("plugin host: pipe: ") + std::strerror(errno));
    // Above 10, like the socket's end: the spawn's dup2 onto descriptors 3 and 4 must not overwrite a source.
    const int high = ::fcntl(ends[0], F_DUPFD_CLOEXEC, 10);
    ::close(ends[0]);
    return high;  // the write end stays open, unused, for the life of the process
  }();
  return read_end;
}

}  // namespace

PluginHostProcess::PluginHostProcess(const std::string& library, const std::string& params, Mode mode) {
  const std::string host = plugin_host_path();
  const int alive = alive_pipe_read_end();
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ends) != 0) {
    throw InternalError(std::string("plugin host: socketpair: ") + std::strerror(errno));
  }
  socket_ = ends[0];
  // The host's end becomes its descriptor 3; duplicated above 3 first, so that dup2 always clears close-on-exec.
  const int child_end = ::fcntl(ends[1], F_DUPFD_CLOEXEC, 10);
  ::close(ends[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, child_end, plugin_host::kSocketFd);
  posix_spawn_file_actions_adddup2(&actions, alive, plugin_host::kAliveFd);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setpgroup(&attributes, 0);  // a process group of its own: stopped with what it started
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (const int sig : {SIGPIPE, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTERM, SIGINT}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  const std::string mode_text = mode == Mode::probe ? "probe" : "serve";
  std::vector<char*> argv = {const_cast<char*>(host.c_str()), const_cast<char*>(library.c_str()),
                             const_cast<char*>(params.c_str()), const_cast<char*>(mode_text.c_str()), nullptr};
  const int error = ::posix_spawn(&pid_, host.c_str(), &actions, &attributes, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  ::close(child_end);
  if (error != 0) {
    ::close(socket_);
    throw InternalError("cannot start the plugin host " + host + ": " + std::strerror(error));
  }
}

PluginHostProcess::~PluginHostProcess() {
  if (socket_ >= 0) ::close(socket_);
  if (pid_ > 0) {
    ::killpg(pid_, SIGKILL);  // the host and anything it started
    ::kill(pid_, SIGKILL);
    if (!reaped_) ::waitpid(pid_, &status_, 0);
  }
}

void PluginHostProcess::send_bytes(const void* data, std::size_t bytes, int pass_fd) {
  iovec part{const_cast<void*>(data), bytes};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  char control[CMSG_SPACE(sizeof(int))] = {};
  if (pass_fd >= 0) {
    header.msg_control = control;
    header.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  ssize_t sent = -1;
  do {
    sent = ::sendmsg(socket_, &header, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  // A host that has gone is noticed by the next receive, which says how it ended.
}

PluginHostProcess::Received PluginHostProcess::next(double seconds, const std::function<bool()>& abandon) {
  Received r;
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  // This wait is bounded and diagnoses its own silence (the caller names the plugin that hung), so the
  // rank beats while it waits: the thread world's deadlock guard, timed the same, must not race it and
  // name only "a rank that never arrived".
  ProgressBeacon* const beacon = ProgressBeacon::current();
  for (;;) {
    beat(beacon);
    pollfd p{socket_, POLLIN, 0};
    const int ready = ::poll(&p, 1, 50);
    if (ready > 0) {
      const ssize_t got = ::recv(socket_, r.bytes.data(), r.bytes.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        r.kind = Received::Kind::ended;
        return r;
      }
      r.kind = Received::Kind::message;
      r.size = static_cast<std::size_t>(got);
      plugin_host::Header header{};
      std::memcpy(&header, r.bytes.data(), std::min(sizeof(header), r.size));
      r.type = header.type;
      return r;
    }
    // A host that ended is noticed by itself, not only by its socket's EOF: a process the plugin started (fork,
    // system(), a daemon) may still hold the host's end, and the EOF would then never come.
    if (!reaped_ && ::waitpid(pid_, &status_, WNOHANG) == pid_) {
      reaped_ = true;
      r.kind = Received::Kind::ended;
      return r;
    }
    if (abandon && abandon()) {
      r.kind = Received::Kind::abandoned;
      return r;
    }
    if (Clock::now() > deadline) {
      r.kind = Received::Kind::timed_out;
      return r;
    }
  }
}

void PluginHostProcess::reap(double seconds) {
  if (reaped_ || pid_ <= 0) return;
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < deadline) {
    const pid_t done = ::waitpid(pid_, &status_, WNOHANG);
    if (done == pid_) {
      reaped_ = true;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::killpg(pid_, SIGKILL);
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, &status_, 0);
  reaped_ = true;
}

std::string PluginHostProcess::ended_how() {
  reap(2.0);
  if (WIFEXITED(status_)) return "exited with status " + std::to_string(WEXITSTATUS(status_));
  if (WIFSIGNALED(status_)) return "was killed by " + signal_description(WTERMSIG(status_));
  return "ended";
}

int PluginHostProcess::signal_number() {
  reap(2.0);
  return WIFSIGNALED(status_) ? WTERMSIG(status_) : 0;
}

}  // namespace lossverify
