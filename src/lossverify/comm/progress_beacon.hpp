#pragma once
// A rank's progress beacon: a counter that the rank's collectives and long compute loops beat, so that
// the thread backend's deadlock guard can tell a rank that is computing from one that is hung. Beating
// is one relaxed atomic increment; no clock is read in a hot loop (the guard's watchdog samples the
// counters and notes when each last moved).
//
// Compute code finds its rank's beacon through current(), which the rank thread sets. OpenMP worker
// threads are not the rank thread, so a loop captures current() before its parallel region and beats
// through that pointer. Outside thread ranks (MPI processes, tools) current() is null and a beat is a
// branch.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace lossverify {

class alignas(64) ProgressBeacon {  // a cache line of its own: the ranks beat concurrently
 public:
  void beat() { beats_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t beats() const { return beats_.load(std::memory_order_relaxed); }

  // The beacon of the rank this thread runs (null when it runs none).
  static ProgressBeacon* current() { return current_; }
  static void set_current(ProgressBeacon* beacon) { current_ = beacon; }

 private:
  std::atomic<std::uint64_t> beats_{0};
  static inline thread_local ProgressBeacon* current_ = nullptr;
};

// Beats a beacon captured from ProgressBeacon::current(), if there was one.
inline void beat(ProgressBeacon* beacon) {
  if (beacon != nullptr) beacon->beat();
}

// The beat of a row loop: one row in 16, so that a rank's OpenMP threads do not contend for the counter
// on narrow rows, while the widest rows still beat many times a second.
inline void beat_row(ProgressBeacon* beacon, std::int64_t row) {
  if (row % 16 == 0) beat(beacon);
}

// Makes v hold n zeros, filled 8 MiB at a time with a beat after each: zeroing (and first touching) a rank's
// shard of hundreds of MB can outlast the deadlock guard's timeout where page faults are slow, and a rank
// that is filling its memory is not hung.
template <class U>
void assign_zeros_beating(std::vector<U>& v, std::size_t n, ProgressBeacon* beacon) {
  v.clear();
  v.reserve(n);
  constexpr std::size_t kChunk = (std::size_t{8} << 20) / sizeof(U);
  while (v.size() < n) {
    v.resize(std::min(n, v.size() + kChunk));
    beat(beacon);
  }
}

}  // namespace lossverify
