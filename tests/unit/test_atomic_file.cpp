#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>

#include "lossverify/core/atomic_file.hpp"
#include "lossverify/core/errors.hpp"

namespace fs = std::filesystem;

namespace {

fs::path fresh_folder(const std::string& name) {
  const fs::path folder = fs::temp_directory_path() / ("lossverify-atomic-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(folder);
  fs::create_directories(folder);
  return folder;
}

std::size_t files_in(const fs::path& folder) {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(folder)) ++count;
  return count;
}

}  // namespace

TEST_CASE("a signal during a write removes the temporary file, and the signal still ends the process") {
  for (const int signal_number : {SIGTERM, SIGINT}) {
    const fs::path folder = fresh_folder("signal");
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {              // the child writes 4 MB, then the signal arrives before commit()
      ::signal(SIGTERM, SIG_DFL);  // as in the command-line tool: not doctest's crash handlers
      ::signal(SIGINT, SIG_DFL);
      lossverify::AtomicFile file((folder / "report.json").string(), "report");
      const std::string block(1 << 20, 'x');
      for (int i = 0; i < 4; ++i) file.write(block);
      ::raise(signal_number);
      ::_exit(0);  // not reached: the signal's default action ends the process
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == signal_number);
    CHECK(files_in(folder) == 0);  // neither report.json nor its temporary file
    fs::remove_all(folder);
  }
}

TEST_CASE("a committed file appears whole; an abandoned one leaves nothing") {
  const fs::path folder = fresh_folder("commit");
  {
    lossverify::AtomicFile file((folder / "a.json").string(), "report");
    file.write("{}\n");
    CHECK(files_in(folder) == 1);  // the temporary file only
    CHECK_FALSE(fs::exists(folder / "a.json"));
    file.commit();
  }
  CHECK(files_in(folder) == 1);
  std::ifstream in(folder / "a.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text == "{}\n");
  {
    lossverify::AtomicFile file((folder / "b.json").string(), "report");
    file.write("partial");
  }
  CHECK(files_in(folder) == 1);
  fs::remove_all(folder);
}

TEST_CASE("a folder is refused as a usage error before anything is written") {
  const fs::path folder = fresh_folder("folder");
  CHECK_THROWS_AS(lossverify::AtomicFile(folder.string(), "report"), lossverify::CaseError);
  CHECK(files_in(folder) == 0);
  fs::remove_all(folder);
}
