#pragma once
// The cross-entropy module's parts, for its own files and the registry.
#include <memory>
#include <vector>

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

std::unique_ptr<LossKind> make_cross_entropy_kind();
std::unique_ptr<KindReference> make_cross_entropy_reference(const Case& c, const InputSource& inputs);
// The target distribution q_v of docs/spec.md §3 in float64, at the label's column and at any other (the
// reference's, and the GPU oracle's through the row model).
struct TargetWeights {
  double on = 1.0, off = 0.0;
};
TargetWeights cross_entropy_target_weights(const Case& c);
void cross_entropy_cpu_micro_batch(const CpuMicroBatch& batch);
std::vector<Implementation> cross_entropy_catalogue();

}  // namespace lossverify
