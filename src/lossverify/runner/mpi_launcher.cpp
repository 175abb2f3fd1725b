// The MPI launcher: this process is one rank of the job mpiexec started (built with MPICH only).
#include <algorithm>
#include <cstdlib>
#include <exception>
#include <thread>

#include "lossverify/comm/mpi_world.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/runner/launcher.hpp"

namespace lossverify {

namespace {

class MpiLauncher final : public Launcher {
 public:
  explicit MpiLauncher(mpi::Session& session) : session_(session) {}
  std::string name() const override { return "mpi"; }
  std::string environment() const override { return "mpi"; }
  int processes() const override { return session_.size(); }
  bool reports() const override { return session_.rank() == 0; }
  void check_world(const Case& c) const override {
    if (c.layout.world_size() == session_.size()) return;
    throw CaseError(c.source + ": layout tp*cp*dp = " + std::to_string(c.layout.tp) + "*" +
                    std::to_string(c.layout.cp) + "*" + std::to_string(c.layout.dp) + " = " +
                    std::to_string(c.layout.world_size()) + " ranks, but mpiexec started " +
                    std::to_string(session_.size()) + " processes");
  }
  // The machine's threads shared by the processes mpiexec put on it.
  int threads_per_rank(int requested_threads, int) const override {
    if (requested_threads > 0) return requested_threads;
    const char* local = std::getenv("MPI_LOCALNRANKS");
    const int local_ranks = local != nullptr ? std::max(1, std::atoi(local)) : 1;
    const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    return std::max(1, hardware / local_ranks);
  }
  // An error inside the run ends the whole job (MPI_Abort), naming the rank.
  void run(int, double timeout_seconds, const std::function<void(Communicator&)>& rank_job) override {
    session_.set_timeout(timeout_seconds);
    run_or_abort([&] { rank_job(session_.world()); });
  }
  bool keeps(int) const override { return true; }
  int gpus(int) const override { return std::max(1, cuda::visible_devices()); }
  void report_step(const std::function<void()>& step) override { run_or_abort(step); }

 private:
  void run_or_abort(const std::function<void()>& step) {
    try {
      step();
    } catch (const Error& e) {
      session_.abort(static_cast<int>(e.code()), e.what());
    } catch (const std::exception& e) {
      session_.abort(static_cast<int>(ExitCode::internal_error), e.what());
    }
  }

  mpi::Session& session_;
};

}  // namespace

std::unique_ptr<Launcher> mpi_launcher(mpi::Session& session) { return std::make_unique<MpiLauncher>(session); }

}  // namespace lossverify
