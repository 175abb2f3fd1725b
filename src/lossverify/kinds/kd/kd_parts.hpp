#pragma once
// The KD module's parts, for its own files and the registry.
#include <memory>
#include <vector>

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

std::unique_ptr<LossKind> make_kd_kind();
std::unique_ptr<KindReference> make_kd_reference(const Case& c);
void kd_cpu_micro_batch(const CpuMicroBatch& batch);
std::vector<Implementation> kd_catalogue();

}  // namespace lossverify
