#pragma once
// What every rank and the reference read: logits, labels, masks and upstream weights of a case, as a
// pure function of (seed, stream, token, column), with the case's hand-written rows laid on top.
// A rank asks only for its own shard; the reference asks for whole rows; both get identical values.
#include <cstdint>
#include <unordered_map>

#include "lossverify/case/case.hpp"

namespace lossverify {

class InputSource {
 public:
  explicit InputSource(const Case& c);

  std::int64_t tokens() const { return case_.shape.tokens; }
  std::int64_t vocab() const { return case_.shape.vocab; }
  DType dtype() const { return case_.inputs.dtype; }

  // Logits of one token for columns [begin, end), rounded to the input dtype. The double overload
  // widens the rounded values exactly (what the reference reads).
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const;
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, float* out) const;
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::bfloat16* out) const;
  void logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::half* out) const;

  // Label of a token; equals the case's ignore_index for ignored tokens.
  std::int64_t label(std::int64_t token) const;
  bool is_valid(std::int64_t token) const { return label(token) != case_.loss.ignore_index; }
  // g_t of reduction "none" (1 otherwise).
  double upstream_weight(std::int64_t token) const;

 private:
  template <class T, class Convert>
  void fill(std::int64_t token, std::int64_t begin, std::int64_t end, T* out, Convert convert) const;

  const Case& case_;
  std::unordered_map<std::int64_t, const RowOverride*> overrides_;
};

}  // namespace lossverify
