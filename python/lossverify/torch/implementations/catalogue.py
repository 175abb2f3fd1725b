"""The correct implementation and the catalogued bugs as loss functions `fn(logits, labels, ctx)` for the
harness (`lossverify list` describes each bug; docs/spec.md §7). Kernel-level bugs are switches of the one
vocabulary-parallel kernel; framework-level bugs (normalisers, labels, logged counts) are written here the
way the framework computed them, and return `Reduced` because their own normalisation is the bug.
"""

import torch
import torch.distributed as dist

from lossverify.torch.context import Reduced
from lossverify.torch.implementations._collectives import gather_columns
from lossverify.torch.implementations.cross_entropy import CrossEntropyBugs, vocab_parallel_cross_entropy
from lossverify.torch.implementations.kd import KdBugs, kl_with_untracked_all_reduce, vocab_parallel_kl
from lossverify.torch.implementations.kinds import correct_of, own_bug_of, token_loss_of
from lossverify.torch.kinds import harness_kind
from lossverify.torch.implementations.policy import PolicyBugs, policy_loss
from lossverify.torch.implementations.router import RouterBugs, router_step_loss

# ---------------------------------------------------------------------------------------------------------
# the correct implementation


def correct(logits, labels, ctx):
    """The correct vocabulary-parallel loss of the case's kind (docs/spec.md §5): per-token losses [rows] from
    the kind's entry of implementations.kinds.TOKEN_LOSS, or the kind's registered correct implementation
    (policy: a Reduced loss with per-token log-probabilities, entropies and logged statistics)."""
    return correct_of(ctx.loss.kind)(logits, labels, ctx)


def _cross_entropy(logits, labels, ctx, **switches):
    _require(ctx, "cross_entropy")
    return vocab_parallel_cross_entropy(logits, labels, ctx, bugs=CrossEntropyBugs(**switches))


def _kd(logits, ctx, **switches):
    _require(ctx, "kd")
    return vocab_parallel_kl(logits, ctx.teacher_logits, ctx, bugs=KdBugs(**switches))


def _require(ctx, kind):
    if ctx.loss.kind != kind:
        raise NotApplicable(f"this bug lives in the {kind} loss; the case is {ctx.loss.kind}")


class NotApplicable(ValueError):
    """The bug cannot reach this case's loss kind (lossverify reports such cells as not_applicable)."""


# ---------------------------------------------------------------------------------------------------------
# kernel-level bugs: one switch each (see CrossEntropyBugs and KdBugs for their sources)

def smoothing_partition_vocab(logits, labels, ctx):
    """Label smoothing with the shard width V_p and a shard-local mean log-probability
    (Megatron-LM, still on main at d98e8a64: issue #737; PR #5522 closed unmerged)."""
    return _cross_entropy(logits, labels, ctx, partition_vocab_forward=True, partition_vocab_backward=True)


def smoothing_log_after_exp(logits, labels, ctx):
    """Smoothing's mean log-probability as log(exp(x - M) / S) (Megatron-LM, still on main at d98e8a64)."""
    return _cross_entropy(logits, labels, ctx, log_after_exp=True)


def smoothing_backward_partition(logits, labels, ctx):
    """Forward fixed, backward smoothing still from V_p (the half-fixed state of Megatron-LM)."""
    return _cross_entropy(logits, labels, ctx, partition_vocab_backward=True)


def smoothing_local_sum(logits, labels, ctx):
    """The smoothing term's sum_v x_v over the local shard only (TE's Triton kernel with TP > 1)."""
    return _cross_entropy(logits, labels, ctx, raw_local_sum=True)


def smoothing_convention_swap(logits, labels, ctx):
    """PyTorch smoothing where Megatron's was asked, or back (alpha against alpha V/(V-1))."""
    return _cross_entropy(logits, labels, ctx, convention_swap=True)


def no_max_shift(logits, labels, ctx):
    """exp(x) without subtracting the row max: inf/NaN once a logit exceeds ~88.7 in float32."""
    return _cross_entropy(logits, labels, ctx, no_max_shift=True)


def zloss_grad_after_smoothing(logits, labels, ctx):
    """The z-loss factor (1 + 2 w_z lse) applied to (p - q) (an early revision of TE PR #2707)."""
    return _cross_entropy(logits, labels, ctx, zloss_grad_after_smoothing=True)


def grad_output_first(logits, labels, ctx):
    """Reduction none: the first upstream weight used for every row (TE issue #2139)."""
    return _cross_entropy(logits, labels, ctx, grad_output_first=True)


def none_divides_grad(logits, labels, ctx):
    """Reduction none still divides the gradient by the row count (TE issue #1879)."""
    return _cross_entropy(logits, labels, ctx, none_divides_grad=True)


def grad_rounded_early(logits, labels, ctx):
    """The gradient rounded to the input dtype before the upstream weight (TE issue #3193)."""
    return _cross_entropy(logits, labels, ctx, grad_rounded_early=True)


def kd_no_t2(logits, labels, ctx):
    """The KD loss without its T^2 factor (NeMo KDLoss before PR #1499)."""
    return _kd(logits, ctx, no_t2=True)


