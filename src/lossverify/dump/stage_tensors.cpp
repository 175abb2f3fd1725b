#include "lossverify/dump/stage_tensors.hpp"

namespace lossverify::dump {

std::vector<std::int64_t> stage_input_shape(const StageInput& input, const RankAssignment& assignment) {
  switch (input.rows) {
    case StageInput::Rows::token:
      return {static_cast<std::int64_t>(assignment.rows.size()), input.width};
    case StageInput::Rows::column:
      return {assignment.vocab.size(), input.width};
    case StageInput::Rows::vocabulary:
      break;
  }
  return {assignment.vocab.size()};
}

std::vector<double> stage_input_values(const StageInput& input, const InputSource& inputs,
                                       const RankAssignment& assignment) {
  const VocabRange vocab = assignment.vocab;
  if (input.rows == StageInput::Rows::vocabulary) {
    std::vector<double> out(static_cast<std::size_t>(vocab.size()));
    inputs.stage_values(input.stream, 0, vocab.begin, vocab.end, input.scale, out.data());
    return out;
  }
  const auto width = static_cast<std::size_t>(input.width);
  const bool per_token = input.rows == StageInput::Rows::token;
  const std::size_t rows = per_token ? assignment.rows.size() : static_cast<std::size_t>(vocab.size());
  std::vector<double> out(rows * width, 0.0);
  for (std::size_t i = 0; i < rows; ++i) {
    const std::int64_t row = per_token ? assignment.rows[i].token : vocab.begin + static_cast<std::int64_t>(i);
    if (row < 0) continue;  // CP padding: zeros (no reference reads them)
    inputs.stage_values(input.stream, static_cast<std::uint64_t>(row), 0, input.width, input.scale, &out[i * width]);
  }
  return out;
}

std::vector<std::byte> to_dtype_bytes(const std::vector<double>& values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * dtype_size(dtype));
  dispatch_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    T* out = reinterpret_cast<T*>(bytes.data());
    for (std::size_t k = 0; k < values.size(); ++k) out[k] = T(static_cast<float>(values[k]));
  });
  return bytes;
}

}  // namespace lossverify::dump
