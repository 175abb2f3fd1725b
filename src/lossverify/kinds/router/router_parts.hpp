#pragma once
// The router kind's files, as the kind uses them (kinds/router/). Not in the registry yet: a program registers it
// with register_loss_kind(make_router_kind()) (tests/kinds/router/).
#include <cstdint>
#include <memory>

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

// The kind's own bug switches (BugSwitches::kind_switches), one bit each (router_kind.cpp's catalogue).
namespace router_bug {
inline constexpr std::uint64_t local_counts = 1u << 0;     // moe-aux-local-counts
inline constexpr std::uint64_t topk_squared = 1u << 1;     // moe-aux-topk-squared
inline constexpr std::uint64_t tp_sum = 1u << 2;           // moe-aux-tp-sum
inline constexpr std::uint64_t cp_missing = 1u << 3;       // moe-aux-cp-missing
inline constexpr std::uint64_t padding_counted = 1u << 4;  // moe-aux-padding-counted
inline constexpr std::uint64_t no_grad = 1u << 5;          // moe-aux-no-grad
inline constexpr std::uint64_t log_doubled = 1u << 7;      // moe-aux-log-doubled
inline constexpr std::uint64_t ga_overweight = 1u << 6;    // moe-aux-ga-overweight
}  // namespace router_bug

std::unique_ptr<LossKind> make_router_kind();
std::unique_ptr<KindReference> make_router_reference(const Case& c, const InputSource& inputs);
KindRowPlan plan_router_rows(const RowPlanRequest& request);
void router_cpu_micro_batch(const CpuMicroBatch& batch);

}  // namespace lossverify
