#pragma once
// A file that appears whole or not at all. Where the bytes go follows the rule of output_path.hpp: a regular
// file (or one that does not exist yet, or the file a symbolic link points to) is written to a temporary file
// in the same folder (a short random name, so any name the folder accepts works), flushed to disk and renamed
// over the path by commit(); a character device or a FIFO is written as a stream.
// A writer destroyed before commit() (an exception, an early return) removes its temporary file, and so does
// SIGINT or SIGTERM arriving while it is open. Errors throw InternalError naming the path (exit code 3);
// a path the rule refuses throws CaseError (exit code 2).
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
  void open_stream();
  void open_temporary();
  void discard_temporary();

  std::string path_;         // as the user gave it (messages)
  std::string destination_;  // where the bytes land: symbolic links resolved
  std::string what_;
  std::string temporary_;  // empty for a stream
  int slot_ = -1;          // in the signal handler's list of temporary files
  int fd_ = -1;
};

}  // namespace lossverify
