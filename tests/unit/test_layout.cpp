// Where every token lives (docs/spec.md §5): world rank <-> (tp, cp, dp), sequences -> (DP rank, micro-batch) slots,
// the load-balanced zigzag split across CP ranks, and locate_token. Expected values are built here from
// the definitions (enumerations and counts), not from the formulas of rank_layout.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/rank_layout.hpp"

using namespace lossverify;

namespace {

BatchSpec batch_of(std::vector<std::int64_t> lengths,
                   BatchSpec::Placement placement = BatchSpec::Placement::round_robin) {
  BatchSpec spec;
  spec.sequence_lengths = std::move(lengths);
  spec.placement = placement;
  return spec;
}

LayoutSpec layout_of(int tp, int cp, int dp, int ga) {
  LayoutSpec l;
  l.tp = tp;
  l.cp = cp;
  l.dp = dp;
  l.ga = ga;
  return l;
}

std::vector<std::int64_t> all_sequences(const GlobalBatch& batch) {
  std::vector<std::int64_t> out;
  for (std::size_t s = 0; s < batch.sequences().size(); ++s) out.push_back(static_cast<std::int64_t>(s));
  return out;
}

// ceil(length / (2 CP)): the chunk length H of the load-balanced layout.
std::int64_t chunk_length(std::int64_t length, int cp) { return (length + 2 * cp - 1) / (2 * cp); }

}  // namespace

TEST_CASE("world_rank_order_is_tp_fastest_then_cp_then_dp_and_round_trips") {
  const LayoutSpec layouts[] = {layout_of(1, 1, 1, 1), layout_of(4, 1, 1, 1), layout_of(1, 3, 1, 1),
                                layout_of(1, 1, 5, 1), layout_of(2, 3, 4, 1), layout_of(3, 2, 2, 2),
                                layout_of(8, 4, 2, 1)};
  for (const LayoutSpec& layout : layouts) {
    CAPTURE(layout.tp);
    CAPTURE(layout.cp);
    CAPTURE(layout.dp);
    // Enumerate dp outermost, tp innermost: the world rank is the running count.
    int rank = 0;
    for (int dp = 0; dp < layout.dp; ++dp) {
      for (int cp = 0; cp < layout.cp; ++cp) {
        for (int tp = 0; tp < layout.tp; ++tp, ++rank) {
          const RankCoordinates c = coordinates_of(rank, layout);
          CHECK(c.tp == tp);
          CHECK(c.cp == cp);
          CHECK(c.dp == dp);
          CHECK(world_rank_of(RankCoordinates{tp, cp, dp}, layout) == rank);
          CHECK(world_rank_of(c, layout) == rank);
        }
      }
    }
    CHECK(rank == layout.world_size());
  }
}

TEST_CASE("padded_length_is_the_next_multiple_of_the_pad") {
  CHECK(padded_length(1, 4) == 4);
  CHECK(padded_length(4, 4) == 4);
  CHECK(padded_length(5, 4) == 8);
  CHECK(padded_length(13, 6) == 18);
  CHECK(padded_length(7, 1) == 7);
  CHECK(padded_length(7, 2) == 8);
}

TEST_CASE("zigzag_rows_cover_every_token_once_with_chunks_c_and_2cp_minus_1_minus_c") {
  // Lengths divisible by 2 CP for some CP and not for others (1, 5, 7, 13, 23 divide by none).
  const std::vector<std::int64_t> lengths = {1, 5, 7, 8, 12, 13, 16, 23, 24};
  const BatchSpec spec = batch_of(lengths);
  const GlobalBatch batch(spec);
  const std::vector<std::int64_t> sequences = all_sequences(batch);
  for (int cp : {1, 2, 3, 4}) {
    CAPTURE(cp);
    const std::int64_t chunks = 2 * static_cast<std::int64_t>(cp);
    std::vector<int> seen(static_cast<std::size_t>(batch.tokens()), 0);
    for (int c = 0; c < cp; ++c) {
      CAPTURE(c);
      const std::vector<LocalRow> rows = zigzag_rows(batch, sequences, cp, c, chunks);
      std::size_t i = 0;
      for (std::int64_t s : sequences) {
        const Sequence& seq = batch.sequences()[static_cast<std::size_t>(s)];
        const std::int64_t h = chunk_length(seq.length, cp);
        // Padded to a multiple of 2 CP, with fewer than 2 CP padding positions.
        const std::int64_t padded = padded_length(seq.length, chunks);
        CHECK(padded == chunks * h);
        CHECK(padded % chunks == 0);
        CHECK(padded >= seq.length);
        CHECK(padded < seq.length + chunks);
        // Chunk c first, then chunk 2 CP - 1 - c, H positions each.
        for (std::int64_t chunk : {static_cast<std::int64_t>(c), chunks - 1 - c}) {
          for (std::int64_t j = 0; j < h; ++j, ++i) {
            REQUIRE(i < rows.size());
            const LocalRow& row = rows[i];
            const std::int64_t position = chunk * h + j;
            CHECK(row.sequence == s);
            CHECK(row.position == position);
            if (position < seq.length) {
              CHECK(row.token == seq.begin + position);
              ++seen[static_cast<std::size_t>(row.token)];
            } else {
              CHECK(row.token == -1);
              CHECK(row.position >= seq.length);
            }
          }
        }
      }
      CHECK(i == rows.size());
    }
    for (std::int64_t t = 0; t < batch.tokens(); ++t) {
      CAPTURE(t);
      CHECK(seen[static_cast<std::size_t>(t)] == 1);
    }
  }
}