def kd_double_t2(logits, labels, ctx):
    """T^2 applied twice: NeMo KDLoss scales by T^2 itself and the caller scales again."""
    return _kd(logits, ctx, double_t2=True)


def kd_cross_entropy_value(logits, labels, ctx):
    """Reports the cross-entropy H(P, Q) instead of KL(P || Q) (NeMo KDLoss at PR #1499)."""
    return _kd(logits, ctx, cross_entropy_value=True)


def kd_local_softmax(logits, labels, ctx):
    """Teacher and student softmax normalised per TP shard (TP KD without a distributed softmax)."""
    return _kd(logits, ctx, local_softmax=True)


def kd_tp_grad_sum(logits, labels, ctx):
    """The TP all-reduces differentiated by torch.distributed.nn.functional.all_reduce, whose backward sums
    the gradients of a loss that every TP rank holds (NeMo Automodel's _kl_forward_tp): gradient x TP."""
    return _kd(logits, ctx, tp_grad_sum=True)


def kd_untracked_allreduce(logits, labels, ctx):
    """The student's softmax statistics all-reduced outside autograd (NeMo KDLoss PR #1499, _kl_forward_tp)."""
    _require(ctx, "kd")
    return kl_with_untracked_all_reduce(logits, ctx.teacher_logits, ctx)


# ---------------------------------------------------------------------------------------------------------
# framework-level bugs: the normaliser, the labels or the logged count


def _once(ctx, key, compute):
    """A per-step value computed at this rank's first call (collectives included) and reused after."""
    if key not in ctx.state:
        ctx.state[key] = compute()
    return ctx.state[key]


def _all_reduced_count(values, group, device):
    counts = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=group)
    return counts.tolist()


def _token_mean(ctx):
    """Whether the loss is a mean over valid tokens, the normaliser these framework bugs get wrong (a kind that
    aggregates its tokens otherwise has its own weights, which they do not reach)."""
    return harness_kind(ctx.loss.kind).token_mean(ctx.loss)


def _reduced(token_loss, ctx, include, count):
    """The reduction a framework applies to per-token losses, with its own `include` mask and `count`,
    as the scalar this rank back-propagates (compensated for the framework factor, as a correct loop does)."""
    loss = ctx.loss
    weights = include.to(torch.float32)
    if not harness_kind(loss.kind).weighs_by_reduction and not _token_mean(ctx):
        weights = ctx.aggregation_weights().to(torch.float32)
    elif loss.reduction == "mean":
        weights = weights / count if count else weights * 0.0
    elif loss.reduction == "none":
        weights = weights * ctx.upstream_weights.to(torch.float32)
    return (token_loss.float() * weights).sum() / ctx.framework_factor


def _token_loss(logits, labels, ctx, **kwargs):
    """The correct per-token losses of the case's kind, for the bugs that apply to any kind."""
    return token_loss_of(ctx.loss.kind)(logits, labels, ctx, **kwargs)


def ignore_index_unmasked(logits, labels, ctx):
    """Ignored targets treated as ordinary tokens: the kernel never tests ignore_index and the loop counts
    every row it did not pad itself (fused cross-entropy kernels, docs/spec.md §7)."""
    _require(ctx, "cross_entropy")
    rows = ctx.tokens >= 0
    token_loss = vocab_parallel_cross_entropy(logits, labels, ctx, valid=rows, active=rows)
    count = _once(ctx, "rows", lambda: _all_reduced_count(
        [sum(int((mb.tokens >= 0).sum()) for mb in ctx.micro_batches)], ctx.dp_cp_group, ctx.device)[0])
    return Reduced(_reduced(token_loss, ctx, rows, count), token_loss=token_loss, num_tokens=count)


def zloss_on_ignored(logits, labels, ctx):
    """z-loss (and its gradient) left on ignored rows: the loop sums the kernel's per-token losses without
    masking them (z-loss in TE's parallel_cross_entropy, PR #2707)."""
    _require(ctx, "cross_entropy")
    rows = ctx.tokens >= 0
    token_loss = vocab_parallel_cross_entropy(logits, labels, ctx, bugs=CrossEntropyBugs(zloss_on_ignored=True),
                                              active=rows)
    return Reduced(_reduced(token_loss, ctx, rows, ctx.num_valid_tokens), token_loss=token_loss,
                   num_tokens=ctx.num_valid_tokens)


def mean_over_all_rows(logits, labels, ctx):
    """The mean divides by every row, not by the valid tokens (TE issue #2476)."""
    token_loss = _token_loss(logits, labels, ctx)
    count = _once(ctx, "rows", lambda: _all_reduced_count(
        [sum(int((mb.tokens >= 0).sum()) for mb in ctx.micro_batches)], ctx.dp_cp_group, ctx.device)[0])
    return Reduced(_reduced(token_loss, ctx, ctx.loss_mask, count), token_loss=token_loss)


