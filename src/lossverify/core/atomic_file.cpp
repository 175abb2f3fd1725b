#include "lossverify/core/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "lossverify/core/errors.hpp"

namespace lossverify {

AtomicFile::AtomicFile(std::string path, std::string what)
    : path_(std::move(path)), what_(std::move(what)), temporary_(path_ + ".tmp." + std::to_string(::getpid())) {
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd_ < 0) throw InternalError(path_ + ": cannot write " + what_ + ": " + std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temporary_.c_str());
  }
}

void AtomicFile::fail(const std::string& why) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(temporary_.c_str());
  throw InternalError(path_ + ": cannot write " + what_ + ": " + why);
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
  if (::fsync(fd_) != 0) fail(std::string("cannot flush: ") + std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink(temporary_.c_str());
    throw InternalError(path_ + ": cannot write " + what_ + ": cannot flush: " + std::strerror(errno));
  }
  if (std::rename(temporary_.c_str(), path_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temporary_.c_str());
    throw InternalError(path_ + ": cannot rename " + what_ + " into place: " + why);
  }
}

}  // namespace lossverify
