#include "lossverify/layout/global_batch.hpp"

#include <algorithm>

namespace lossverify {

GlobalBatch::GlobalBatch(const BatchSpec& spec) {
  for (std::int64_t length : spec.sequence_lengths) {
    sequences_.push_back({tokens_, length});
    tokens_ += length;
  }
}

std::int64_t GlobalBatch::sequence_of(std::int64_t token) const {
  const auto it = std::upper_bound(sequences_.begin(), sequences_.end(), token,
                                   [](std::int64_t t, const Sequence& s) { return t < s.begin; });
  return static_cast<std::int64_t>(it - sequences_.begin()) - 1;
}

bool GlobalBatch::is_last_of_sequence(std::int64_t token) const {
  const Sequence& s = sequences_[static_cast<std::size_t>(sequence_of(token))];
  return token == s.begin + s.length - 1;
}

}  // namespace lossverify
