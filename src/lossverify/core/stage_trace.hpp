#pragma once
// LOSSVERIFY_TRACE=1: the time of each stage of a piece of work on stderr (a profiling aid). mark(next)
// ends the stage under way, printing its time, and starts `next`; the destructor ends the last one.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

namespace lossverify {

class StageTrace {
 public:
  explicit StageTrace(std::string who) : who_(std::move(who)), enabled_(std::getenv("LOSSVERIFY_TRACE") != nullptr) {}
  ~StageTrace() { mark("end"); }
  StageTrace(const StageTrace&) = delete;
  StageTrace& operator=(const StageTrace&) = delete;
  void mark(const char* next) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (!stage_.empty()) {
      std::fprintf(stderr, "lossverify trace: %s %-12s %9.3f ms\n", who_.c_str(), stage_.c_str(),
                   std::chrono::duration<double, std::milli>(now - since_).count());
    }
    stage_ = next;
    since_ = now;
  }

 private:
  std::string who_;
  bool enabled_;
  std::string stage_;
  std::chrono::steady_clock::time_point since_;
};

}  // namespace lossverify
