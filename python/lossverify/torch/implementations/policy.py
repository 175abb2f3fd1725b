"""The RL policy loss (docs/spec.md §3.3): a vocabulary-parallel log-prob and entropy pass, the clipped
surrogate with dual clip (on each token's ratio, or GSPO's sequence-level one), KL and entropy bonus on top of
it, advantage whitening over the step and the five aggregation modes, with the catalogue's policy bugs as
switches, each written the way its framework wrote it.

The log-prob pass (`vocab_parallel_logprob_entropy`) is one torch.autograd.Function: with x = z/T, the max M
all-reduced over TP, then one packed all-reduce sum of [S = sum e^u, E = sum e^u u, u_y] (u = x - M, u_y
from the shard that owns the label): lambda = u_y - log S, H = log S - E/S (the shifted form). Its backward
needs no communication: every TP rank holds the same lambda and H (the objective on them is replicated) and
differentiates its own columns, (1/T)[g_lambda (delta_vy - p_v) - g_H p_v (log p_v + H)].
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from lossverify.torch.context import Reduced
from lossverify.torch.implementations._collectives import all_reduce_, gather_columns
from lossverify.torch.policy import masked, policy_terms, sequence_log_ratio, statistics_parts, token_loss

__all__ = ["PolicyBugs", "vocab_parallel_logprob_entropy", "policy_loss", "policy_token_loss",
           "logprob_with_untracked_all_reduce", "tempered_16bit", "entropy_with_untracked_all_reduce",
           "logsoftmax_with_untracked_all_reduce", "logprob_entropy_16bit", "logprob_from_all_gather",
           "whitened_advantages"]


@dataclass(frozen=True)
class PolicyBugs:
    """The policy kind's catalogued bugs (lossverify list; docs/catalogue.md names each one's source)."""

    logprob_untracked_allreduce: bool = False  # max, sum-exp, gathered log-prob all-reduced outside autograd
    entropy_untracked_allreduce: bool = False  # entropy partials all-reduced outside autograd
    logprob_allgather_grad_sum: bool = False  # torchtitan compute_logprobs (#3827): Replicate's backward sums
    temperature_one_side: bool = False  # the trainer's log-probs at T = 1 (verl #3133, OpenRLHF #857, ...)
    token_mean_sample_weighted: bool = False  # micro-batch token means weighted by sequence share (verl legacy)
    microbatch_self_normalized: bool = False  # each micro-batch over its own count, summed (verl #7200)
    drgrpo_batch_sum: bool = False  # seq-mean-token-sum-norm x the micro-batch's sequence count (verl #3741)
    cp_extra_scale: bool = False  # KL and entropy terms and their statistics x CP (SkyRL #1420, #1751)
    schedule_double_divide: bool = False  # a globally normalised loss / micro-batches again (AReaL #1273)
    adv_whiten_dp_only: bool = False  # whitening statistics over DP, not DP x CP (slime #2235)
    fused_vocab_pad: bool = False  # each shard's zero pad columns to a multiple of 1024 in the softmax (verl)
    kl_no_grad: bool = False  # the KL penalty without gradient (SkyRL #1353)
    gspo_cp_local_ratio: bool = False  # GSPO's per-sequence sums over the CP rank's own chunks (predicted)
    logsoftmax_untracked_allreduce: bool = False  # one log-softmax under both, all-reduced outside autograd (ms-swift)
    stats_microbatch_mean: bool = False  # logged statistics: micro-batch token means, averaged (TRL GRPOTrainer)
    logprob_16bit: bool = False  # the log-prob pass on 16-bit x / T, each op's output rounded (verl, SkyRL, TRL)
    microbatch_local_mean: bool = False  # each rank's micro-batch over its own counts / GA (the any-kind bug)
    drgrpo_rank_batch_sum: bool = False  # seq-mean-token-sum-norm never / B: 1/(DP H_max) (verl's new engine)
    aux_token_mean: bool = False  # KL and entropy token-mean whatever the aggregation (OpenRLHF GSPO)
    aux_sample_weighted: bool = False  # KL and entropy micro-batch means x sequence share (SkyRL FSDP worker)
    aux_microbatch_mean: bool = False  # KL and entropy micro-batch means / K (SkyRL Megatron loss_func)
    temperature_16bit: bool = False  # logits.div_(T) in their 16-bit dtype before a float32 pass (NeMo-RL)
    kl_score_function: bool = False  # the KL x e^(lambda - sg lambda), a score-function gradient (NeMo-RL)
    seq_mean_counts_empty: bool = False  # B counts the step's sequences with no valid token too (verl agg_loss)
    temperature_after_logprob: bool = False  # log_softmax(z)_y / T: T applied to the fused log-probs (NeMo-RL)


def _inverse_temperature(ctx, bugs):
    """float32(1/T), as the kernels multiply by it; 1 under temperature-one-side and temperature-after-logprob."""
    if bugs.temperature_one_side or bugs.temperature_after_logprob:
        return 1.0
    return float(torch.tensor(1.0 / ctx.loss.temperature, dtype=torch.float32))


def _owned(labels, vocab_start, width):
    local = labels - vocab_start
    return local, (local >= 0) & (local < width)


def _softmax_and_target(u, log_sum, local, owned):
    """A backward's view of a shard's rows [rows, width] (u = x / T - M): log p, p, and the one-hot of each row's
    label where this shard owns it."""
    rows, width = u.shape
    log_p = u - log_sum.unsqueeze(-1)
    target = torch.zeros_like(u)
    target[torch.arange(rows, device=u.device), local.clamp(0, width - 1)] = owned.to(u.dtype)
    return log_p, torch.exp(log_p), target


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, labels, active, group, inverse_t, vocab_start, width):
        x = logits.float() * inverse_t
        row_max = all_reduce_(x.max(dim=-1).values, group, dist.ReduceOp.MAX)
        u = x - row_max.unsqueeze(-1)
        e = torch.exp(u)
        local, owned = _owned(labels, vocab_start, width)
        target = u.gather(1, local.clamp(0, x.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
        packed = torch.stack([e.sum(dim=-1), (e * u).sum(dim=-1), torch.where(owned, target, torch.zeros_like(target))])
        all_reduce_(packed, group)
        log_sum = torch.log(packed[0])
        logprob = packed[2] - log_sum
        entropy = log_sum - packed[1] / packed[0]
        zero = torch.zeros_like(logprob)
        logprob = torch.where(active, logprob, zero)
        entropy = torch.where(active, entropy, zero)
        fctx.save_for_backward(u, log_sum, entropy, local, owned, active)
        fctx.inverse_t = inverse_t
        fctx.in_dtype = logits.dtype
        return logprob, entropy

    @staticmethod
    def backward(fctx, grad_logprob, grad_entropy):
        u, log_sum, entropy, local, owned, active = fctx.saved_tensors
        log_p, p, target = _softmax_and_target(u, log_sum, local, owned)
        grad = grad_logprob.float().unsqueeze(-1) * (target - p)
        grad = grad - grad_entropy.float().unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
        grad = torch.where(active.unsqueeze(-1), grad * fctx.inverse_t, torch.zeros_like(grad))
        return grad.to(fctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_logprob_entropy(logits, labels, ctx, inverse_t=None, active=None, width=None):
    """(log-probabilities, entropies) [rows] float32 of this rank's logits shard [rows, columns] at the case's
    temperature (or inverse_t = 1/T given), over the TP group; 0 on rows that are not active (default: the
    loss mask). width: the shard's own columns (default: all of them; more columns are padding)."""
    if active is None:
        active = ctx.loss_mask
    if inverse_t is None:
        inverse_t = _inverse_temperature(ctx, PolicyBugs())
    width = logits.shape[-1] if width is None else width
    return _VocabParallelLogProbEntropy.apply(logits, labels, active, ctx.tp_group, inverse_t, ctx.vocab_start, width)


