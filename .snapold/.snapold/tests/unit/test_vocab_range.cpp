#include <doctest/doctest.h>

#include <algorithm>
#include <initializer_list>

#include "lossverify/layout/vocab_range.hpp"

using namespace lossverify;

TEST_CASE("vocabulary_shards_partition_0_v_with_sizes_differing_by_at_most_one") {
  for (std::int64_t vocab : {2, 3, 7, 507, 1000, 32000, 151936}) {
    for (int tp = 1; tp <= 16 && tp <= vocab; ++tp) {
      std::int64_t next = 0;
      for (int r = 0; r < tp; ++r) {
        const VocabRange range = vocab_range(vocab, tp, r);
        CHECK(range.begin == next);
        CHECK(range.size() >= vocab / tp);
        CHECK(range.size() <= vocab / tp + 1);
        CHECK(range.begin == r * (vocab / tp) + std::min<std::int64_t>(r, vocab % tp));
        next = range.end;
      }
      CHECK(next == vocab);
    }
  }
}

TEST_CASE("v_507_at_tp_4_gives_shards_of_127_127_127_126") {
  CHECK(vocab_range(507, 4, 0).size() == 127);
  CHECK(vocab_range(507, 4, 1).size() == 127);
  CHECK(vocab_range(507, 4, 2).size() == 127);
  CHECK(vocab_range(507, 4, 3).size() == 126);
}
