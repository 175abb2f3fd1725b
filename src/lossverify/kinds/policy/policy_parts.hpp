#pragma once
// The policy kind's files, as the kind uses them (kinds/policy/).
#include <cstdint>
#include <memory>
#include <vector>

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

// The kind's own bug switches (BugSwitches::kind_switches), one bit each (policy_catalogue.cpp).
namespace policy_bug {
inline constexpr std::uint64_t logprob_untracked_allreduce = 1u << 0;
inline constexpr std::uint64_t entropy_untracked_allreduce = 1u << 1;
inline constexpr std::uint64_t logprob_allgather_grad_sum = 1u << 2;
inline constexpr std::uint64_t temperature_one_side = 1u << 3;
inline constexpr std::uint64_t token_mean_sample_weighted = 1u << 4;
inline constexpr std::uint64_t microbatch_self_normalized = 1u << 5;
inline constexpr std::uint64_t drgrpo_batch_sum = 1u << 6;
inline constexpr std::uint64_t cp_extra_scale = 1u << 7;
// 1u << 8 was rl-schedule-double-divide's, now a layout bug of every kind (BugSwitches::schedule_double_divide).
inline constexpr std::uint64_t adv_whiten_dp_only = 1u << 9;
inline constexpr std::uint64_t fused_vocab_pad = 1u << 10;
inline constexpr std::uint64_t kl_no_grad = 1u << 11;
inline constexpr std::uint64_t gspo_cp_local_ratio = 1u << 12;
inline constexpr std::uint64_t logsoftmax_untracked_allreduce = 1u << 13;
inline constexpr std::uint64_t stats_microbatch_mean = 1u << 14;
inline constexpr std::uint64_t logprob_16bit = 1u << 15;
inline constexpr std::uint64_t drgrpo_rank_batch_sum = 1u << 16;
inline constexpr std::uint64_t aux_token_mean = 1u << 17;
inline constexpr std::uint64_t aux_sample_weighted = 1u << 18;
inline constexpr std::uint64_t aux_microbatch_mean = 1u << 19;
inline constexpr std::uint64_t temperature_16bit = 1u << 20;
inline constexpr std::uint64_t kl_score_function = 1u << 21;
inline constexpr std::uint64_t seq_mean_counts_empty = 1u << 22;
inline constexpr std::uint64_t temperature_after_logprob = 1u << 23;
}  // namespace policy_bug

// Per local row, the kernels' inputs in KindRowPlan::row_inputs: old and reference log-probability, the
// (whitened) advantage, the row's sequence (an index of the step's sequences, exact in a float below 2^24), and
// the KL's and the entropy's weight relative to the row's (1 unless a catalogued aux-term bug weighs them apart).
inline constexpr std::size_t kPolicyRowInputs = 6;

std::unique_ptr<LossKind> make_policy_kind();
std::vector<Implementation> policy_catalogue();
std::unique_ptr<KindReference> make_policy_reference(const Case& c, const InputSource& inputs);
KindRowPlan plan_policy_rows(const RowPlanRequest& request);
void policy_cpu_micro_batch(const CpuMicroBatch& batch);

}  // namespace lossverify
