#include "lossverify/runner/memory_estimate.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "lossverify/core/dtype.hpp"
#include "lossverify/core/errors.hpp"

namespace lossverify {

namespace {

// Peak bytes per (rank, row) of the verification's per-row statistics and each rank's own bookkeeping
// (row statistics are reduced over the TP group, never gathered): measured from the peak RSS at tp 8, 100
// and 1000 on 512 tokens (bench/memory_scaling.sh), rounded up.
constexpr double kBytesPerRankRow = 512.0;

// a * b, saturating instead of overflowing.
std::int64_t times(std::int64_t a, std::int64_t b) {
  if (a != 0 && b > std::numeric_limits<std::int64_t>::max() / a) return std::numeric_limits<std::int64_t>::max();
  return a * b;
}

std::int64_t plus(std::int64_t a, std::int64_t b) {
  return a > std::numeric_limits<std::int64_t>::max() - b ? std::numeric_limits<std::int64_t>::max() : a + b;
}

std::string gigabytes(std::int64_t bytes) {
  std::ostringstream text;
  text.precision(3);
  text << static_cast<double>(bytes) / 1e9 << " GB";
  return text.str();
}

// A number from a /proc or /sys file ("max" or absent: -1).
std::int64_t read_number(const std::string& path, const std::string& key = "") {
  std::ifstream in(path);
  std::string word;
  while (in >> word) {
    if (!key.empty() && word != key) continue;
    if (!key.empty() && !(in >> word)) return -1;
    try {
      return std::stoll(word) * (key.empty() ? 1 : 1024);  // /proc/meminfo counts kB
    } catch (const std::exception&) {
      return -1;
    }
  }
  return -1;
}

}  // namespace

MemoryEstimate estimate_memory(const Case& c, bool keep_snapshot) {
  const std::int64_t n = c.shape.tokens;
  const std::int64_t logits = times(n, c.shape.vocab);
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(c.inputs.dtype));
  const std::int64_t inputs_per_logit = kind_of(c.loss).inputs().teacher_logits ? 2 : 1;  // a teacher's shard too
  MemoryEstimate e;
  e.shards = times(logits, element * (inputs_per_logit + 1));  // + the gradient, in the same dtype
  const std::int64_t rows_per_rank = n / (std::int64_t{c.layout.cp} * c.layout.dp) + 2 * c.layout.cp;
  const auto statistics =
      static_cast<double>(c.layout.world_size()) * static_cast<double>(rows_per_rank) * kBytesPerRankRow;
  e.partials = statistics > 9e18 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(statistics);
  if (c.loss.stage != nullptr) e.stage = times(c.layout.world_size(), c.loss.stage->reference_bytes(c));
  if (keep_snapshot) {  // the answers of two layouts at once, and the inputs materialized (up to 1 GiB)
    const std::int64_t answers = plus(times(n, 4), logits <= (std::int64_t{1} << 25) ? times(logits, 4) : 0);
    e.snapshot = plus(times(answers, 2), std::min(times(logits, element * inputs_per_logit), std::int64_t{1} << 30));
  }
  return e;
}

std::int64_t available_memory() {
  std::int64_t available = read_number("/proc/meminfo", "MemAvailable:");
  const std::int64_t limit = read_number("/sys/fs/cgroup/memory.max");
  const std::int64_t used = read_number("/sys/fs/cgroup/memory.current");
  if (limit > 0 && used >= 0 && (available < 0 || limit - used < available)) available = limit - used;
  return available;
}

void require_memory(const Case& c, bool keep_snapshot) {
  const MemoryEstimate e = estimate_memory(c, keep_snapshot);
  const std::int64_t available = available_memory();
  if (available < 0 || e.total() <= available) return;
  throw CaseError(c.source + ": N=" + std::to_string(c.shape.tokens) + " V=" + std::to_string(c.shape.vocab) +
                  " at tp=" + std::to_string(c.layout.tp) + " cp=" + std::to_string(c.layout.cp) + " dp=" +
                  std::to_string(c.layout.dp) + " needs about " + gigabytes(e.total()) + " (" + gigabytes(e.shards) +
                  " of logit shards and gradients, " + gigabytes(e.partials) + " of per-row statistics" +
                  (e.snapshot > 0 ? ", " + gigabytes(e.snapshot) + " kept for the sweep" : "") +
                  (e.stage > 0 ? ", " + gigabytes(e.stage) + " of the stage's float64 reference on every rank" : "") +
                  "), but this machine has " + gigabytes(available) + " available");
}

}  // namespace lossverify
