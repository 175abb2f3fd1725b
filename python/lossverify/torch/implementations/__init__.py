"""The project's own PyTorch implementations, usable as `--fn lossverify.torch.implementations:<name>`.

`correct` is the vocabulary-parallel cross-entropy (both smoothing conventions, z-loss, ignore_index,
softcap, every reduction) and KD (forward KL, temperature, T^2) of docs/spec.md §5: all-reduce max, then one packed
all-reduce sum over the TP group, custom backward with no communication. Every other name is a bug of
lossverify's catalogue (`lossverify list`, snake_case here), written the way the framework it comes from
wrote it; lossverify must catch each one on the cases where its golden outcomes say it fails.
`CATALOGUE` maps every name to its function, `KIND` to the loss it applies to (cross_entropy, kd, any).
`TOKEN_LOSS` maps each loss kind to its correct per-token loss (`token_loss_of`, `register_token_loss`).
"""

from lossverify.torch.implementations.catalogue import (
    CATALOGUE,
    KIND,
    NotApplicable,
    correct,
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
    no_max_shift,
    none_divides_grad,
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
from lossverify.torch.implementations.kinds import TOKEN_LOSS, register_token_loss, token_loss_of

__all__ = [*CATALOGUE, "CATALOGUE", "KIND", "NotApplicable", "CrossEntropyBugs", "KdBugs", "smoothing_weights",
           "vocab_parallel_cross_entropy", "vocab_parallel_kl", "kl_with_untracked_all_reduce", "TOKEN_LOSS",
           "register_token_loss", "token_loss_of"]