def dp_local_mean(logits, labels, ctx):
    """Each DP rank divides by its own valid-token count, then the framework averages the gradients
    (torchtitan before its loss-balancing fix): token weight 1/(R N_r) instead of 1/N_v. The logged loss is
    the average of the ranks' own means."""
    token_loss = _token_loss(logits, labels, ctx)
    own = ctx.rank_valid_tokens
    ranks = ctx.dp_size * ctx.cp_size
    ga = ctx.ga if ctx.framework.ga_reduce == "mean" else 1
    token_sum = (token_loss.float() * ctx.loss_mask).sum()
    if not _token_mean(ctx):
        return token_loss
    loss = token_sum / own * ga if own else token_sum * 0.0
    logged = token_sum.detach().double() / own / ranks if own else 0.0
    return Reduced(loss, token_loss=token_loss, logged=logged)


def ga_microbatch_mean(logits, labels, ctx):
    """Each micro-batch is a mean over its own valid tokens, divided by GA (pytorch/torchtitan issue #1842):
    token weight 1/(GA N_k) instead of 1/N_v."""
    token_loss = _token_loss(logits, labels, ctx)
    if not _token_mean(ctx):
        return token_loss
    counts = _once(ctx, "micro_batch_counts", lambda: _all_reduced_count(
        [int(mb.loss_mask.sum()) for mb in ctx.micro_batches], ctx.dp_cp_group, ctx.device))
    count = counts[ctx.micro_batch] * ctx.ga
    return Reduced(_reduced(token_loss, ctx, ctx.loss_mask, count), token_loss=token_loss)


def cp_stats_dp_only(logits, labels, ctx):
    """Loss and gradient right, but the logged valid-token count is reduced over DP only, not DP x CP
    (inclusionAI/AReaL issue #1242)."""
    token_loss = _token_loss(logits, labels, ctx)
    count = _once(ctx, "dp_count", lambda: _all_reduced_count([ctx.rank_valid_tokens], ctx.dp_group, ctx.device)[0])
    return Reduced(_reduced(token_loss, ctx, ctx.loss_mask, ctx.num_valid_tokens), token_loss=token_loss,
                   num_tokens=count)


def microbatch_local_mean(logits, labels, ctx):
    """Each rank's micro-batch aggregated with its own counts and divided by GA, the gradients then averaged over
    DP x CP (the PyTorch DDP loop's F.cross_entropy(reduction="mean") / GA; Megatron-LM's default loss mode at
    d98e8a64, its MTP loss too; verl's legacy Megatron actor at b178a3cd; TRL's bnpo): token weight
    1/(DP CP GA n(r,k)) instead of 1/N_v. A policy loss takes its micro-batch's own sequences and their rows
    there too (token-sum has no count); reduction sum and none are right."""
    own = own_bug_of(ctx.loss.kind, "microbatch-local-mean")
    if own is not None:
        return own(logits, labels, ctx)
    token_loss = _token_loss(logits, labels, ctx)
    if not _token_mean(ctx):
        return token_loss
    own = max(int(ctx.loss_mask.sum()), 1)
    ga = ctx.ga if ctx.framework.ga_reduce == "mean" else 1
    token_sum = (token_loss.float() * ctx.loss_mask).sum()
    loss = token_sum / (ctx.ga * own) * ga  # F.cross_entropy's mean / GA, whatever the framework does next
    logged = token_sum.detach().double() / (ctx.dp_size * ctx.cp_size * ctx.ga * own)
    return Reduced(loss, token_loss=token_loss, num_tokens=ctx.num_valid_tokens, logged=logged)


def _cp_slice_logged(token_loss, ctx):
    """cp-loss-stat-dp-only's logged loss: the rank's own CP slice, a token mean by the slice's valid tokens over
    DP (else its part of L), its sum reduced over DP only. The harness logs one value per step, all-reduced over
    DP x CP; CP rank 0's slice is what the step's logging rank (global rank 0) reports, so the other CP ranks
    add nothing."""
    if ctx.cp_rank != 0:
        return 0.0
    if _token_mean(ctx):
        count = _once(ctx, "dp_count", lambda: _all_reduced_count([ctx.rank_valid_tokens], ctx.dp_group,
                                                                  ctx.device)[0])
        weights = ctx.loss_mask.double() / max(count, 1)
    else:
        weights = ctx.aggregation_weights()
    return (token_loss.detach().double() * weights).sum()


def cp_loss_stat_dp_only(logits, labels, ctx):
    """Loss and gradient right, but the logged loss is the token mean of the rank's own CP slice, its sums and
    counts reduced over DP only, not DP x CP (inclusionAI/AReaL PR #1223 at 430a1f9c: the stats tracker records
    the CP-split tensors; fixed on main by AReaL #1249). The logged count is right."""
    own = own_bug_of(ctx.loss.kind, "cp-loss-stat-dp-only")
    if own is not None:
        result = own(logits, labels, ctx)
    else:
        token_loss = _token_loss(logits, labels, ctx)
        result = Reduced(_reduced(token_loss, ctx, ctx.loss_mask, ctx.num_valid_tokens), token_loss=token_loss,
                         num_tokens=ctx.num_valid_tokens)
    result.logged = _cp_slice_logged(result.token_loss, ctx)
    return result


