#pragma once
// NCCL between the GPUs of a rank group: one GPU per rank, the group's small collectives (per-row
// statistics, counts, verification partials) travel over NCCL instead of host memory or MPI.
// Every collective is an all-gather followed by a reduction in rank order on the host, so the numbers
// are bitwise those of the thread and MPI backends (a ring all-reduce would sum in another order).
// The host communicator of the same group bootstraps NCCL (the unique id) and carries split, barrier
// and abort. Waits poll the stream with a deadline and the world's abort flag, so a rank that failed or
// hangs ends the run with an error instead of leaving the others inside NCCL.
#include <memory>

#include "lossverify/comm/communicator.hpp"

namespace lossverify::cuda {

bool built_with_nccl();

// Collective over `host_group`: every member calls it with its own device (distinct devices).
// Throws InternalError when NCCL is missing or initialisation fails, TimeoutError past the deadline.
std::unique_ptr<Communicator> make_nccl_group(Communicator& host_group, int device, double timeout_seconds);

}  // namespace lossverify::cuda
