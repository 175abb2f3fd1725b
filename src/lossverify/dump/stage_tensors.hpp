#pragma once
// A stage's own inputs (Stage::inputs: an LM head's h, W, b) as a rank holds them, for export-inputs and check-dump
// alike: a token-rowed input holds the rank's rows (zeros on CP padding rows), a column-rowed input the rows of the
// rank's vocabulary columns, a vocabulary-long input the rank's columns of its one row.
#include <cstdint>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::dump {

// The tensor's shape on a rank: [rows, width] for token and column rows, [columns] for a vocabulary-long one.
std::vector<std::int64_t> stage_input_shape(const StageInput& input, const RankAssignment& assignment);
// The rank's values of the input, row major, as InputSource::stage_values serves them (exact in the dtype).
std::vector<double> stage_input_values(const StageInput& input, const InputSource& inputs,
                                       const RankAssignment& assignment);
// The values in the dtype's bytes (each exact in it).
std::vector<std::byte> to_dtype_bytes(const std::vector<double>& values, DType dtype);

}  // namespace lossverify::dump