TEST_CASE("zigzag_rows_at_cp2_of_a_length_6_sequence") {
  // L = 6 pads to 8, H = 2: chunks {0,1}, {2,3}, {4,5}, {6,7}. Rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  const GlobalBatch batch(batch_of({3, 6}));
  const std::vector<LocalRow> rank0 = zigzag_rows(batch, {1}, 2, 0, 4);
  const std::vector<LocalRow> rank1 = zigzag_rows(batch, {1}, 2, 1, 4);
  REQUIRE(rank0.size() == 4);
  REQUIRE(rank1.size() == 4);
  const std::int64_t tokens0[] = {3, 4, -1, -1};  // positions 0, 1, 6, 7 (6 and 7 pad)
  const std::int64_t positions0[] = {0, 1, 6, 7};
  const std::int64_t tokens1[] = {5, 6, 7, 8};  // positions 2, 3, 4, 5
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(rank0[i].token == tokens0[i]);
    CHECK(rank0[i].position == positions0[i]);
    CHECK(rank0[i].sequence == 1);
    CHECK(rank1[i].token == tokens1[i]);
    CHECK(rank1[i].position == static_cast<std::int64_t>(i) + 2);
  }
}

TEST_CASE("round_robin_placement_sends_sequence_i_to_dp_i_mod_dp_and_micro_batch_i_div_dp_mod_ga") {
  struct Shape {
    int sequences, dp, ga;
  };
  // Includes more slots (dp x ga) than sequences.
  for (const Shape shape :
       {Shape{11, 3, 2}, Shape{8, 2, 2}, Shape{5, 1, 3}, Shape{3, 2, 3}, Shape{1, 4, 2}, Shape{7, 4, 1}}) {
    CAPTURE(shape.sequences);
    CAPTURE(shape.dp);
    CAPTURE(shape.ga);
    const BatchSpec spec = batch_of(std::vector<std::int64_t>(static_cast<std::size_t>(shape.sequences), 3));
    const GlobalBatch batch(spec);
    const LayoutSpec layout = layout_of(1, 1, shape.dp, shape.ga);
    std::vector<int> seen(static_cast<std::size_t>(shape.sequences), 0);
    for (int d = 0; d < shape.dp; ++d) {
      for (int k = 0; k < shape.ga; ++k) {
        std::vector<std::int64_t> expected;
        for (std::int64_t i = 0; i < shape.sequences; ++i) {
          if (i % shape.dp == d && (i / shape.dp) % shape.ga == k) expected.push_back(i);
        }
        const std::vector<std::int64_t> got = sequences_of_slot(batch, spec, layout, d, k);
        CHECK(got == expected);
        for (std::int64_t s : got) ++seen[static_cast<std::size_t>(s)];
      }
    }
    for (int count : seen) CHECK(count == 1);
  }
}

TEST_CASE("contiguous_placement_puts_every_sequence_in_one_slot_in_order") {
  struct Shape {
    int sequences, dp, ga;
  };
  for (const Shape shape : {Shape{11, 3, 2}, Shape{8, 2, 2}, Shape{5, 1, 3}, Shape{3, 2, 3}, Shape{1, 4, 2},
                            Shape{7, 4, 1}, Shape{13, 2, 4}}) {
    CAPTURE(shape.sequences);
    CAPTURE(shape.dp);
    CAPTURE(shape.ga);
    const BatchSpec spec = batch_of(std::vector<std::int64_t>(static_cast<std::size_t>(shape.sequences), 2),
                                    BatchSpec::Placement::contiguous);
    const GlobalBatch batch(spec);
    const LayoutSpec layout = layout_of(1, 1, shape.dp, shape.ga);
    // Slots in the order (dp 0, mb 0), (dp 0, mb 1), ..., (dp 1, mb 0), ...: concatenated they give 0, 1, ..., n-1,
    // which says at once: every sequence exactly once, each slot a contiguous run, the runs in order.
    std::vector<std::int64_t> concatenated;
    std::size_t smallest = static_cast<std::size_t>(shape.sequences);
    std::size_t largest = 0;
    for (int d = 0; d < shape.dp; ++d) {
      for (int k = 0; k < shape.ga; ++k) {
        const std::vector<std::int64_t> got = sequences_of_slot(batch, spec, layout, d, k);
        concatenated.insert(concatenated.end(), got.begin(), got.end());
        smallest = std::min(smallest, got.size());
        largest = std::max(largest, got.size());
      }
    }
    std::vector<std::int64_t> expected;
    for (std::int64_t i = 0; i < shape.sequences; ++i) expected.push_back(i);
    CHECK(concatenated == expected);
    // Balanced: slot sizes are floor or ceil of n / slots (empty slots only when there are more slots than sequences).
    CHECK(largest - smallest <= 1);
  }
}

