#pragma once
// Where every token lives: world rank <-> (tp, cp, dp) coordinates, sequences -> (DP rank, micro-batch)
// slots, and the load-balanced zigzag split of every sequence across CP ranks.
#include <cstdint>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/layout/global_batch.hpp"

namespace lossverify {

// World rank = (dp * CP + cp) * TP + tp: TP ranks are adjacent, as in Megatron's default order.
struct RankCoordinates {
  int tp = 0;
  int cp = 0;
  int dp = 0;
};
RankCoordinates coordinates_of(int world_rank, const LayoutSpec& layout);
int world_rank_of(const RankCoordinates& c, const LayoutSpec& layout);

// Indices of the sequences that DP rank `dp` processes in micro-batch `micro_batch`, in order.
std::vector<std::int64_t> sequences_of_slot(const GlobalBatch& batch, const BatchSpec& spec, const LayoutSpec& layout,
                                            int dp, int micro_batch);

// One local row of a rank: a global token, or a masked padding position.
struct LocalRow {
  std::int64_t token = -1;    // -1: padding
  std::int64_t sequence = 0;  // index in the global batch
  std::int64_t position = 0;  // position in the padded sequence
};

// Rows of CP rank `cp_rank` for the given sequences: each sequence is padded to a multiple of
// `pad_multiple` (2 * CP for the load-balanced layout), cut into 2 * CP chunks of H = L_pad / (2 CP)
// positions, and the rank holds chunks cp_rank and 2 CP - 1 - cp_rank, in that order.
std::vector<LocalRow> zigzag_rows(const GlobalBatch& batch, const std::vector<std::int64_t>& sequences, int cp,
                                  int cp_rank, std::int64_t pad_multiple);

// Sequence parallelism's part of TP rank `tp_rank` of one micro-batch's rows: padded to a multiple of `tp` with
// masked rows, then cut into `tp` contiguous parts of equal length.
std::vector<LocalRow> sequence_parallel_part(const std::vector<LocalRow>& rows, int tp, int tp_rank);
// The same part as indices into a micro-batch of `rows` rows: [0, rows) padded to a multiple of `tp` (the padding -1),
// TP rank `tp_rank`'s contiguous slice of it (ceil(rows / tp) slots).
std::vector<std::int64_t> sequence_parallel_slots(std::int64_t rows, int tp, int tp_rank);

// Padded length of a sequence of `length` tokens.
std::int64_t padded_length(std::int64_t length, std::int64_t pad_multiple);

// Where a global token sits in a layout: for reports ("rank 1's chunk 2 of sequence 5").
struct TokenPlace {
  std::int64_t sequence = -1;
  std::int64_t position = -1;
  int dp = -1;
  int micro_batch = -1;
  int cp = -1;
  int chunk = -1;
};
TokenPlace locate_token(const GlobalBatch& batch, const BatchSpec& spec, const LayoutSpec& layout, std::int64_t token);

}  // namespace lossverify
