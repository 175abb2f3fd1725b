#pragma once
// A file that appears whole or not at all: bytes go to `path.tmp.PID` in the same folder, which is flushed
// to disk and renamed over `path` by commit(). A writer that is destroyed before commit() (an exception, an
// early return) removes its temporary file. Errors throw InternalError naming the path (exit code 3).
#include <cstddef>
#include <string>
#include <string_view>

namespace lossverify {

class AtomicFile {
 public:
  // `what` names the file's role in messages ("report", "inputs").
  AtomicFile(std::string path, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void commit();

 private:
  [[noreturn]] void fail(const std::string& why);

  std::string path_;
  std::string what_;
  std::string temporary_;
  int fd_ = -1;
};

}  // namespace lossverify