def _rolled_labels(mb, ignore_index):
    """Next-token labels made from this rank's CP shard: torch.roll of the local token ids, so the last row
    of a chunk takes the first row of the next local chunk (or wraps), not the sequence's next token."""
    following = torch.roll(mb.token_ids, -1)
    keep = (mb.labels != ignore_index) & (following >= 0)
    return torch.where(keep, following, torch.full_like(following, ignore_index))


def cp_roll_after_split(logits, labels, ctx):
    """Labels shifted after the CP split (inclusionAI/AReaL PR #1223 moved the roll before it): wrong labels
    at chunk ends, and a valid-token count from those labels. Meaningful on next-token data only."""
    _require(ctx, "cross_entropy")
    ignore = ctx.loss.ignore_index
    rolled = _rolled_labels(ctx.current, ignore)
    count = _once(ctx, "rolled_count", lambda: _all_reduced_count(
        [sum(int((_rolled_labels(mb, ignore) != ignore).sum()) for mb in ctx.micro_batches)], ctx.dp_cp_group,
        ctx.device)[0])
    valid = rolled != ignore
    token_loss = vocab_parallel_cross_entropy(logits, rolled, ctx, valid=valid)
    return Reduced(_reduced(token_loss, ctx, valid, count), token_loss=token_loss, num_tokens=count)


def full_vocab_through_tp(logits, labels, ctx):
    """Megatron-LM's vocab_parallel_cross_entropy called on logits already gathered over TP (an output layer
    with gather_output=True): every rank takes itself for the owner of columns [tp V, (tp + 1) V)."""
    _require(ctx, "cross_entropy")
    gathered = gather_columns(logits, ctx.tp_group)
    return vocab_parallel_cross_entropy(gathered, labels, ctx, vocab_start=ctx.tp_rank * gathered.shape[-1],
                                        vocab_size=gathered.shape[-1] * ctx.tp_size)


# ---------------------------------------------------------------------------------------------------------
# the policy loss's bugs: one switch each of implementations.policy (PolicyBugs names each one's source)


def _policy(logits, labels, ctx, **switches):
    _require(ctx, "policy")
    return policy_loss(logits, labels, ctx, bugs=PolicyBugs(**switches))


def rl_logprob_untracked_allreduce(logits, labels, ctx):
    """Vocab-parallel log-prob with max, sum-exp and the gathered log-prob all-reduced in place outside autograd,
    the local max not detached (the kd-untracked-allreduce pattern, NVIDIA-NeMo/Automodel #1499)."""
    return _policy(logits, labels, ctx, logprob_untracked_allreduce=True)


def rl_entropy_untracked_allreduce(logits, labels, ctx):
    """Vocab-parallel entropy whose per-shard partials are all-reduced outside autograd: each shard
    differentiates its own partial sum (the kd-untracked-allreduce pattern in an entropy kernel)."""
    return _policy(logits, labels, ctx, entropy_untracked_allreduce=True)


def rl_logprob_allgather_grad_sum(logits, labels, ctx):
    """Log-probs from a vocabulary all-gather to a replicated tensor whose backward all-reduces the replicated
    gradient (pytorch/torchtitan components/loss.py compute_logprobs, #3827)."""
    return _policy(logits, labels, ctx, logprob_allgather_grad_sum=True)


def rl_temperature_one_side(logits, labels, ctx):
    """The trainer's log-probs at T = 1 against rollout log-probs at the sampling temperature (verl #3133,
    OpenRLHF #857, AReaL #581, ms-swift #8427, slime #557/#2085)."""
    return _policy(logits, labels, ctx, temperature_one_side=True)


def rl_token_mean_sample_weighted(logits, labels, ctx):
    """Token-mean as each micro-batch's token mean weighted by its share of sequences, then a DP mean (verl
    legacy actor #5625/#5877, SkyRL #1296, OpenRLHF df78645e)."""
    return _policy(logits, labels, ctx, token_mean_sample_weighted=True)


def rl_microbatch_self_normalized(logits, labels, ctx):
    """Each micro-batch normalised by its own token count, the engine summing micro-batches (verl #7200)."""
    return _policy(logits, labels, ctx, microbatch_self_normalized=True)


def rl_drgrpo_batch_sum(logits, labels, ctx):
    """seq-mean-token-sum-norm multiplied by the micro-batch's sequence count b (verl #3741)."""
    return _policy(logits, labels, ctx, drgrpo_batch_sum=True)


def rl_cp_extra_scale(logits, labels, ctx):
    """The KL and entropy terms scaled by CP, their statistics summed over CP copies (SkyRL #1420, #1751)."""
    return _policy(logits, labels, ctx, cp_extra_scale=True)


def rl_schedule_double_divide(logits, labels, ctx):
    """A globally normalised loss divided by the micro-batch count again before backward (AReaL #1273;
    slime #987/#990)."""
    return _policy(logits, labels, ctx, schedule_double_divide=True)


