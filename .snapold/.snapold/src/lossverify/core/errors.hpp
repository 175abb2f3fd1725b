#pragma once
#include <stdexcept>
#include <string>

namespace lossverify {

// Process exit codes; documented in the README and relied on by CI users.
enum class ExitCode : int {
  pass = 0,            // every check passed
  check_failed = 1,    // at least one check failed
  usage_error = 2,     // bad command line, malformed or impossible case file
  internal_error = 3,  // backend or internal error (a rank threw, no GPU, I/O failure)
  timeout = 4,         // the deadlock guard fired: a rank never reached a collective
};

// Every error lossverify raises carries the exit code it maps to.
class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ExitCode code() const { return code_; }

 private:
  ExitCode code_;
};

// A case file or command line that cannot be run: names the file and the JSON path.
class CaseError : public Error {
 public:
  explicit CaseError(const std::string& message) : Error(ExitCode::usage_error, message) {}
};

class InternalError : public Error {
 public:
  explicit InternalError(const std::string& message) : Error(ExitCode::internal_error, message) {}
};

class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& message) : Error(ExitCode::timeout, message) {}
};

}  // namespace lossverify
