#pragma once
#include <cstdint>

#include "lossverify/core/host_device.hpp"

namespace lossverify {

// Columns [begin, end) of the vocabulary owned by one tensor-parallel rank.
struct VocabRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  LV_HOST_DEVICE std::int64_t size() const { return end - begin; }
  LV_HOST_DEVICE bool contains(std::int64_t column) const { return column >= begin && column < end; }
};

// Uneven shards allowed: the first (V mod TP) ranks own one column more.
// lo_r = r * floor(V / TP) + min(r, V mod TP)
LV_HOST_DEVICE std::int64_t vocab_shard_begin(std::int64_t vocab, int tp, int rank) {
  const std::int64_t base = vocab / tp;
  const std::int64_t extra = vocab % tp;
  return rank * base + (rank < extra ? rank : extra);
}

LV_HOST_DEVICE VocabRange vocab_range(std::int64_t vocab, int tp, int rank) {
  return VocabRange{vocab_shard_begin(vocab, tp, rank), vocab_shard_begin(vocab, tp, rank + 1)};
}

}  // namespace lossverify
