#pragma once
// Thread backend: R ranks as R threads of one process, sharing memory. Collectives meet at a barrier
// with a deadline (the deadlock guard) and an abort flag, so a rank that throws or never arrives ends
// the run with an error that names it instead of a hang.
#include <functional>
#include <memory>
#include <string>

#include "lossverify/comm/communicator.hpp"

namespace lossverify {

struct ThreadWorldOptions {
  int ranks = 1;
  double timeout_seconds = 120.0;  // longest a collective may wait for the other ranks
};

// Runs rank_main(communicator) on `ranks` threads and returns when all have finished.
// - a rank that throws aborts the others; the first error is rethrown, prefixed with "rank N: ";
// - a collective that waits past the timeout raises TimeoutError naming the ranks that never arrived;
//   threads that cannot be stopped are detached and the caller must end the process (see the CLI).
void run_thread_ranks(const ThreadWorldOptions& options, const std::function<void(Communicator&)>& rank_main);

}  // namespace lossverify
