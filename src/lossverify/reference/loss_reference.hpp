#pragma once
// Dense float64 reference of the global problem, written from the definitions of SPEC 3 and nothing
// else: no shards, no packed sums, no shared math header. It is evaluated one token at a time from a
// whole row of logits, so no N x V float64 array ever exists. It knows nothing of rank layouts: token
// weights come from the global valid count, labels from the global sequences.
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/inputs/input_source.hpp"

namespace lossverify {

struct ReferenceToken {
  bool valid = false;
  double lse = 0.0;     // log sum_v exp(x_v) (student logits / T for KD)
  double loss = 0.0;    // l_t (0 on masked tokens)
  double weight = 0.0;  // d L / d l_t: 1/N_v (mean), 1 (sum), g_t (none); 0 on masked tokens
};

class LossReference {
 public:
  LossReference(const Case& c, const InputSource& inputs);

  bool needs_teacher() const { return case_.loss.kind == LossKind::kd; }
  std::int64_t valid_tokens() const { return valid_tokens_; }
  double token_weight(std::int64_t token) const;

  // Loss of token t and, into grad (V entries), d L / d x[t, :] of the global objective.
  // `teacher` is read for KD only.
  ReferenceToken evaluate(std::int64_t token, std::span<const double> student, std::span<const double> teacher,
                          std::span<double> grad) const;

  // L of reduction mean or sum from the per-token losses (compensated, in token order).
  double reduced_loss(std::span<const double> token_losses) const;

 private:
  ReferenceToken cross_entropy(std::int64_t token, std::span<const double> x, std::span<double> grad) const;
  ReferenceToken kd(std::int64_t token, std::span<const double> x, std::span<const double> y,
                    std::span<double> grad) const;

  const Case& case_;
  const InputSource& inputs_;
  std::int64_t valid_tokens_ = 0;
  std::vector<char> valid_;
};

}  // namespace lossverify
