#pragma once
// The cross-entropy module's parts, for its own files and the registry.
#include <memory>
#include <vector>

#include "lossverify/kinds/loss_kind.hpp"

namespace lossverify {

std::unique_ptr<LossKind> make_cross_entropy_kind();
std::unique_ptr<KindReference> make_cross_entropy_reference(const Case& c, const InputSource& inputs);
void cross_entropy_cpu_micro_batch(const CpuMicroBatch& batch);
std::vector<Implementation> cross_entropy_catalogue();

}  // namespace lossverify
