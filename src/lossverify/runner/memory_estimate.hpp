#pragma once
// What a run on thread ranks will hold at its peak, estimated from the case before anything is allocated,
// and the memory this machine can give it: a case that cannot fit is refused up front (exit 2) instead of
// ending in std::bad_alloc or the out-of-memory killer after minutes of work.
#include <cstdint>
#include <string>

#include "lossverify/case/case.hpp"

namespace lossverify {

struct MemoryEstimate {
  std::int64_t shards = 0;    // logits (and teacher) shards plus the gradients, over all ranks
  std::int64_t partials = 0;  // every rank's per-row statistics (reduced over its TP group, not gathered)
  std::int64_t snapshot = 0;  // a sweep's kept answers for the invariance check and its shared inputs
  std::int64_t stage = 0;     // a stage's float64 reference, one per rank (Stage::reference_bytes)
  std::int64_t total() const { return shards + partials + snapshot + stage; }
};

MemoryEstimate estimate_memory(const Case& c, bool keep_snapshot);

// Bytes this process may still allocate: MemAvailable, lowered by a cgroup's memory.max; -1 if unknown.
std::int64_t available_memory();

// Throws CaseError naming the estimate's parts and the available figure when the run cannot fit.
void require_memory(const Case& c, bool keep_snapshot);

}  // namespace lossverify
