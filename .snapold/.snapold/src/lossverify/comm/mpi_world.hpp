#pragma once
// MPI backend (MPICH): one rank per process. Collectives are built on non-blocking all-gathers that are
// reduced in rank order, exactly as the thread backend does, so a CPU run gives bitwise the same
// results on either backend. Every wait has a deadline (the deadlock guard); a rank that throws,
// crashes or hangs ends the whole job with a message naming it.
#include <memory>
#include <string>

#include "lossverify/comm/communicator.hpp"

namespace lossverify::mpi {

// True when this process was started by mpiexec (the process manager's environment is present).
bool launched_by_mpiexec();

// MPI_Init_thread and the handlers that name this rank if it dies; MPI_Finalize on destruction.
class Session {
 public:
  Session(int* argc, char*** argv, double timeout_seconds);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int rank() const;
  int size() const;
  Communicator& world();
  void set_timeout(double seconds);
  // Ends every process of the job now, with this exit code (after printing `message` from this rank).
  [[noreturn]] void abort(int exit_code, const std::string& message);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace lossverify::mpi
