#pragma once
// A rank's exact inputs as owned data: its logits shard (and teacher shard), the data loader's labels, the
// loss mask, and where each local row comes from. `export-inputs` writes them for code outside lossverify
// (the Python harness), and the plugin backend hands a copy to a plugin, so what a plugin or a PyTorch
// function reads is bit for bit what the built-in kernels read. The reference never reads these buffers:
// it regenerates its own rows from the InputSource.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

struct RankInputs {
  RankAssignment assignment;
  DType dtype = DType::fp32;
  std::vector<std::byte> logits;          // rows x vocab.size() in dtype, row major
  std::vector<std::byte> teacher_logits;  // KD only
  // Per local row (CP padding rows: label ignore_index, mask 0, token / token id -1, weight 0).
  std::vector<std::int64_t> labels;      // next-token labels made on the whole sequence before any split
  std::vector<std::uint8_t> loss_mask;   // 1: the token counts in the loss
  std::vector<std::int64_t> tokens;      // global token, -1 for padding
  std::vector<std::int64_t> token_ids;   // the input token id at that position, -1 for padding
  std::vector<std::int64_t> sequences;   // sequence index in the global batch
  std::vector<std::int64_t> positions;   // position in the (padded) sequence
  std::vector<double> upstream_weights;  // g_t of reduction none, 1 otherwise, 0 on padding
  // The kind's per-token inputs (its token_inputs(), in that order), one column of rows values each, 0 on padding.
  std::vector<std::vector<float>> token_inputs;

  std::int64_t rows() const { return static_cast<std::int64_t>(assignment.rows.size()); }
  std::int64_t columns() const { return assignment.vocab.size(); }
};

// Generates the rank's inputs exactly as the CPU kernel does (the same InputSource calls).
RankInputs make_rank_inputs(const Case& c, const InputSource& inputs, RankAssignment assignment, int threads = 1);

}  // namespace lossverify