def rl_adv_whiten_dp_only(logits, labels, ctx):
    """Advantage whitening statistics over DP only, not DP x CP (THUDM/slime #2235)."""
    return _policy(logits, labels, ctx, adv_whiten_dp_only=True)


def rl_fused_vocab_pad(logits, labels, ctx):
    """A fused kernel's zero pad columns (each shard padded to a multiple of 1024) left in the softmax (verl
    fused linear-CE kernel, #2656/#2899, #5349)."""
    return _policy(logits, labels, ctx, fused_vocab_pad=True)


def rl_kl_no_grad(logits, labels, ctx):
    """The KL penalty computed without gradient (NovaSky-AI/SkyRL #1353)."""
    return _policy(logits, labels, ctx, kl_no_grad=True)


def rl_gspo_cp_local_ratio(logits, labels, ctx):
    """GSPO's sequence ratio rho_s, and the sum its gradient takes over the sequence, from the CP rank's own
    chunks of each sequence: the per-sequence sums of lambda - old and the valid counts never all-reduced over
    CP (predicted: the reduction radixark/miles #3188 does; a no-op under ratio token and at cp = 1)."""
    return _policy(logits, labels, ctx, gspo_cp_local_ratio=True)


def rl_logsoftmax_untracked_allreduce(logits, labels, ctx):
    """One vocab-parallel log-softmax under both the log-prob and the entropy, its local max not detached, with
    max, sum-exp, the gathered log-prob and the entropy's per-shard partials all-reduced in place outside
    autograd (modelscope/ms-swift vocab_parallel_utils.py compute_logps_and_entropy_from_logits, 3602360a)."""
    return _policy(logits, labels, ctx, logsoftmax_untracked_allreduce=True)


def rl_stats_microbatch_mean(logits, labels, ctx):
    """The logged clip fraction, dual-clip fraction, KL and entropy each a token mean over one micro-batch of
    every rank, averaged over the micro-batches (huggingface/trl GRPOTrainer._compute_loss at f2cd5771,
    global_masked_mean): weight 1/(K N_k) instead of 1/N; loss and gradient exact."""
    return _policy(logits, labels, ctx, stats_microbatch_mean=True)


def rl_logprob_16bit(logits, labels, ctx):
    """The trainer's log-prob pass in the logits' 16-bit dtype: x / T rounded, log_softmax, logsumexp, softmax
    and sum p x each returning 16-bit values (verl b178a3cd logprobs_from_logits_v2, entropy_from_logits;
    SkyRL a9564572 torch_utils.py; TRL f2cd5771 selective_log_softmax, entropy_from_logits)."""
    return _policy(logits, labels, ctx, logprob_16bit=True)


def rl_drgrpo_rank_batch_sum(logits, labels, ctx):
    """seq-mean-token-sum-norm never divided by the sequence count: each micro-batch's sum_s S_s / H_max summed
    over the rank's micro-batches, then averaged over DP (volcengine/verl b178a3cd verl/workers/utils/losses.py
    ppo_loss, whose global_batch_info passes no batch size to this mode, with verl/trainer/ppo/core_algos.py
    agg_loss 1072-1076, torch.sum(seq_losses) / loss_scale_factor; the new engine summing micro-batches): each
    sequence weighs 1/(DP H_max) instead of 1/(B H_max)."""
    return _policy(logits, labels, ctx, drgrpo_rank_batch_sum=True)


def rl_aux_token_mean(logits, labels, ctx):
    """The KL and entropy terms aggregated token-mean (1/N) while the policy term follows the case's sequence
    aggregation (OpenRLHF/OpenRLHF 3c3be623 openrlhf/trainer/ray/ppo_actor.py:330 and :346: aggregate_loss in its
    default token mode for the KL and the entropy; PolicyLoss forces per-sample for gspo). The logged loss is
    the sum with these weights."""
    return _policy(logits, labels, ctx, aux_token_mean=True)


def rl_aux_sample_weighted(logits, labels, ctx):
    """Whatever the aggregation, the KL a mean over the micro-batch's sequences of each one's token mean and the
    entropy the micro-batch's token mean, each weighted by the micro-batch's share of the rank's sequences, then
    the DP mean (NovaSky-AI/SkyRL a9564572 skyrl/backends/skyrl_train/workers/worker.py:1056-1089, the FSDP
    worker: masked_mean(kl, mask, dim=-1).mean() and masked_mean(entropy, mask), x len(microbatch) /
    len(data)): KL weight 1/(DP B_r n_s), entropy weight b_k/(DP B_r N_k)."""
    return _policy(logits, labels, ctx, aux_sample_weighted=True)


def rl_aux_microbatch_mean(logits, labels, ctx):
    """Whatever the aggregation, the KL a mean over the micro-batch's sequences of each one's token mean and the
    entropy the micro-batch's token mean, each micro-batch divided by K, then the DP mean (NovaSky-AI/SkyRL
    a9564572 skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:851-941, the Megatron
    loss_func's KL and entropy terms, Megatron's schedule dividing by K): KL weight 1/(DP K b_k n_s), entropy
    weight 1/(DP K N_k)."""
    return _policy(logits, labels, ctx, aux_microbatch_mean=True)


