#pragma once
// The global batch as packed sequences: token t of the global problem belongs to exactly one sequence.
// Independent of every rank layout, so the reference and every layout see the same problem.
#include <cstdint>
#include <vector>

#include "lossverify/case/case.hpp"

namespace lossverify {

struct Sequence {
  std::int64_t begin = 0;  // first global token
  std::int64_t length = 0;
};

class GlobalBatch {
 public:
  explicit GlobalBatch(const BatchSpec& spec);

  const std::vector<Sequence>& sequences() const { return sequences_; }
  std::int64_t tokens() const { return tokens_; }
  // Index of the sequence holding a global token.
  std::int64_t sequence_of(std::int64_t token) const;
  bool is_last_of_sequence(std::int64_t token) const;

 private:
  std::vector<Sequence> sequences_;
  std::int64_t tokens_ = 0;
};

}  // namespace lossverify
