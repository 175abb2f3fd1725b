#pragma once
// Thread backend: R ranks as R threads of one process, sharing memory. Collectives meet at a barrier
// with an abort flag, watched by the deadlock guard, so a rank that throws or never arrives ends the run
// with an error that names it instead of a hang.
#include <functional>
#include <memory>
#include <string>

#include "lossverify/comm/communicator.hpp"

namespace lossverify {

struct ThreadWorldOptions {
  int ranks = 1;
  double timeout_seconds = 120.0;  // the deadlock guard's timeout (see run_thread_ranks)
};

// Runs rank_main(communicator) on `ranks` threads and returns when all have finished.
// - a rank that throws aborts the others; the first error is rethrown, prefixed with "rank N: ";
// - the deadlock guard raises TimeoutError when a rank has waited in a collective longer than the timeout
//   and the ranks it waits for have made no progress for as long (each rank thread's ProgressBeacon, see
//   progress_beacon.hpp); the message names the ranks at the root of the wait. Threads that cannot be
//   stopped are detached and the caller must end the process (see the CLI).
void run_thread_ranks(const ThreadWorldOptions& options, const std::function<void(Communicator&)>& rank_main);

}  // namespace lossverify