def logprob_with_untracked_all_reduce(logits, labels, ctx, inverse_t):
    """A vocabulary-parallel log-prob kernel with plain autograd whose collectives are dist.all_reduce in place:
    the local max (not detached), the sum of exponentials and the owner's log-probability. The values are
    right; the backward sees this shard alone: non-owners get no log-prob gradient, the owner
    (delta - p_v) plus (P_r - 1) at its local argmax."""
    x = logits.float() * inverse_t
    row_max = x.max(dim=-1).values  # autograd routes its gradient to the local argmax
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    u = x - row_max.unsqueeze(-1)
    total = torch.exp(u).sum(dim=-1)
    dist.all_reduce(total, group=ctx.tp_group)
    local, owned = _owned(labels, ctx.vocab_start, x.shape[1])
    target = u.gather(1, local.clamp(0, x.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
    logprob = torch.where(owned, target - torch.log(total), torch.zeros_like(target))
    dist.all_reduce(logprob, group=ctx.tp_group)  # the owner's value reaches every rank, its graph none
    return masked(logprob, ctx.loss_mask)


def entropy_with_untracked_all_reduce(logits, ctx, inverse_t):
    """A vocabulary-parallel entropy kernel with plain autograd: the max detached and all-reduced, then the sum
    of exponentials and each shard's partial entropy all-reduced in place. The value is H; each shard
    differentiates its own partial: -p_v (log p_v + H_r + 1 - P_r) instead of -p_v (log p_v + H)."""
    x = logits.float() * inverse_t
    row_max = x.max(dim=-1).values.detach()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    u = x - row_max.unsqueeze(-1)
    total = torch.exp(u).sum(dim=-1)
    dist.all_reduce(total, group=ctx.tp_group)
    log_p = u - torch.log(total).unsqueeze(-1)
    partial = -(torch.exp(log_p) * log_p).sum(dim=-1)
    dist.all_reduce(partial, group=ctx.tp_group)
    return masked(partial, ctx.loss_mask)


def logprob_from_all_gather(logits, labels, ctx, inverse_t):
    """torchtitan's compute_logprobs: the vocabulary shards gathered to a replicated full row (a DTensor
    redistributed Shard -> Replicate, whose backward all-reduces the replicated gradient over TP), then
    log_softmax and the label's column: the log-prob gradient comes back TP times."""
    full = gather_columns(logits, ctx.tp_group, sum_backward=True)
    log_p = torch.log_softmax(full.float() * inverse_t, dim=-1)
    logprob = log_p.gather(1, labels.clamp(0, full.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
    return masked(logprob, ctx.loss_mask)


def logsoftmax_with_untracked_all_reduce(logits, labels, ctx, inverse_t):
    """ms-swift's compute_logps_and_entropy_from_logits (swift/megatron/trainers/vocab_parallel_utils.py at
    3602360a): one vocabulary-parallel log-softmax with plain autograd, its local max not detached, under both
    the log-prob and the entropy; the max, the sum of exponentials, the owner's log-probability and each shard's
    partial entropy all-reduced in place. The values are right; the backward sees this shard alone:
    d log p_v / dx_w = delta_vw - D_w, D_w = p_w + [w = local argmax] (1 - P_r), so the log-prob's gradient
    reaches the owner only and the entropy's is -(1 + log p_v) p_v + D_v (P_r - H_r)."""
    x = logits.float() * inverse_t
    row_max = x.max(dim=-1).values  # autograd routes its gradient to the local argmax
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    u = x - row_max.unsqueeze(-1)
    total = torch.exp(u).sum(dim=-1)
    dist.all_reduce(total, group=ctx.tp_group)  # backward sees only this shard's sum
    log_p = u - torch.log(total).unsqueeze(-1)
    local, owned = _owned(labels, ctx.vocab_start, x.shape[1])
    target = log_p.gather(1, local.clamp(0, x.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
    logprob = torch.where(owned, target, torch.zeros_like(target))
    dist.all_reduce(logprob, group=ctx.tp_group)  # the owner's value reaches every rank, its graph none
    entropy = -(torch.exp(log_p) * log_p).sum(dim=-1)
    dist.all_reduce(entropy, group=ctx.tp_group)  # each shard differentiates its own partial H_r
    return masked(logprob, ctx.loss_mask), masked(entropy, ctx.loss_mask)


def _round16(values, dtype):
    return values.to(dtype).float()


def _row_stats(x, labels, group, vocab_start):
    """(M, u = x - M, log S, E / S, u_y (0 where this shard does not own y), local, owned) of x [rows, columns]
    over the TP group: M the row max, S = sum e^u, E = sum e^u u."""
    row_max = all_reduce_(x.max(dim=-1).values, group, dist.ReduceOp.MAX)
    u = x - row_max.unsqueeze(-1)
    e = torch.exp(u)
    local, owned = _owned(labels, vocab_start, x.shape[1])
    target = u.gather(1, local.clamp(0, x.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
    packed = torch.stack([e.sum(dim=-1), (e * u).sum(dim=-1), torch.where(owned, target, torch.zeros_like(target))])
    all_reduce_(packed, group)
    return row_max, u, torch.log(packed[0]), packed[1] / packed[0], packed[2], local, owned


class _LogProbEntropy16(torch.autograd.Function):
    """The log-prob pass on 16-bit logits as the trainers run it, with x = round16(z / T) (the float32 product
    z (1/T) rounded to the dtype, logits.div_(T)) and every op's output rounded: lambda = round16((x_y - M) -
    log S), H = round16(round16(lse) - round16(sum_v p_v x_v)), with lse = M + log S and sum_v p_v x_v =
    M + E / S over the TP group (M, S, E those of x).

    Backward, per element v of this shard, with log p_v = (x_v - M) - log S and p_v = e^(log p_v):
    a 16-bit log_softmax's backward from its rounded output and rounded upstream gradient,
    round16(round16(g_lambda) (delta_vy - e^(round16(log p_v)))), plus the entropy's part in float32 on the
    same p_v, -g_H p_v (log p_v + H) with H the float32 pass's entropy; that element rounded to the dtype,
    then div_(T)'s backward in the dtype: round16(element (1/T))."""

    @staticmethod
    def forward(fctx, logits, labels, active, group, inverse_t, vocab_start, dtype):
        z = logits.float()
        # the float32 pass's entropy, the shift of the entropy's gradient
        _, _, log_sum32, mean_u32, _, _, _ = _row_stats(z * inverse_t, labels, group, vocab_start)
        entropy32 = log_sum32 - mean_u32
        x = _round16(z * inverse_t, dtype)  # logits.div_(T) on 16-bit logits
        row_max, u, log_sum, mean_u, target, local, owned = _row_stats(x, labels, group, vocab_start)
        logprob = _round16(target - log_sum, dtype)
        entropy = _round16(_round16(row_max + log_sum, dtype) - _round16(row_max + mean_u, dtype), dtype)
        zero = torch.zeros_like(logprob)
        logprob = torch.where(active, logprob, zero)
        entropy = torch.where(active, entropy, zero)
        fctx.save_for_backward(u, log_sum, entropy32, local, owned, active)
        fctx.inverse_t = inverse_t
        fctx.dtype = dtype
        fctx.in_dtype = logits.dtype
        return logprob, entropy

    @staticmethod
    def backward(fctx, grad_logprob, grad_entropy):
        u, log_sum, entropy32, local, owned, active = fctx.saved_tensors
        dtype = fctx.dtype
        log_p, p, target = _softmax_and_target(u, log_sum, local, owned)
        # log_softmax's backward in the dtype: its upstream gradient and its output rounded, its result rounded
        upstream = _round16(grad_logprob.float(), dtype).unsqueeze(-1)
        element = _round16(upstream * (target - torch.exp(_round16(log_p, dtype))), dtype)
        element = element - grad_entropy.float().unsqueeze(-1) * p * (log_p + entropy32.unsqueeze(-1))
        # the element cast to the dtype, then div_(T)'s backward there
        grad = _round16(_round16(element, dtype) * fctx.inverse_t, dtype)
        grad = torch.where(active.unsqueeze(-1), grad, torch.zeros_like(grad))
        return grad.to(fctx.in_dtype), None, None, None, None, None, None


def logprob_entropy_16bit(logits, labels, ctx, inverse_t):
    """The log-prob pass on the logits' 16-bit dtype (verl b178a3cd logprobs_from_logits_v2's non-float32
    branch and entropy_from_logits; SkyRL a9564572 logits.div_(temperature); TRL f2cd5771
    selective_log_softmax, entropy_from_logits): x / T rounded, then log_softmax, logsumexp, softmax and
    sum p x each returning a 16-bit value. The gradient is a 16-bit log_softmax's backward on the rounded x / T
    (the entropy's part in float32), then div_(T)'s in the dtype (_LogProbEntropy16); float32 logits are left
    alone."""
    if ctx.dtype not in (torch.bfloat16, torch.float16):
        return vocab_parallel_logprob_entropy(logits, labels, ctx, inverse_t=inverse_t)
    return _LogProbEntropy16.apply(logits, labels, ctx.loss_mask, ctx.tp_group, inverse_t, ctx.vocab_start,
                                   ctx.dtype)


def _fused_pad(logits):
    """The shard padded with zero columns to a multiple of 1024, as a fused kernel's tiles hold it."""
    pad = (1024 - logits.shape[-1] % 1024) % 1024
    if pad == 0:
        return logits
    return torch.cat([logits, logits.new_zeros(logits.shape[:-1] + (pad,))], dim=-1)


def tempered_16bit(logits, ctx, inverse_t):
    """NeMo-RL's logits.div_(temperature) on 16-bit logits (nemo_rl/models/automodel/train.py:193,
    models/megatron/train.py:216 at 7ea279ab): x = round16(z / T), the float32 product z (1/T) rounded to the
    logits' dtype, left for a float32 log-prob pass at T = 1. Backward through it autograd rounds that pass's
    gradient to the dtype (x's grad), multiplies it by 1/T in float32 and rounds again (z's grad)."""
    return (logits.float() * inverse_t).to(ctx.dtype)


def _logprob_entropy(logits, labels, ctx, bugs):
    """The log-prob pass as the switches make it: (logprob, entropy) [rows] float32."""
    inverse_t = _inverse_temperature(ctx, bugs)
    width = logits.shape[-1]
    if bugs.temperature_16bit and ctx.dtype in (torch.bfloat16, torch.float16) and inverse_t != 1.0:
        logits, inverse_t = tempered_16bit(logits, ctx, inverse_t), 1.0  # the pass then reads x at T = 1
    # float32 first, as trainers do: where the log-prob and the entropy come from two graphs, their gradients
    # meet in float32 and reach 16-bit logits rounded once
    logits = logits.float()
    shard = _fused_pad(logits) if bugs.fused_vocab_pad else logits
    logprob, entropy = vocab_parallel_logprob_entropy(shard, labels, ctx, inverse_t=inverse_t, width=width)
    if bugs.logprob_untracked_allreduce:
        logprob = logprob_with_untracked_all_reduce(logits, labels, ctx, inverse_t)
    if bugs.entropy_untracked_allreduce:
        entropy = entropy_with_untracked_all_reduce(logits, ctx, inverse_t)
    if bugs.logprob_allgather_grad_sum:
        logprob = logprob_from_all_gather(logits, labels, ctx, inverse_t)
    if bugs.logsoftmax_untracked_allreduce:
        logprob, entropy = logsoftmax_with_untracked_all_reduce(logits, labels, ctx, inverse_t)
    if bugs.logprob_16bit:
        logprob, entropy = logprob_entropy_16bit(logits, labels, ctx, inverse_t)
    if bugs.temperature_after_logprob:  # the pass ran at T = 1; its log-probs divided by T afterwards
        logprob = logprob * _inverse_temperature(ctx, PolicyBugs())
    return logprob, entropy


def _once(ctx, key, compute):
    if key not in ctx.state:
        ctx.state[key] = compute()
    return ctx.state[key]


def _whitening(ctx, group):
    """(mean, unbiased deviation) of the advantages over the valid tokens of this rank's step and `group`'s."""
    moments = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for mb in ctx.micro_batches:
        a = mb.advantages[mb.loss_mask].double()
        moments += torch.stack([torch.tensor(float(a.numel()), dtype=torch.float64, device=ctx.device), a.sum(),
                                (a * a).sum()])
    dist.all_reduce(moments, group=group)
    n = max(float(moments[0]), 1.0)
    mean = float(moments[1]) / n
    variance = max(float(moments[2]) - n * mean * mean, 0.0) / (n - 1.0) if n > 1.0 else 0.0
    return mean, variance ** 0.5


def whitened_advantages(ctx, bugs=None):
    """The current micro-batch's advantages, whitened over the step's valid tokens when the case asks for it
    (statistics over DP x CP; over DP only under adv-whiten-dp-only), float32 [rows], 0 on masked rows."""
    bugs = bugs or PolicyBugs()
    advantages = ctx.advantages.float()
    if not ctx.loss.whiten_advantages:
        return advantages
    group = ctx.dp_group if bugs.adv_whiten_dp_only else ctx.dp_cp_group
    mean, std = _once(ctx, ("policy_whitening", bugs.adv_whiten_dp_only), lambda: _whitening(ctx, group))
    f32 = torch.float32
    scale = 1.0 / (torch.tensor(std, dtype=f32) + torch.tensor(ctx.loss.whiten_epsilon, dtype=f32))
    whitened = (advantages - torch.tensor(mean, dtype=f32)) * scale.to(advantages.device)
    return masked(whitened, ctx.loss_mask)


def _micro_batch_counts(ctx):
    """Per DP rank and micro-batch [dp, ga]: valid tokens over its CP group, and its sequences with n_s > 0
    (counted once, by CP rank 0), all-reduced over DP x CP."""
    n_s = ctx.sequence_valid_tokens
    counts = torch.zeros((2, ctx.dp_size, ctx.ga), dtype=torch.int64, device=ctx.device)
    for k, mb in enumerate(ctx.micro_batches):
        counts[0, ctx.dp_rank, k] = mb.loss_mask.sum()
        if ctx.cp_rank == 0 and mb.rows:
            sequences = torch.unique(mb.sequences[mb.sequences >= 0])
            counts[1, ctx.dp_rank, k] = int((n_s[sequences] > 0).sum())
    dist.all_reduce(counts, group=ctx.dp_cp_group)
    return counts


def _rank_local_weights(ctx):
    """microbatch-local-mean: this rank's micro-batch aggregated with its own counts (its valid rows n(r,k), its
    sequences B_k with valid rows here and each one's rows n_s here), divided by GA, the ranks' results then
    averaged over DP x CP (float64 [rows]); token-sum has no count and keeps its weight."""
    aggregation, mask = ctx.loss.aggregation, ctx.loss_mask
    if aggregation == "token-sum":
        return ctx.aggregation_weights()
    divisor = float(ctx.dp_size * ctx.cp_size * ctx.ga)
    _, own, n_s = torch.unique(ctx.sequences[mask], return_inverse=True, return_counts=True)
    rows = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows[mask] = n_s[own].double()  # each valid row's sequence's valid rows in this micro-batch on this rank
    b_k = float(max(n_s.numel(), 1))
    if aggregation == "token-mean":
        per_row = torch.full_like(rows, float(max(int(mask.sum()), 1)))
    elif aggregation == "seq-mean-token-sum":
        per_row = torch.full_like(rows, b_k)
    elif aggregation == "seq-mean-token-mean":
        per_row = b_k * rows.clamp(min=1.0)
    else:  # seq-mean-token-sum-norm
        per_row = torch.full_like(rows, b_k * ctx.loss.norm_constant)
    return torch.where(mask, 1.0 / (per_row * divisor), torch.zeros_like(rows))


def _weights(ctx, bugs):
    """Each row's weight in L (float64 [rows]) under the case's aggregation, as the switches make it."""
    loss, mask = ctx.loss, ctx.loss_mask.double()
    aggregation = loss.aggregation
    if bugs.microbatch_local_mean:
        return _rank_local_weights(ctx)
    if aggregation == "seq-mean-token-sum-norm" and bugs.drgrpo_rank_batch_sum:
        # verl's new engine: each micro-batch's sum_s S_s / H_max (no batch size for this mode), the rank's
        # micro-batches summed, the DP ranks averaged
        return mask / (ctx.dp_size * loss.norm_constant)
    if aggregation.startswith("seq-mean") and bugs.seq_mean_counts_empty:
        # torch.mean over every sequence row: B_all = all the step's sequences instead of those with n_s > 0
        return ctx.aggregation_weights() * (ctx.num_sequences / len(ctx.sequence_valid_tokens))
    token_mean_bug = bugs.token_mean_sample_weighted or bugs.microbatch_self_normalized
    needs_counts = ((aggregation == "token-mean" and token_mean_bug)
                    or (aggregation == "seq-mean-token-sum-norm" and bugs.drgrpo_batch_sum))
    if not needs_counts:
        return ctx.aggregation_weights()
    counts = _once(ctx, "policy_micro_batch_counts", lambda: _micro_batch_counts(ctx))
    micro_tokens = float(max(int(counts[0, ctx.dp_rank, ctx.micro_batch]), 1))
    micro_sequences = float(counts[1, ctx.dp_rank, ctx.micro_batch])
    if aggregation == "seq-mean-token-sum-norm":  # verl #3741: the norm mode summed over the micro-batch's b
        return ctx.aggregation_weights() * micro_sequences
    if bugs.microbatch_self_normalized:  # each micro-batch over its own count; the engine sums them, DP averages
        return mask / (ctx.dp_size * micro_tokens)
    rank_sequences = float(counts[1, ctx.dp_rank].sum())  # token mean of the micro-batch x its sequence share
    return mask * ((1.0 / micro_tokens) * (micro_sequences / rank_sequences) / ctx.dp_size)


def _log_ratio(logprob, old_logprob, ctx, bugs):
    """The log of each token's ratio: None (its own lambda - old) under ratio token; under ratio sequence
    GSPO's log rho_s, its per-sequence sums all-reduced over CP (differentiably: rho_s depends on every CP
    rank's lambdas), or over this rank's own chunks alone under gspo-cp-local-ratio, the sum of the gradient
    then this rank's own too."""
    if ctx.loss.ratio != "sequence":
        return None
    group = None if bugs.gspo_cp_local_ratio else ctx.cp_group
    return sequence_log_ratio(logprob, old_logprob, ctx.loss_mask, ctx.sequences, len(ctx.sequence_valid_tokens),
                              group)


def _per_token(logits, labels, ctx, bugs):
    """(terms, logprob, entropy, token loss l, the objective's l with the switches' scales)."""
    loss, valid = ctx.loss, ctx.loss_mask
    logprob, entropy = _logprob_entropy(logits, labels, ctx, bugs)
    if loss.objective == "logprob":
        terms = policy_terms(logprob, None, None, None, loss)
    else:
        old = ctx.old_logprob.float()
        terms = policy_terms(logprob, old, ctx.ref_logprob.float(), whitened_advantages(ctx, bugs), loss,
                             log_ratio=_log_ratio(logprob, old, ctx, bugs))
    if bugs.kl_no_grad:
        terms = replace(terms, kl=terms.kl.detach())
    if bugs.kl_score_function and loss.objective != "logprob":
        # NeMo-RL's calculate_kl with importance weights: the KL x e^(lambda - sg lambda), value 1, whose
        # gradient gains KL_t per token
        terms = replace(terms, kl=terms.kl * torch.exp(logprob - logprob.detach()))
    value = masked(token_loss(terms, entropy, loss), valid)
    scale = float(ctx.cp_size) if bugs.cp_extra_scale else 1.0
    objective = value if scale == 1.0 else masked(token_loss(terms, entropy, loss, kl_scale=scale,
                                                             entropy_scale=scale), valid)
    return terms, logprob, entropy, value, objective


def policy_token_loss(logits, labels, ctx, bugs=None):
    """The per-token policy losses l [rows] (0 on masked rows), for code that aggregates them itself."""
    return _per_token(logits, labels, ctx, bugs or PolicyBugs())[3]


def _backward_weights(ctx, bugs, weights):
    """Each row's weight in what this rank back-propagates: its weight in L over the framework factor, or, under
    microbatch-local-mean (counts other than token-sum's), the rank's own local aggregation / GA, whatever the
    framework then does with it (its DP x CP average makes that the weight in L)."""
    if bugs.microbatch_local_mean and ctx.loss.aggregation != "token-sum":
        ga = ctx.ga if ctx.framework.ga_reduce == "mean" else 1
        return weights * float(ctx.dp_size * ctx.cp_size * ga)
    return weights / ctx.framework_factor


def _statistics_count(ctx, bugs):
    """What each logged statistic's token sum is divided by: N, or under rl-stats-microbatch-mean (TRL's
    global_masked_mean per micro-batch, the Trainer's log averaging the K appended values) K N_k, N_k the
    valid tokens of micro-batch k over every DP x CP rank."""
    if not bugs.stats_microbatch_mean:
        return ctx.num_valid_tokens
    counts = _once(ctx, "policy_micro_batch_counts", lambda: _micro_batch_counts(ctx))
    return max(int(counts[0, :, ctx.micro_batch].sum()), 1) * ctx.ga


def _aux_bug(ctx, bugs):
    return (ctx.loss.objective != "logprob"
            and (bugs.aux_token_mean or bugs.aux_sample_weighted or bugs.aux_microbatch_mean))


def _aux_weights(ctx, bugs):
    """The KL's and the entropy's own weights in L (float64 [rows] each) under the aux-term bugs, whatever the
    aggregation. rl-aux-token-mean: both 1/N. rl-aux-sample-weighted and rl-aux-microbatch-mean: within
    micro-batch k of a DP rank (b_k sequences, N_k valid tokens over its CP group) the KL a mean over the
    sequences of each one's token mean, 1/(b_k n_s), the entropy the token mean 1/N_k, each micro-batch weighted
    by b_k / B_r (its share of the rank's B_r sequences) or by 1/K, then the DP mean."""
    mask = ctx.loss_mask.double()
    if bugs.aux_token_mean:
        n = mask / max(ctx.num_valid_tokens, 1)
        return n, n
    counts = _once(ctx, "policy_micro_batch_counts", lambda: _micro_batch_counts(ctx))
    n_k = float(max(int(counts[0, ctx.dp_rank, ctx.micro_batch]), 1))
    b_k = float(max(int(counts[1, ctx.dp_rank, ctx.micro_batch]), 1))
    if bugs.aux_sample_weighted:  # x len(microbatch) / len(data)
        share = b_k / float(max(int(counts[1, ctx.dp_rank].sum()), 1))
    else:  # Megatron's schedule divides each micro-batch by K
        share = 1.0 / ctx.ga
    n_s = ctx.sequence_valid_tokens[ctx.sequences.clamp(min=0)].double().clamp(min=1.0)
    kl = mask * share / (b_k * ctx.dp_size) / n_s  # masked_mean(kl, mask, dim=-1).mean()
    entropy = mask * (share / (n_k * ctx.dp_size))  # masked_mean(entropy, mask)
    return kl, entropy


def _aux_parts(terms, entropy, ctx, bugs, weights):
    """The objective as the aux-term bugs' frameworks add it up: the policy term aggregated with the case's
    weights, kl_coef x the KL and -entropy_coef x the entropy each with its own (_aux_weights). Returns
    [(per-token part, its weights in L)]."""
    loss, valid = ctx.loss, ctx.loss_mask
    kl_weights, entropy_weights = _aux_weights(ctx, bugs)
    parts = [(masked(terms.surrogate, valid), weights)]
    if loss.kl_coef:
        parts.append((masked(float(torch.tensor(loss.kl_coef, dtype=torch.float32)) * terms.kl, valid), kl_weights))
    if loss.entropy_coef:
        parts.append((masked(-float(torch.tensor(loss.entropy_coef, dtype=torch.float32)) * entropy, valid),
                      entropy_weights))
    return parts


def policy_loss(logits, labels, ctx, bugs=None):
    """The policy loss of one micro-batch as a training loop computes it: the log-prob pass, the objective on
    whitened advantages, each token weighted by the aggregation, compensated for the framework factor; with
    its per-token losses, log-probabilities, entropies and logged statistics (Reduced)."""
    bugs = bugs or PolicyBugs()
    terms, logprob, entropy, value, objective = _per_token(logits, labels, ctx, bugs)
    weights = _weights(ctx, bugs)
    if _aux_bug(ctx, bugs):  # the policy term, the KL and the entropy each aggregated its own way
        parts = _aux_parts(terms, entropy, ctx, bugs, weights)
        loss = sum((part * _backward_weights(ctx, bugs, w).to(torch.float32)).sum() for part, w in parts)
        logged = sum((part.detach().double() * w).sum() for part, w in parts)
    else:
        loss = (objective * _backward_weights(ctx, bugs, weights).to(torch.float32)).sum()
        logged = (value.detach().double() * weights).sum()
    if bugs.schedule_double_divide:  # the schedule divides by the micro-batch count once more
        loss = loss / ctx.ga
    scale = float(ctx.cp_size) if bugs.cp_extra_scale else 1.0
    stats = statistics_parts(terms, entropy, ctx.loss_mask, _statistics_count(ctx, bugs), kl_scale=scale,
                             entropy_scale=scale)
    return Reduced(loss, token_loss=value, num_tokens=ctx.num_valid_tokens, logged=logged, logprob=logprob,
                   entropy=entropy, stats=stats)
