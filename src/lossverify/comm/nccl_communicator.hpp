#pragma once
// NCCL between the GPUs of a rank group: one GPU per rank, the group's small collectives (per-row
// statistics, counts, verification partials) travel over NCCL instead of host memory or MPI.
// Every collective is an all-gather followed by a reduction in rank order on the host, so the numbers
// are bitwise those of the thread and MPI backends (a ring all-reduce would sum in another order).
// The host communicator of the same group bootstraps NCCL (the unique id) and carries split, barrier
// and abort. Waits poll the stream with a deadline and the world's abort flag, so a rank that failed or
// hangs ends the run with an error instead of leaving the others inside NCCL.
//
// NCCL is set up once per process and group: ncclCommInitRank costs tens to hundreds of milliseconds,
// and a gate makes hundreds of runs. A group's endpoint (communicator, stream, staging buffer) is kept
// after a run that ended cleanly, keyed by the group's role and its members' GPUs in group order, and
// the next run of the same group takes it again once every member has said it holds one. An endpoint
// of a run that failed, timed out or was abandoned is aborted (ncclCommAbort), never reused.
#include <cstdint>
#include <memory>

#include "lossverify/comm/communicator.hpp"

namespace lossverify::cuda {

bool built_with_nccl();

// Which of a rank's groups an endpoint serves: two groups with the same members (the batch and DP groups
// of a DP-only layout) keep endpoints of their own.
enum class NcclRole { tp = 0, batch = 1, dp = 2 };

// Collective over `host_group`: every member calls it with its own device (distinct devices).
// Throws InternalError when NCCL is missing or initialisation fails, TimeoutError past the deadline.
std::unique_ptr<Communicator> make_nccl_group(Communicator& host_group, int device, double timeout_seconds,
                                              NcclRole role);

// Endpoints created by this process so far (tests and traces: a second run of a group creates none), and
// those kept now for the next run.
std::int64_t nccl_endpoints_created();
std::int64_t nccl_endpoints_kept();
// Aborts every kept endpoint (the end of a command, or before the process exits). Not collective.
void release_nccl_endpoints();

}  // namespace lossverify::cuda
