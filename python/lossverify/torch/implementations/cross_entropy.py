"""Vocabulary-parallel cross-entropy (docs/spec.md §3 and 5) as a torch.autograd.Function, with the catalogue's
kernel-level bugs as switches.

Per row, over the TP group only: M = all-reduce max of the local maxima, then one packed all-reduce sum of
[S = sum exp(x - M), x_l - M (from the rank that owns the label), sum (x - M) (only with smoothing)]. The
loss follows without ever taking log(p):

    lse = M + log S,  loss = log S - [q_off sum(x - M) + (q_on - q_off)(x_l - M)] + w_z lse^2

with q the smoothed target (pytorch: q_on = 1 - a + a/V, q_off = a/V; megatron: q_on = 1 - a,
q_off = a/(V-1)). The backward needs no communication: p (1 + 2 w_z lse) - q on the local columns,
times the upstream gradient, times 1 - tanh^2 under softcap. Everything is computed in float32 from the
exact input values; the gradient is returned in the input dtype.

Rows that do not count (ignored labels, CP padding) get a zero loss and an exactly zero gradient.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lossverify.torch.implementations._collectives import all_reduce_

__all__ = ["CrossEntropyBugs", "vocab_parallel_cross_entropy", "smoothing_weights"]


@dataclass(frozen=True)
class CrossEntropyBugs:
    """Kernel-level catalogued bugs; each switch names where it was seen."""

    # smoothing constants and mean log-prob from the shard: width V_p, local sum (Megatron-LM, still on main at d98e8a64)
    partition_vocab_forward: bool = False
    partition_vocab_backward: bool = False  # the backward's constants from V_p (half-fixed Megatron-LM)
    log_after_exp: bool = False  # mean log-prob as log(exp(x - M) / S): -inf once exp underflows
    raw_local_sum: bool = False  # sum_v x_v of the smoothing term over the local shard (TE Triton kernel, TP > 1)
    convention_swap: bool = False  # pytorch smoothing where megatron was asked, or back
    no_max_shift: bool = False  # exp(x) without the max: overflows past x ~ 88.7 in float32
    zloss_grad_after_smoothing: bool = False  # (1 + 2 w_z lse) applied to (p - q) (early TE PR #2707)
    zloss_on_ignored: bool = False  # z-loss and its gradient on ignored rows too (TE PR #2707 review)
    grad_output_first: bool = False  # reduction none: grad_output[0] for every row (TE issue #2139)
    none_divides_grad: bool = False  # reduction none: gradient still divided by the rows (TE issue #1879)
    grad_rounded_early: bool = False  # gradient rounded to the input dtype before the upstream weight (TE #3193)


def smoothing_weights(alpha, convention, vocab):
    """(q_on, q_off): the target distribution's value on the label and off it."""
    if convention == "megatron":
        return 1.0 - alpha, alpha / (vocab - 1)
    return 1.0 - alpha + alpha / vocab, alpha / vocab