TEST_CASE("locate_token_names_the_slot_cp_rank_and_chunk_that_zigzag_rows_give_the_token") {
  const std::vector<std::int64_t> lengths = {9, 4, 1, 14, 6, 3, 11};
  for (const auto placement : {BatchSpec::Placement::round_robin, BatchSpec::Placement::contiguous}) {
    const BatchSpec spec = batch_of(lengths, placement);
    const GlobalBatch batch(spec);
    for (const LayoutSpec layout : {layout_of(1, 1, 1, 1), layout_of(2, 2, 1, 1), layout_of(1, 3, 2, 1),
                                    layout_of(1, 2, 2, 2), layout_of(1, 4, 1, 3)}) {
      CAPTURE(static_cast<int>(placement));
      CAPTURE(layout.cp);
      CAPTURE(layout.dp);
      CAPTURE(layout.ga);
      const std::int64_t chunks = 2 * static_cast<std::int64_t>(layout.cp);
      std::int64_t located = 0;
      for (int d = 0; d < layout.dp; ++d) {
        for (int k = 0; k < layout.ga; ++k) {
          const std::vector<std::int64_t> sequences = sequences_of_slot(batch, spec, layout, d, k);
          for (int c = 0; c < layout.cp; ++c) {
            for (const LocalRow& row : zigzag_rows(batch, sequences, layout.cp, c, chunks)) {
              if (row.token < 0) continue;
              CAPTURE(row.token);
              const TokenPlace p = locate_token(batch, spec, layout, row.token);
              const std::int64_t h = chunk_length(lengths[static_cast<std::size_t>(row.sequence)], layout.cp);
              CHECK(p.sequence == row.sequence);
              CHECK(p.position == row.position);
              CHECK(p.dp == d);
              CHECK(p.micro_batch == k);
              CHECK(p.cp == c);
              CHECK(p.chunk == row.position / h);
              CHECK((p.chunk == c || p.chunk == chunks - 1 - c));
              ++located;
            }
          }
        }
      }
      CHECK(located == batch.tokens());
    }
  }
}

TEST_CASE("locate_token_outside_the_batch_gives_an_empty_place") {
  const BatchSpec spec = batch_of({4, 4});
  const GlobalBatch batch(spec);
  const LayoutSpec layout = layout_of(1, 2, 1, 1);
  for (std::int64_t token : {std::int64_t{-1}, std::int64_t{8}, std::int64_t{100}}) {
    const TokenPlace p = locate_token(batch, spec, layout, token);
    CHECK(p.sequence == -1);
    CHECK(p.position == -1);
    CHECK(p.dp == -1);
    CHECK(p.cp == -1);
    CHECK(p.chunk == -1);
  }
}

TEST_CASE("global_batch_maps_tokens_to_packed_sequences_and_finds_sequence_ends") {
  const GlobalBatch batch(batch_of({3, 1, 4, 2}));
  CHECK(batch.tokens() == 10);
  REQUIRE(batch.sequences().size() == 4);
  const std::int64_t begins[] = {0, 3, 4, 8};
  for (std::size_t s = 0; s < 4; ++s) CHECK(batch.sequences()[s].begin == begins[s]);
  const std::int64_t sequence_of[] = {0, 0, 0, 1, 2, 2, 2, 2, 3, 3};
  const bool last[] = {false, false, true, true, false, false, false, true, false, true};
  for (std::int64_t t = 0; t < 10; ++t) {
    CAPTURE(t);
    CHECK(batch.sequence_of(t) == sequence_of[t]);
    CHECK(batch.is_last_of_sequence(t) == last[t]);
  }
}

TEST_CASE("global_batch_of_one_sequence_holds_every_token") {
  const GlobalBatch batch(batch_of({7}));
  CHECK(batch.tokens() == 7);
  for (std::int64_t t = 0; t < 7; ++t) {
    CHECK(batch.sequence_of(t) == 0);
    CHECK(batch.is_last_of_sequence(t) == (t == 6));
  }
}

TEST_CASE("sequence_parallel_slots_name_the_rows_of_sequence_parallel_part_and_cover_a_micro_batch_once") {
  for (const std::int64_t count : {1, 5, 8, 11}) {
    for (const int tp : {2, 3, 4}) {
      std::vector<LocalRow> rows(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) rows[static_cast<std::size_t>(i)].token = 100 + i;
      std::vector<int> seen(static_cast<std::size_t>(count), 0);
      for (int r = 0; r < tp; ++r) {
        const std::vector<LocalRow> part = sequence_parallel_part(rows, tp, r);
        const std::vector<std::int64_t> slots = sequence_parallel_slots(count, tp, r);
        REQUIRE(slots.size() == part.size());
        CHECK(slots.size() == static_cast<std::size_t>((count + tp - 1) / tp));
        for (std::size_t j = 0; j < slots.size(); ++j) {
          CHECK(part[j].token == (slots[j] < 0 ? -1 : 100 + slots[j]));
          if (slots[j] >= 0) ++seen[static_cast<std::size_t>(slots[j])];
        }
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    }
  }
}