def rl_temperature_16bit(logits, labels, ctx):
    """The logits divided by T in place in their 16-bit dtype before a float32 log-prob pass (NVIDIA-NeMo/RL
    7ea279ab nemo_rl/models/automodel/train.py:193 and models/megatron/train.py:216: logits.div_(temperature)
    before get_next_token_logprobs_from_logits casts to float32): x = round16(z / T); float32 logits and T = 1
    are left alone."""
    return _policy(logits, labels, ctx, temperature_16bit=True)


def rl_temperature_after_logprob(logits, labels, ctx):
    """The temperature applied to the log-probs after the log-softmax, lambda = log_softmax(z)_y / T, the pass at
    T = 1 (NVIDIA-NeMo/RL 7ea279ab nemo_rl/models/megatron/train.py:336: apply_temperature_scaling's div_(T) on the
    model's output, which under use_fused_linear_logprobs is the fused head's log-probs); T = 1 is left alone."""
    return _policy(logits, labels, ctx, temperature_after_logprob=True)


def rl_kl_score_function(logits, labels, ctx):
    """The KL penalty weighted by e^(lambda - sg lambda) (value 1), which adds a score-function term KL_t to its
    gradient (NVIDIA-NeMo/RL 7ea279ab nemo_rl/algorithms/loss/loss_functions.py:480-502, calculate_kl with
    importance_sampling_weights; deliberate, after arXiv 2506.09477: a divergence from the objective's plain
    penalty, not a defect of NeMo-RL's own objective)."""
    return _policy(logits, labels, ctx, kl_score_function=True)


def rl_seq_mean_counts_empty(logits, labels, ctx):
    """The sequence aggregations' B counting every sequence of the step, those with no valid token included
    (volcengine/verl verl/trainer/ppo/core_algos.py agg_loss before its seq_mask, "exclude fully masked
    sequences": seq-mean-token-sum as torch.mean(seq_losses) over every row): each sequence weighs 1/B_all."""
    return _policy(logits, labels, ctx, seq_mean_counts_empty=True)


# ---------------------------------------------------------------------------------------------------------
# the router's bugs (MOE.md section 4): switches of the router's terms and of the trainer's scaling around them

def _router(logits, ctx, **switches):
    _require(ctx, "router")
    return router_step_loss(logits, None, ctx, bugs=RouterBugs(**switches))


def moe_aux_local_counts(logits, labels, ctx):
    """Counts and T from the rank's own tokens, not all-reduced over the sequence partition (Megatron-LM
    dc41f8908a)."""
    return _router(logits, ctx, local_counts=True)


def moe_aux_topk_squared(logits, labels, ctx):
    """The aux loss divided by k^2 instead of k (Megatron-LM dc41f8908a, fixed in 5c8eb08f66)."""
    return _router(logits, ctx, topk_squared=True)


def moe_aux_tp_sum(logits, labels, ctx):
    """Under SP the aux loss on logits all-gathered over TP: the gather's backward sums TP identical aux
    gradients (Megatron-LM cac8d1a3f0)."""
    return _router(logits, ctx, tp_sum=True)


def moe_aux_cp_missing(logits, labels, ctx):
    """The injected aux gradient lacks the CP factor the main loss has (Megatron-LM f6e0d425a5, #2237)."""
    return _router(logits, ctx, cp_missing=True)


def moe_aux_padding_counted(logits, labels, ctx):
    """Padding tokens counted in T and in the counts (Megatron-LM #2142, #3096; transformers #28517, #29363)."""
    return _router(logits, ctx, padding_counted=True)


def moe_aux_no_grad(logits, labels, ctx):
    """The aux loss scaler's return discarded: no aux gradient, the loss right (NeMo Automodel #1408)."""
    return _router(logits, ctx, no_grad=True)


def moe_aux_log_doubled(logits, labels, ctx):
    """The logged aux loss doubled: activation checkpointing runs the router's forward twice (Megatron-LM
    e6d56d6828, #3199)."""
    return _router(logits, ctx, log_doubled=True)


def moe_aux_ga_overweight(logits, labels, ctx):
    """The aux gradient summed over the DP ranks and the micro-batches, not averaged (NeMo Automodel #3359)."""
    return _router(logits, ctx, ga_overweight=True)


def moe_aux_per_token_divided(logits, labels, ctx):
    """Per-token mode: the aux gradient already divided by the step's tokens, and finalize divides it again
    (Megatron-LM 87d9d2506a)."""
    return _router(logits, ctx, per_token_divided=True)


def moe_aux_per_token_tp_cp(logits, labels, ctx):
    """Per-token mode scales the aux and z gradients by 1/(TP CP) (Megatron-LM 9ef8a2a420, #5047)."""
    return _router(logits, ctx, per_token_tp_cp=True)


def moe_seq_aux_mbs(logits, labels, ctx):
    """Per-token mode: the sequence aux gradient divided by the micro-batch size (Megatron-LM e3fe5508c9,
    #5798)."""
    return _router(logits, ctx, seq_aux_mbs=True)


