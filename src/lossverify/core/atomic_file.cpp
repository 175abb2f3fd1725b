#include "lossverify/core/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/core/strings.hpp"

namespace lossverify {

namespace {

// The temporary files open now, for SIGINT and SIGTERM to remove: the handler may only read these slots and
// call unlink(), which is async-signal-safe.
std::array<std::atomic<const char*>, 16> open_temporaries{};
struct sigaction previous_interrupt {
}, previous_terminate{};

void remove_temporaries_and_reraise(int signal_number) {
  for (auto& slot : open_temporaries) {
    if (const char* name = slot.load()) ::unlink(name);
  }
  ::sigaction(signal_number, signal_number == SIGINT ? &previous_interrupt : &previous_terminate, nullptr);
  ::raise(signal_number);
}

// Installed whenever the handler in place is not ours (first use, or a library replaced it since); the
// handler it replaces runs after the cleanup.
void install_signal_cleanup() {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  for (const int signal_number : {SIGINT, SIGTERM}) {
    struct sigaction current {};
    ::sigaction(signal_number, nullptr, &current);
    if (current.sa_handler == remove_temporaries_and_reraise) continue;
    struct sigaction action {};
    action.sa_handler = remove_temporaries_and_reraise;
    sigemptyset(&action.sa_mask);
    ::sigaction(signal_number, &action, signal_number == SIGINT ? &previous_interrupt : &previous_terminate);
  }
}

int remember_temporary(const char* name) {
  install_signal_cleanup();
  for (std::size_t i = 0; i < open_temporaries.size(); ++i) {
    const char* expected = nullptr;
    if (open_temporaries[i].compare_exchange_strong(expected, name)) return static_cast<int>(i);
  }
  return -1;  // more than 16 at once: this one is still removed on every path but a signal
}

void forget_temporary(int slot) {
  if (slot >= 0) open_temporaries[static_cast<std::size_t>(slot)] = nullptr;
}

}  // namespace

AtomicFile::AtomicFile(std::string path, std::string what) : path_(std::move(path)), what_(std::move(what)) {
  const OutputTarget target = resolve_output("cannot write " + what_ + " to", path_);
  destination_ = target.path;
  if (target.kind == OutputTarget::Kind::stream) {
    open_stream();
  } else {
    open_temporary();
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  discard_temporary();
}

// A FIFO is opened without blocking: with no reader the open fails (ENXIO) instead of waiting forever.
void AtomicFile::open_stream() {
  fd_ = ::open(destination_.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) {
    const int error = errno;
    throw InternalError(printable(path_) + ": cannot write " + what_ + ": " +
                        (error == ENXIO ? std::string("a FIFO with no reader") : std::strerror(error)));
  }
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
}

void AtomicFile::open_temporary() {
  const std::filesystem::path folder = std::filesystem::path(destination_).parent_path();
  temporary_ = ((folder.empty() ? std::filesystem::path(".") : folder) / ".lossverify-XXXXXX").string();
  fd_ = ::mkstemp(temporary_.data());
  if (fd_ < 0) {
    const int error = errno;
    temporary_.clear();
    throw InternalError(printable(path_) + ": cannot write " + what_ + ": " + std::strerror(error));
  }
  ::fchmod(fd_, 0644);
  slot_ = remember_temporary(temporary_.c_str());
}

void AtomicFile::discard_temporary() {
  if (temporary_.empty()) return;
  ::unlink(temporary_.c_str());
  forget_temporary(slot_);
  slot_ = -1;
  temporary_.clear();
}

void AtomicFile::fail(const std::string& why) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  discard_temporary();
  throw InternalError(printable(path_) + ": cannot write " + what_ + ": " + why);
}

void AtomicFile::write(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  std::size_t written = 0;
  while (written < bytes) {
    const ssize_t n = ::write(fd_, p + written, bytes - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(std::strerror(errno));
    }
    written += static_cast<std::size_t>(n);
  }
}

void AtomicFile::commit() {
  if (!temporary_.empty() && ::fsync(fd_) != 0) fail(std::string("cannot flush: ") + std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const std::string why = std::strerror(errno);
    discard_temporary();
    throw InternalError(printable(path_) + ": cannot write " + what_ + ": cannot flush: " + why);
  }
  if (temporary_.empty()) return;  // a stream
  if (std::rename(temporary_.c_str(), destination_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    discard_temporary();
    throw InternalError(printable(path_) + ": cannot rename " + what_ + " into place: " + why);
  }
  forget_temporary(slot_);
  slot_ = -1;
  temporary_.clear();
}

}  // namespace lossverify