@dataclass(frozen=True)
class _Setup:
    group: object
    vocab_start: int
    vocab_size: int
    alpha: float
    convention: str
    z_loss_weight: float
    softcap: float
    reduction: str
    bugs: CrossEntropyBugs


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, labels, valid, active, setup):
        bugs = setup.bugs
        x = _capped(logits.float(), setup.softcap)  # .float() may alias an fp32 input: never written to
        rows, width = x.shape
        if bugs.no_max_shift:
            row_max = torch.zeros(rows, dtype=torch.float32, device=x.device)
        else:
            row_max = all_reduce_(x.max(dim=-1).values, setup.group, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)
        local_label = labels - setup.vocab_start
        owned = (local_label >= 0) & (local_label < width)
        target = shifted.gather(1, local_label.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        smoothing = setup.alpha > 0
        packed = [shifted.exp().sum(dim=-1), torch.where(owned, target, torch.zeros_like(target))]
        if smoothing:
            packed.append(shifted.sum(dim=-1))
        packed = torch.stack(packed)
        local_sum_shifted = packed[2].clone() if smoothing else None
        all_reduce_(packed, setup.group)
        sum_exp, target_shifted = packed[0], packed[1]
        log_sum = sum_exp.log()
        lse = row_max + log_sum

        convention = setup.convention
        if bugs.convention_swap:
            convention = "pytorch" if convention == "megatron" else "megatron"
        forward_vocab = width if bugs.partition_vocab_forward else setup.vocab_size
        q_on, q_off = smoothing_weights(setup.alpha, convention, forward_vocab)
        if not smoothing:
            loss = log_sum - target_shifted
        elif bugs.raw_local_sum:
            local_raw_sum = local_sum_shifted + width * row_max
            loss = lse - (q_off * local_raw_sum + (q_on - q_off) * (target_shifted + row_max))
        else:
            loss = log_sum - (q_off * _smoothing_sum(shifted, packed, local_sum_shifted, sum_exp, log_sum, setup,
                                                    width) + (q_on - q_off) * target_shifted)
        z = setup.z_loss_weight
        loss = loss + z * lse * lse  # even at w_z = 0: an infinite lse makes the loss NaN, as in a fused kernel
        zero = torch.zeros_like(loss)
        loss = torch.where(valid, loss, torch.where(active, z * lse * lse, zero))

        fctx.save_for_backward(x, row_max, log_sum, local_label, owned, valid, active)
        fctx.setup = setup
        fctx.in_dtype = logits.dtype
        fctx.backward_weights = smoothing_weights(setup.alpha, convention,
                                                  width if bugs.partition_vocab_backward else setup.vocab_size)
        return loss

    @staticmethod
    def backward(fctx, grad_output):
        x, row_max, log_sum, local_label, owned, valid, active = fctx.saved_tensors
        setup, bugs = fctx.setup, fctx.setup.bugs
        q_on, q_off = fctx.backward_weights
        rows = x.shape[0]
        probability = torch.exp((x - row_max.unsqueeze(-1)) - log_sum.unsqueeze(-1))
        lse = (row_max + log_sum).unsqueeze(-1)
        z = setup.z_loss_weight
        z_factor = 1.0 + 2.0 * z * lse
        target = torch.zeros_like(x, dtype=torch.bool)
        target[torch.arange(rows, device=x.device), local_label.clamp(0, x.shape[1] - 1)] = owned
        q = torch.where(target, torch.full_like(x, q_on), torch.full_like(x, q_off))
        if bugs.zloss_grad_after_smoothing:
            grad = (probability - q) * z_factor
        else:
            grad = probability * z_factor - q
        grad = torch.where(valid.unsqueeze(-1), grad, 2.0 * z * lse * probability)
        if setup.softcap > 0:
            grad = grad * (1.0 - (x / setup.softcap) ** 2)  # x is already capped: 1 - tanh^2(raw / c)
        weight = grad_output.float()
        if setup.reduction == "none" and bugs.grad_output_first:
            weight = weight[:1].expand(rows)
        if setup.reduction == "none" and bugs.none_divides_grad:
            weight = weight / rows
        if bugs.grad_rounded_early:
            grad = grad.to(fctx.in_dtype).float() * weight.unsqueeze(-1)
        else:
            grad = grad * weight.unsqueeze(-1)
        grad = torch.where(active.unsqueeze(-1), grad, torch.zeros_like(grad))
        return grad.to(fctx.in_dtype), None, None, None, None


def _capped(x, softcap):
    return softcap * torch.tanh(x / softcap) if softcap > 0 else x


def _smoothing_sum(shifted, packed, local_sum_shifted, sum_exp, log_sum, setup, width):
    """sum_v (x_v - M) as the forward's smoothing term uses it: global, the shard's, or rebuilt from
    log(exp(x - M) / S) (Megatron-LM, still on main at d98e8a64, takes the log of the probabilities)."""
    bugs = setup.bugs
    if bugs.log_after_exp:
        sum_log_p = torch.log(shifted.exp() / sum_exp.unsqueeze(-1)).sum(dim=-1)
        if not bugs.partition_vocab_forward:
            all_reduce_(sum_log_p, setup.group)
        terms = width if bugs.partition_vocab_forward else setup.vocab_size
        return sum_log_p + terms * log_sum
    return local_sum_shifted if bugs.partition_vocab_forward else packed[2]


def vocab_parallel_cross_entropy(logits, labels, ctx, bugs=None, valid=None, active=None, vocab_start=None,
                                 vocab_size=None):
    """Per-token cross-entropy losses [rows] of this rank's logits shard [rows, columns] (float32).

    valid: rows whose loss counts (default: label != ignore_index); active: rows that get a loss at all
    (default: valid; the zloss-on-ignored bug widens it); vocab_start, vocab_size: default the rank's.
    """
    loss = ctx.loss
    if valid is None:
        valid = labels != loss.ignore_index
    if active is None:
        active = valid
    setup = _Setup(group=ctx.tp_group, vocab_start=ctx.vocab_start if vocab_start is None else vocab_start,
                   vocab_size=ctx.vocab_size if vocab_size is None else vocab_size, alpha=loss.label_smoothing,
                   convention=loss.smoothing_convention, z_loss_weight=loss.z_loss_weight, softcap=loss.softcap,
                   reduction=loss.reduction, bugs=bugs or CrossEntropyBugs())
    return _VocabParallelCrossEntropy.apply(logits, labels, valid, active, setup)
