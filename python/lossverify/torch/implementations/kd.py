"""Vocabulary-parallel knowledge distillation: forward KL(P || Q) with temperature T and T^2 scaling (docs/spec.md §3),
as a torch.autograd.Function with the catalogue's KD switches, plus the untracked all-reduce bug written
with plain autograd (where that bug lives).

With a = x/T (student), b = y/T (teacher): one all-reduce of both maxima, one packed all-reduce of
[S_a, S_b, W = sum exp(b - M_b)(b - a)], and KL = W/S_b + (M_a - M_b) + log(S_a/S_b): no log P or log Q
is taken and a student equal to its teacher gives exactly 0. Gradient T^(s-1) (Q - P), no communication.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lossverify.torch.implementations._collectives import all_reduce_, reduce_from_group

__all__ = ["KdBugs", "vocab_parallel_kl", "kl_with_untracked_all_reduce"]


@dataclass(frozen=True)
class KdBugs:
    no_t2: bool = False  # T^2 missing (NeMo KDLoss before PR #1499)
    double_t2: bool = False  # T^2 applied twice: the loss scales itself and the caller scales again
    cross_entropy_value: bool = False  # reports H(P, Q) instead of KL (NeMo KDLoss at PR #1499)
    local_softmax: bool = False  # softmax normalised per TP shard, the shard KLs summed
    tp_grad_sum: bool = False  # the replicated loss's gradients summed over TP (NeMo Automodel _kl_forward_tp)


def _t_powers(loss, bugs):
    """(T^s on the loss, T^(s-1) on the gradient), s = 2 with T^2 scaling, as the switches make it."""
    power = 2 if loss.t2_scaling else 0
    if loss.t2_scaling and bugs.no_t2:
        power = 0
    if loss.t2_scaling and bugs.double_t2:
        power = 4
    t = loss.temperature
    return t ** power, t ** (power - 1)


class _VocabParallelKL(torch.autograd.Function):
    @staticmethod
    def forward(fctx, student, teacher, active, group, inverse_t, scales, bugs):
        a = student.float() * inverse_t
        b = teacher.float() * inverse_t
        maxima = torch.stack([a.max(dim=-1).values, b.max(dim=-1).values])
        if not bugs.local_softmax:
            all_reduce_(maxima, group, dist.ReduceOp.MAX)
        max_a, max_b = maxima[0].unsqueeze(-1), maxima[1].unsqueeze(-1)
        exp_b = torch.exp(b - max_b)
        sums = [torch.exp(a - max_a).sum(dim=-1), exp_b.sum(dim=-1), (exp_b * (b - a)).sum(dim=-1)]
        if bugs.cross_entropy_value:
            sums.append((exp_b * (a - max_a)).sum(dim=-1))
        sums = torch.stack(sums)
        if not bugs.local_softmax:
            all_reduce_(sums, group)
        sum_a, sum_b = sums[0], sums[1]
        if bugs.cross_entropy_value:  # H(P, Q) = lse_a - sum_v P_v a_v
            value = torch.log(sum_a) - sums[3] / sum_b
        else:
            value = sums[2] / sum_b + ((maxima[0] - maxima[1]) + torch.log(sum_a / sum_b))
        if bugs.local_softmax:  # each shard's own KL, summed over the group: every rank reports the sum
            all_reduce_(value, group)
        loss = torch.where(active, scales[0] * value, torch.zeros_like(value))
        lse_a = maxima[0] + torch.log(sum_a)
        lse_b = maxima[1] + torch.log(sum_b)
        fctx.save_for_backward(a, b, lse_a, lse_b, active)
        fctx.grad_scale = scales[1]
        fctx.in_dtype = student.dtype
        return loss

    @staticmethod
    def backward(fctx, grad_output):
        a, b, lse_a, lse_b, active = fctx.saved_tensors
        q = torch.exp(a - lse_a.unsqueeze(-1))
        p = torch.exp(b - lse_b.unsqueeze(-1))
        grad = (fctx.grad_scale * (q - p)) * grad_output.float().unsqueeze(-1)
        grad = torch.where(active.unsqueeze(-1), grad, torch.zeros_like(grad))
        return grad.to(fctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_kl(student, teacher, ctx, bugs=None, active=None):
    """Per-token T^s KL(softmax(teacher/T) || softmax(student/T)) [rows] of this rank's shards (float32)."""
    bugs = bugs or KdBugs()
    if active is None:
        active = ctx.loss_mask
    inverse_t = float(torch.tensor(1.0 / ctx.loss.temperature, dtype=torch.float32))
    loss_scale, grad_scale = _t_powers(ctx.loss, bugs)
    if bugs.tp_grad_sum:
        grad_scale *= ctx.tp_size
    return _VocabParallelKL.apply(student, teacher, active, ctx.tp_group, inverse_t, (loss_scale, grad_scale), bugs)


def _distributed_log_softmax(z, group):
    """log softmax over the TP group's columns, with no autograd (for the teacher)."""
    row_max = all_reduce_(z.max(dim=-1, keepdim=True).values, group, dist.ReduceOp.MAX)
    total = all_reduce_(torch.exp(z - row_max).sum(dim=-1, keepdim=True), group)
    return z - row_max - torch.log(total)


def kl_with_untracked_all_reduce(student, teacher, ctx):
    """Per-token KD loss with the student's softmax statistics all-reduced in place, outside autograd
    (NeMo KDLoss PR #1499, _kl_forward_tp). The forward is right; the backward differentiates each shard's
    own max and sum: g_j = P_r Q_j - P_j + [j = local argmax] P_r (1 - Q_r)."""
    inverse_t = 1.0 / ctx.loss.temperature
    a = student.float() * inverse_t
    with torch.no_grad():
        log_p = _distributed_log_softmax(teacher.float() * inverse_t, ctx.tp_group)
    row_max = a.max(dim=-1, keepdim=True).values  # autograd routes its gradient to the local argmax
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ctx.tp_group)  # in place: autograd never sees it
    total = torch.exp(a - row_max).sum(dim=-1, keepdim=True)
    dist.all_reduce(total, group=ctx.tp_group)  # the bug: backward sees only this shard's sum
    log_q = a - row_max - torch.log(total)
    local_kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    kl = reduce_from_group(local_kl, ctx.tp_group)  # replicated on every rank; each back-propagates its shard
    scale = ctx.loss.temperature ** 2 if ctx.loss.t2_scaling else 1.0
    return scale * kl
