#pragma once
// Where a run's ranks live: threads of this process, or one MPI process each. The runner runs every case
// through a launcher (run_case), so that thread ranks, MPI processes and NCCL over either take one path;
// the launcher owns the world, how many OpenMP threads a rank gets, and what happens when a rank fails.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/communicator.hpp"

namespace lossverify {

class Launcher {
 public:
  virtual ~Launcher() = default;
  virtual std::string name() const = 0;         // "threads" or "mpi" (--launcher, bundles)
  virtual std::string environment() const = 0;  // the report's environment.backend
  virtual int processes() const = 0;            // processes the world spans
  // Whether this process speaks for the run (prints and writes files): always for threads, rank 0 under MPI.
  virtual bool reports() const = 0;
  // A world this launcher cannot hold, before anything runs (CaseError): under MPI, a layout whose world
  // size is not the number of processes mpiexec started.
  virtual void check_world(const Case& c) const = 0;
  // OpenMP threads of each rank, from the threads the run may use on this machine (0 = all of them).
  virtual int threads_per_rank(int requested_threads, int world_size) const = 0;
  // Runs rank_job on every rank of a world of `ranks` ranks held by this process (collective) and returns
  // when they have all returned. A rank that fails: threads rethrow its error naming it; MPI ends the job.
  virtual void run(int ranks, double timeout_seconds, const std::function<void(Communicator&)>& rank_job) = 0;
  // Whether rank `rank`'s merged results are kept by this process (one rank per process reports them).
  virtual bool keeps(int rank) const = 0;
  // GPUs the ranks spread over, from --gpus: under MPI every process takes GPU rank % visible GPUs.
  virtual int gpus(int requested) const { return requested; }
  // Runs a step of the reporting process after the ranks (writing files): an error in it is thrown
  // (threads), or ends the whole job naming the rank (MPI: the other processes may wait on this one).
  virtual void report_step(const std::function<void()>& step) { step(); }
};

// Ranks as threads of this process (shared-memory collectives, the deadlock guard of run_thread_ranks).
std::unique_ptr<Launcher> thread_launcher();

namespace mpi {
class Session;
}
// This process as one rank of an MPI job (the session must outlive the launcher).
std::unique_ptr<Launcher> mpi_launcher(mpi::Session& session);

}  // namespace lossverify