def moe_aux_count_not_returned(logits, labels, ctx):
    """Per-token mode at CP > 1: the token count never handed to finalize, so nothing divides by it (verl
    #6609, fixed in #6836)."""
    return _router(logits, ctx, count_not_returned=True)


def moe_aux_global_topk(logits, labels, ctx):
    """A global top_k (2) used instead of the router's own (OpenRLHF 152c72ba)."""
    return _router(logits, ctx, global_topk=True)


def moe_aux_per_token_rank_count(logits, labels, ctx):
    """Per-token mode: a scope's tokens taken as the rank's own count x the ranks of the scope (Megatron-LM
    router.py; MOE.md section 2)."""
    return _router(logits, ctx, per_token_rank_count=True)


def moe_zloss_rank_mean(logits, labels, ctx):
    """Default mode: the z-loss a mean of per-rank means, alpha_z / (TP CP) over each rank's own valid tokens
    (Megatron-LM d98e8a64, router.py apply_z_loss)."""
    return _router(logits, ctx, zloss_rank_mean=True)


def moe_aux_per_token_reduced_count(logits, labels, ctx):
    """Per-token mode: the aux terms' token count read after its in-place all-reduce, the scope's T_S where the
    rank's own was meant (Megatron-LM d98e8a64, moe_utils.py get_tokens_per_expert_and_token_count)."""
    return _router(logits, ctx, per_token_reduced_count=True)


def moe_seq_aux_mean_length(logits, labels, ctx):
    """The sequence aux loss scaled by the micro-batch's mean sequence length, not each sequence's own
    (Megatron-LM d98e8a64, router.py _apply_seq_aux_loss)."""
    return _router(logits, ctx, seq_aux_mean_length=True)


def moe_global_aux_mean_counts(logits, labels, ctx):
    """Running global counts: f from their mean over the micro-batches so far, over the current micro-batch's
    tokens (Megatron-LM d98e8a64, router.py _apply_global_aux_loss)."""
    return _router(logits, ctx, global_mean_counts=True)


def moe_global_aux_batch_tokens(logits, labels, ctx):
    """The global aux term's P over the micro-batch's tokens of every DP rank, not its scope's (Megatron-LM
    d98e8a64, router.py _apply_global_aux_loss)."""
    return _router(logits, ctx, global_batch_tokens=True)


def moe_aux_mask_ignored(logits, labels, ctx):
    """The padding mask never reaches the router: padded and masked rows routed as tokens, in T, the counts, the
    scores' sums and the z-loss, and given a gradient (DeepSpeed-MoE edaa7221 top2gating/topkgating; verl 1dda039b
    BSHD)."""
    return _router(logits, ctx, mask_ignored=True)


def moe_aux_mask_counts_only(logits, labels, ctx):
    """The padding mask reaches the experts' counts only: T, the scores' sums and the gradient over every row
    (DeepSpeed-MoE edaa7221 top1gating)."""
    return _router(logits, ctx, mask_counts_only=True)


def moe_aux_ga_double_divide(logits, labels, ctx):
    """The aux gradient divided by the micro-batch count twice (DeepSpeed edaa7221's GA hooks with the loss returned
    beside the aux loss)."""
    return _router(logits, ctx, ga_double_divide=True)


def moe_seq_aux_packed(logits, labels, ctx):
    """The sequence aux loss over a packed micro-batch: one sequence of all its tokens (verl 1dda039b THD packing into
    Megatron-LM's router)."""
    return _router(logits, ctx, seq_aux_packed=True)


def moe_aux_loss_dp_ga_summed(logits, labels, ctx):
    """The aux term inside a loss the trainer sums over the micro-batches and the DP ranks (scaled for a
    token-normalised main loss): its value and gradient x DP GA (the transformers Trainer, #48690)."""
    return _router(logits, ctx, aux_loss_dp_ga_summed=True)


