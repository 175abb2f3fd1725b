#include "lossverify/runner/launcher.hpp"

#include <algorithm>
#include <thread>

#include "lossverify/comm/thread_world.hpp"

namespace lossverify {

namespace {

class ThreadLauncher final : public Launcher {
 public:
  std::string name() const override { return "threads"; }
  std::string environment() const override { return "cpu-threads"; }
  int processes() const override { return 1; }
  bool reports() const override { return true; }
  void check_world(const Case&) const override {}
  int threads_per_rank(int requested_threads, int world_size) const override {
    const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    return std::max(1, (requested_threads > 0 ? requested_threads : hardware) / world_size);
  }
  void run(int ranks, double timeout_seconds, const std::function<void(Communicator&)>& rank_job) override {
    ThreadWorldOptions options;
    options.ranks = ranks;
    options.timeout_seconds = timeout_seconds;
    run_thread_ranks(options, rank_job);
  }
  bool keeps(int rank) const override { return rank == 0; }
};

}  // namespace

std::unique_ptr<Launcher> thread_launcher() { return std::make_unique<ThreadLauncher>(); }

}  // namespace lossverify
