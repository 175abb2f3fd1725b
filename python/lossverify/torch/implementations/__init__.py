"""The project's own PyTorch implementations, usable as `--fn lossverify.torch.implementations:<name>`.

`correct` is the vocabulary-parallel cross-entropy (both smoothing conventions, z-loss, ignore_index,
softcap, every reduction), KD (forward KL, temperature, T^2) and the RL policy loss (log-prob and entropy pass,
clipped surrogate on each token's ratio or GSPO's sequence ratio, dual clip, KL, entropy bonus, whitening, the
five aggregations, logged statistics) of docs/spec.md §5: all-reduce max, then one packed all-reduce sum over
the TP group, custom backward with no communication. Every other name is a bug of lossverify's catalogue
(`lossverify list`, snake_case here), written the way the framework it comes from wrote it; lossverify must
catch each one on the cases where its golden outcomes say it fails.
`CATALOGUE` maps every name to its function, `KIND` to the loss it applies to (cross_entropy, kd, policy, any).
`TOKEN_LOSS` maps each loss kind to its correct per-token loss (`token_loss_of`, `register_token_loss`).
"""

from lossverify.torch.implementations.catalogue import (
    CATALOGUE,
    KIND,
    NotApplicable,
    correct,
    cp_loss_stat_dp_only,
    cp_roll_after_split,
    cp_stats_dp_only,
    dp_local_mean,
    full_vocab_through_tp,
    ga_microbatch_mean,
    grad_output_first,
    grad_rounded_early,
    ignore_index_unmasked,
    kd_cross_entropy_value,
    kd_double_t2,
    kd_local_softmax,
    kd_no_t2,
    kd_tp_grad_sum,
    kd_untracked_allreduce,
    mean_over_all_rows,
    moe_aux_local_counts,
    moe_aux_topk_squared,
    moe_aux_tp_sum,
    moe_aux_cp_missing,
    moe_aux_padding_counted,
    moe_aux_no_grad,
    moe_aux_log_doubled,
    moe_aux_ga_overweight,
    moe_aux_per_token_divided,
    moe_aux_per_token_tp_cp,
    moe_seq_aux_mbs,
    moe_aux_count_not_returned,
    moe_aux_global_topk,
    moe_aux_per_token_rank_count,
    moe_zloss_rank_mean,
    moe_aux_per_token_reduced_count,
    moe_seq_aux_mean_length,
    moe_global_aux_mean_counts,
    moe_global_aux_batch_tokens,
    moe_aux_mask_ignored,
    moe_aux_mask_counts_only,
    moe_aux_ga_double_divide,
    moe_seq_aux_packed,
    moe_aux_loss_dp_ga_summed,
    microbatch_local_mean,
    no_max_shift,
    none_divides_grad,
    rl_adv_whiten_dp_only,
    rl_aux_microbatch_mean,
    rl_aux_sample_weighted,
    rl_aux_token_mean,
    rl_cp_extra_scale,
    rl_drgrpo_batch_sum,
    rl_drgrpo_rank_batch_sum,
    rl_entropy_untracked_allreduce,
    rl_fused_vocab_pad,
    rl_gspo_cp_local_ratio,
    rl_kl_score_function,
    rl_kl_no_grad,
    rl_logprob_16bit,
    rl_logprob_allgather_grad_sum,
    rl_logprob_untracked_allreduce,
    rl_logsoftmax_untracked_allreduce,
    rl_microbatch_self_normalized,
    rl_schedule_double_divide,
    rl_seq_mean_counts_empty,
    rl_stats_microbatch_mean,
    rl_temperature_16bit,
    rl_temperature_one_side,
    rl_token_mean_sample_weighted,
    smoothing_backward_partition,
    smoothing_convention_swap,
    smoothing_local_sum,
    smoothing_log_after_exp,
    smoothing_partition_vocab,
    zloss_grad_after_smoothing,
    zloss_on_ignored,
)
from lossverify.torch.implementations.cross_entropy import (
    CrossEntropyBugs,
    smoothing_weights,
    vocab_parallel_cross_entropy,
)
from lossverify.torch.implementations.kd import KdBugs, kl_with_untracked_all_reduce, vocab_parallel_kl
from lossverify.torch.implementations.kinds import (
    CORRECT,
    TOKEN_LOSS,
    correct_of,
    register_correct,
    register_token_loss,
    token_loss_of,
)
from lossverify.torch.implementations.router import RouterBugs, router_losses, router_step_loss, router_terms
from lossverify.torch.implementations.policy import (
    PolicyBugs,
    policy_loss,
    policy_token_loss,
    vocab_parallel_logprob_entropy,
)

__all__ = [*CATALOGUE, "CATALOGUE", "KIND", "NotApplicable", "CrossEntropyBugs", "KdBugs", "PolicyBugs",
           "smoothing_weights", "vocab_parallel_cross_entropy", "vocab_parallel_kl", "kl_with_untracked_all_reduce",
           "vocab_parallel_logprob_entropy", "policy_loss", "policy_token_loss", "RouterBugs", "router_losses",
           "router_step_loss", "router_terms", "TOKEN_LOSS", "register_token_loss",
           "token_loss_of", "CORRECT", "register_correct", "correct_of"]