CATALOGUE = {
    "correct": correct,
    "smoothing_partition_vocab": smoothing_partition_vocab,
    "smoothing_log_after_exp": smoothing_log_after_exp,
    "smoothing_backward_partition": smoothing_backward_partition,
    "smoothing_local_sum": smoothing_local_sum,
    "smoothing_convention_swap": smoothing_convention_swap,
    "full_vocab_through_tp": full_vocab_through_tp,
    "no_max_shift": no_max_shift,
    "ignore_index_unmasked": ignore_index_unmasked,
    "mean_over_all_rows": mean_over_all_rows,
    "none_divides_grad": none_divides_grad,
    "grad_output_first": grad_output_first,
    "grad_rounded_early": grad_rounded_early,
    "zloss_on_ignored": zloss_on_ignored,
    "zloss_grad_after_smoothing": zloss_grad_after_smoothing,
    "kd_no_t2": kd_no_t2,
    "kd_double_t2": kd_double_t2,
    "kd_cross_entropy_value": kd_cross_entropy_value,
    "kd_local_softmax": kd_local_softmax,
    "kd_untracked_allreduce": kd_untracked_allreduce,
    "kd_tp_grad_sum": kd_tp_grad_sum,
    "dp_local_mean": dp_local_mean,
    "ga_microbatch_mean": ga_microbatch_mean,
    "cp_stats_dp_only": cp_stats_dp_only,
    "microbatch_local_mean": microbatch_local_mean,
    "cp_loss_stat_dp_only": cp_loss_stat_dp_only,
    "cp_roll_after_split": cp_roll_after_split,
    "rl_logprob_untracked_allreduce": rl_logprob_untracked_allreduce,
    "rl_entropy_untracked_allreduce": rl_entropy_untracked_allreduce,
    "rl_logprob_allgather_grad_sum": rl_logprob_allgather_grad_sum,
    "rl_temperature_one_side": rl_temperature_one_side,
    "rl_token_mean_sample_weighted": rl_token_mean_sample_weighted,
    "rl_microbatch_self_normalized": rl_microbatch_self_normalized,
    "rl_drgrpo_batch_sum": rl_drgrpo_batch_sum,
    "rl_cp_extra_scale": rl_cp_extra_scale,
    "rl_schedule_double_divide": rl_schedule_double_divide,
    "rl_adv_whiten_dp_only": rl_adv_whiten_dp_only,
    "rl_fused_vocab_pad": rl_fused_vocab_pad,
    "rl_kl_no_grad": rl_kl_no_grad,
    "rl_gspo_cp_local_ratio": rl_gspo_cp_local_ratio,
    "rl_logsoftmax_untracked_allreduce": rl_logsoftmax_untracked_allreduce,
    "rl_stats_microbatch_mean": rl_stats_microbatch_mean,
    "rl_logprob_16bit": rl_logprob_16bit,
    "rl_drgrpo_rank_batch_sum": rl_drgrpo_rank_batch_sum,
    "rl_aux_token_mean": rl_aux_token_mean,
    "rl_aux_sample_weighted": rl_aux_sample_weighted,
    "rl_aux_microbatch_mean": rl_aux_microbatch_mean,
    "rl_temperature_16bit": rl_temperature_16bit,
    "rl_temperature_after_logprob": rl_temperature_after_logprob,
    "rl_kl_score_function": rl_kl_score_function,
    "rl_seq_mean_counts_empty": rl_seq_mean_counts_empty,
    "moe_aux_local_counts": moe_aux_local_counts,
    "moe_aux_topk_squared": moe_aux_topk_squared,
    "moe_aux_tp_sum": moe_aux_tp_sum,
    "moe_aux_cp_missing": moe_aux_cp_missing,
    "moe_aux_padding_counted": moe_aux_padding_counted,
    "moe_aux_no_grad": moe_aux_no_grad,
    "moe_aux_log_doubled": moe_aux_log_doubled,
    "moe_aux_ga_overweight": moe_aux_ga_overweight,
    "moe_aux_per_token_divided": moe_aux_per_token_divided,
    "moe_aux_per_token_tp_cp": moe_aux_per_token_tp_cp,
    "moe_seq_aux_mbs": moe_seq_aux_mbs,
    "moe_aux_count_not_returned": moe_aux_count_not_returned,
    "moe_aux_global_topk": moe_aux_global_topk,
    "moe_aux_per_token_rank_count": moe_aux_per_token_rank_count,
    "moe_zloss_rank_mean": moe_zloss_rank_mean,
    "moe_aux_per_token_reduced_count": moe_aux_per_token_reduced_count,
    "moe_seq_aux_mean_length": moe_seq_aux_mean_length,
    "moe_global_aux_mean_counts": moe_global_aux_mean_counts,
    "moe_global_aux_batch_tokens": moe_global_aux_batch_tokens,
    "moe_aux_mask_ignored": moe_aux_mask_ignored,
    "moe_aux_mask_counts_only": moe_aux_mask_counts_only,
    "moe_aux_ga_double_divide": moe_aux_ga_double_divide,
    "moe_seq_aux_packed": moe_seq_aux_packed,
    "moe_aux_loss_dp_ga_summed": moe_aux_loss_dp_ga_summed,
}
# The loss kind each name applies to: the bugs of the KD loss, of the policy loss (rl_*), of the router (moe_*), those of the
# normaliser or logged count that reach every kind (and `correct`), and the cross-entropy bugs (the others).
_KD = ("kd_no_t2", "kd_double_t2", "kd_cross_entropy_value", "kd_local_softmax", "kd_untracked_allreduce",
       "kd_tp_grad_sum")
_ANY = ("correct", "mean_over_all_rows", "dp_local_mean", "ga_microbatch_mean", "cp_stats_dp_only",
        "microbatch_local_mean", "cp_loss_stat_dp_only")
KIND = {name: "kd" if name in _KD else "policy" if name.startswith("rl_") else "router" if name.startswith("moe_")
        else "any" if name in _ANY else "cross_entropy" for name in CATALOGUE}

__all__ = [*CATALOGUE, "CATALOGUE", "KIND", "NotApplicable"]
