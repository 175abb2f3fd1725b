#include "lossverify/core/descendants.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

namespace lossverify {

namespace {

// This process's children, from every one of its threads (/proc/self/task/TID/children).
std::set<pid_t> children() {
  std::set<pid_t> found;
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", error)) {
    std::ifstream list(task.path() / "children");
    pid_t pid = 0;
    while (list >> pid) found.insert(pid);
  }
  return found;
}

}  // namespace

void adopt_orphaned_descendants() { ::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); }

int end_descendants() {
  int ended = 0;
  for (int round = 0; round < 64; ++round) {
    const std::set<pid_t> now = children();
    if (now.empty()) break;
    for (const pid_t pid : now) {
      if (::getpgid(pid) == pid) ::killpg(pid, SIGKILL);
      ::kill(pid, SIGKILL);
    }
    for (const pid_t pid : now) {
      int status = 0;
      if (::waitpid(pid, &status, 0) == pid) ++ended;
    }
  }
  return ended;
}

}  // namespace lossverify
