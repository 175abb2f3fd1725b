#include "lossverify/impl/rank_inputs.hpp"

#include "lossverify/kind_api/loss_kind.hpp"

#include <algorithm>

#include "lossverify/comm/progress_beacon.hpp"

namespace lossverify {

namespace {

template <class T>
void fill_logits(const InputSource& inputs, const RankAssignment& a, bool teacher, T* out, int threads) {
  const VocabRange vocab = a.vocab;
  const auto rows = static_cast<std::int64_t>(a.rows.size());
  ProgressBeacon* const beacon = ProgressBeacon::current();  // captured on the rank thread
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (std::int64_t i = 0; i < rows; ++i) {
    beat_row(beacon, i);
    const LocalRow& row = a.rows[static_cast<std::size_t>(i)];
    T* dst = out + i * vocab.size();
    if (row.token < 0) {
      inputs.padding_logits(row.sequence, row.position, vocab.begin, vocab.end, dst);
    } else if (teacher) {
      inputs.teacher_logits(row.token, vocab.begin, vocab.end, dst);
    } else {
      inputs.logits(row.token, vocab.begin, vocab.end, dst);
    }
  }
}

// The kind's per-token inputs of every row (a policy loss's cost one float64 pass over the token's row).
void fill_token_inputs(const Case& c, const InputSource& inputs, RankInputs& in, int threads) {
  const LossKind& kind = kind_of(c.loss);
  const std::size_t width = kind.token_inputs(c.loss).size();
  in.token_inputs.assign(width, std::vector<float>(static_cast<std::size_t>(in.rows()), 0.0f));
  if (width == 0) return;
  ProgressBeacon* const beacon = ProgressBeacon::current();  // captured on the rank thread
#pragma omp parallel num_threads(std::max(1, threads))
  {
    std::vector<float> values(width);
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t i = 0; i < in.rows(); ++i) {
      beat_row(beacon, i);
      const std::int64_t token = in.tokens[static_cast<std::size_t>(i)];
      if (token < 0) continue;
      kind.token_input_values(c, inputs, token, values);
      for (std::size_t k = 0; k < width; ++k) in.token_inputs[k][static_cast<std::size_t>(i)] = values[k];
    }
  }
}

}  // namespace

RankInputs make_rank_inputs(const Case& c, const InputSource& inputs, RankAssignment assignment, int threads) {
  RankInputs in;
  in.assignment = std::move(assignment);
  in.dtype = c.inputs.dtype;
  const bool teacher = kind_of(c.loss).inputs().teacher_logits;
  const auto rows = static_cast<std::size_t>(in.rows());
  const std::size_t bytes = rows * static_cast<std::size_t>(in.columns()) * dtype_size(in.dtype);
  in.logits.resize(bytes);
  if (teacher) in.teacher_logits.resize(bytes);
  dispatch_dtype(in.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    fill_logits(inputs, in.assignment, false, reinterpret_cast<T*>(in.logits.data()), threads);
    if (teacher) fill_logits(inputs, in.assignment, true, reinterpret_cast<T*>(in.teacher_logits.data()), threads);
  });
  const bool weighted = c.loss.reduction == Reduction::none;
  for (const LocalRow& row : in.assignment.rows) {
    const bool real = row.token >= 0;
    const bool valid = real && inputs.is_valid(row.token);
    in.labels.push_back(valid ? inputs.label(row.token) : c.loss.ignore_index);
    in.loss_mask.push_back(valid ? 1 : 0);
    in.tokens.push_back(row.token);
    in.token_ids.push_back(real ? inputs.token_id(row.token) : -1);
    in.sequences.push_back(row.sequence);
    in.positions.push_back(row.position);
    in.upstream_weights.push_back(!real ? 0.0 : weighted ? inputs.upstream_weight(row.token) : 1.0);
  }
  fill_token_inputs(c, inputs, in, threads);
  return in;
}

}  // namespace lossverify
