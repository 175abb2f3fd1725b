#pragma once
// The router kind's files, as the kind uses them (kinds/router/).
#include <cstdint>
#include <memory>

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

// The kind's own bug switches (BugSwitches::kind_switches), one bit each (router_kind.cpp's catalogue).
namespace router_bug {
inline constexpr std::uint64_t local_counts = 1u << 0;              // moe-aux-local-counts
inline constexpr std::uint64_t topk_squared = 1u << 1;              // moe-aux-topk-squared
inline constexpr std::uint64_t tp_sum = 1u << 2;                    // moe-aux-tp-sum
inline constexpr std::uint64_t cp_missing = 1u << 3;                // moe-aux-cp-missing
inline constexpr std::uint64_t padding_counted = 1u << 4;           // moe-aux-padding-counted
inline constexpr std::uint64_t no_grad = 1u << 5;                   // moe-aux-no-grad
inline constexpr std::uint64_t log_doubled = 1u << 7;               // moe-aux-log-doubled
inline constexpr std::uint64_t ga_overweight = 1u << 6;             // moe-aux-ga-overweight
inline constexpr std::uint64_t per_token_divided = 1u << 8;         // moe-aux-per-token-divided
inline constexpr std::uint64_t per_token_tp_cp = 1u << 9;           // moe-aux-per-token-tp-cp
inline constexpr std::uint64_t seq_aux_mbs = 1u << 10;              // moe-seq-aux-mbs
inline constexpr std::uint64_t count_not_returned = 1u << 11;       // moe-aux-count-not-returned
inline constexpr std::uint64_t global_topk = 1u << 12;              // moe-aux-global-topk
inline constexpr std::uint64_t per_token_rank_count = 1u << 13;     // moe-aux-per-token-rank-count
inline constexpr std::uint64_t zloss_rank_mean = 1u << 14;          // moe-zloss-rank-mean
inline constexpr std::uint64_t per_token_reduced_count = 1u << 15;  // moe-aux-per-token-reduced-count
inline constexpr std::uint64_t seq_aux_mean_length = 1u << 16;      // moe-seq-aux-mean-length
inline constexpr std::uint64_t global_mean_counts = 1u << 17;       // moe-global-aux-mean-counts
inline constexpr std::uint64_t global_batch_tokens = 1u << 18;      // moe-global-aux-batch-tokens
inline constexpr std::uint64_t mask_ignored = 1u << 19;             // moe-aux-mask-ignored
inline constexpr std::uint64_t mask_counts_only = 1u << 20;         // moe-aux-mask-counts-only
inline constexpr std::uint64_t ga_double_divide = 1u << 21;         // moe-aux-ga-double-divide
inline constexpr std::uint64_t seq_aux_packed = 1u << 22;           // moe-seq-aux-packed
inline constexpr std::uint64_t aux_loss_dp_ga_summed = 1u << 23;    // moe-aux-loss-dp-ga-summed
// The bugs that route a micro-batch's padded and masked rows as tokens: they get a gradient (and a backward weight).
inline constexpr std::uint64_t routes_padding = mask_ignored | mask_counts_only;
// moe-aux-global-topk's global setting: the common default, read where the router's own k should be.
inline constexpr int global_top_k = 2;
}  // namespace router_bug

// What the plan hands each local row's kernel (KindRowPlan::row_inputs), row major: the micro-batch scope's valid
// tokens T_S (over the sequence partition), the rank's own valid tokens of that micro-batch, the step's valid tokens,
// the row's sequence among the micro-batch's (-1: none) and the micro-batch's sequences.
inline constexpr std::size_t kRouterRowInputs = 5;

std::unique_ptr<LossKind> make_router_kind();
std::unique_ptr<KindReference> make_router_reference(const Case& c, const InputSource& inputs);
KindRowPlan plan_router_rows(const RowPlanRequest& request);
void router_cpu_micro_batch(const CpuMicroBatch& batch);
// The valid tokens of a micro-batch's rows [begin, begin + n) over every rank holding its other tokens (the batch
// group's sum): what moe-global-aux-batch-tokens divides P by; both backends' kernels (router_cpu.cpp).
float router_batch_valid_tokens(const RankPlan& plan, RankGroups& groups, std::int64_t begin, std::int64_t n);

}  // namespace lossverify
