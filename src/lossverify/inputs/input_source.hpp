#pragma once
// What every rank and the reference read: logits, labels, masks and upstream weights of a case, as a
// pure function of (seed, stream, token, column), with the case's hand-written rows laid on top.
// A rank asks only for its own shard; the reference asks for whole rows; both get identical values.
#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/layout/global_batch.hpp"

namespace lossverify {

// Inputs given as data rather than generated (check-dump: tensors a framework dumped). Rows are global
// tokens; every student (and, for KD, teacher) row is V values wide in the case's input dtype.
struct ExplicitInputs {
  std::vector<std::byte> student;    // N x V in the case's dtype, row major
  std::vector<std::byte> teacher;    // N x V (KD only; empty otherwise)
  std::vector<std::int64_t> labels;  // N labels (cross-entropy; the ignore_index where ignored)
  std::vector<char> loss_mask;       // N: 1 = the token counts (before the label test), 0 = masked out
  // The kind's per-token inputs (the kind's token_inputs()), in its order, N values each.
  std::vector<std::vector<float>> token_inputs;
  // A stage's own inputs (Stage::inputs: an LM head's h, W, b), each `rows` x `width` values of the case's dtype,
  // widened exactly: InputSource::stage_values serves row r, columns [b, e) of the tensor of its stream from here.
  struct StageTensor {
    InputStream stream{};
    std::int64_t rows = 0, width = 0;
    std::vector<double> values;
  };
  std::vector<StageTensor> stage;
};

class InputSource {
 public:
  // Philox mode: inputs are a pure function of (seed, stream, token, column).
  explicit InputSource(const Case& c);
  // Explicit mode: inputs are the given data (the case's seed, distribution and overrides are not used;
  // its loss, shape, dtype and batch are). Sizes must match the case: N x V x dtype size, N labels/masks.
  InputSource(const Case& c, ExplicitInputs data);
  bool is_explicit() const { return explicit_; }
  // Explicit mode: the kind's per-token input `index` (the kind's token_inputs()), N values; empty otherwise.
  std::span<const float> explicit_token_input(std::size_t index) const {
    return index < explicit_token_inputs_.size() ? std::span<const float>(explicit_token_inputs_[index])
                                                 : std::span<const float>();
  }

  // Generates every student (and teacher) row once, in the input dtype, and serves later requests from
  // memory: the same values, for callers that read the same inputs many times (the gate, sweeps).
  // Returns false, keeping nothing, when the rows would need more than `max_bytes`.
  bool materialize(int threads, std::size_t max_bytes);
  bool materialized() const { return !cache_student_.empty(); }

  std::int64_t tokens() const { return case_.shape.tokens; }
  std::int64_t vocab() const { return case_.shape.vocab; }
  DType dtype() const { return case_.inputs.dtype; }

  // Logits of one token for columns [begin, end), rounded to the input dtype. The double overload
  // widens the rounded values exactly (what the reference reads).
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const;
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, float* out) const;
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::bfloat16* out) const;
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::half* out) const;

  // Teacher logits of a KD case (the student's when the case says same_as_student).
  void teacher_logits(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const;
  void teacher_logits(std::int64_t token, std::int64_t begin, std::int64_t end, float* out) const;
  void teacher_logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::bfloat16* out) const;
  void teacher_logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::half* out) const;
  // Logits at a CP padding position (masked, so any values do; these are deterministic).
  void padding_logits(std::int64_t sequence, std::int64_t position, std::int64_t begin, std::int64_t end,
                      float* out) const;
  void padding_logits(std::int64_t sequence, std::int64_t position, std::int64_t begin, std::int64_t end,
                      Eigen::bfloat16* out) const;
  void padding_logits(std::int64_t sequence, std::int64_t position, std::int64_t begin, std::int64_t end,
                      Eigen::half* out) const;

  // A stage's own inputs (an LM head's hidden states, weight and bias): row `row` of Philox stream `stream`, columns
  // [begin, end), normal(0, scale) rounded to the input dtype and widened exactly; in explicit mode the given tensor of
  // that stream (ExplicitInputs::stage; InternalError where none is given or the row or columns lie outside it).
  void stage_values(InputStream stream, std::uint64_t row, std::int64_t begin, std::int64_t end, double scale,
                    double* out) const;
  // The case's override of a token's inputs (inputs.overrides), or null.
  const RowOverride* override_of(std::int64_t token) const {
    const auto it = overrides_.find(token);
    return it == overrides_.end() ? nullptr : it->second;
  }
  // Token id at a global position (what next-token labels are made of).
  std::int64_t token_id(std::int64_t token) const;
  // The loss mask drawn with ignore_fraction (true: the token is masked out).
  bool masked(std::int64_t token) const;
  // Label of a token; equals the case's ignore_index for ignored and masked tokens. With next-token
  // labels, label[t] = token_id[t + 1] within a sequence and the last position is masked.
  std::int64_t label(std::int64_t token) const;
  // Whether the token counts in the loss: cross-entropy needs a label, KD only the mask.
  bool is_valid(std::int64_t token) const;
  // The step's valid tokens (counted at construction).
  std::int64_t valid_tokens() const;
  const GlobalBatch& batch() const { return batch_; }
  // Whether any token of the batch's sequence s is valid (counted once at construction).
  bool sequence_has_valid_token(std::int64_t s) const { return sequence_has_valid_[static_cast<std::size_t>(s)] != 0; }
  // g_t of reduction "none" (1 otherwise).
  double upstream_weight(std::int64_t token) const;

 private:
  template <class T>
  void fill(InputStream stream, std::uint64_t counter_token, std::int64_t begin, std::int64_t end, T* out, double mean,
            double scale, bool use_overrides) const;

  template <class T>
  bool read_cache(const std::vector<std::byte>& cache, std::int64_t token, std::int64_t begin, std::int64_t end,
                  T* out) const;
  std::int64_t generated_label_of(std::int64_t token) const;
  void find_sequences_with_valid_tokens();

  const Case& case_;
  bool explicit_ = false;
  std::vector<std::int64_t> explicit_labels_;
  std::vector<char> explicit_mask_;
  std::vector<std::vector<float>> explicit_token_inputs_;
  std::vector<ExplicitInputs::StageTensor> explicit_stage_;
  GlobalBatch batch_;
  std::vector<std::byte> cache_student_;
  std::vector<std::byte> cache_teacher_;
  std::unordered_map<std::int64_t, const RowOverride*> overrides_;
  // Generated inputs: every token's label, drawn once at construction (the rank plans and the
  // reference ask for each label several times, a Philox draw each).
  std::vector<std::int64_t> labels_;
  // Token ids moved onto the shard edges (place_labels_on_shard_edges), by token.
  std::unordered_map<std::int64_t, std::int64_t> placed_ids_;
  std::vector<char> sequence_has_valid_;
  std::int64_t valid_tokens_ = 0;
  void place_labels_on_shard_edges();
};

}  // namespace lossverify
