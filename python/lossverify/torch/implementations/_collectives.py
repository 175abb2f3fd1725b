"""The collectives of tensor-parallel losses, with the backward each one needs.

A vocabulary-parallel loss all-reduces per-row statistics over the TP group. Whether autograd sees those
all-reduces is exactly where implementations go wrong, so each helper says what its backward is.
"""

import torch
import torch.distributed as dist


def all_reduce_(tensor, group, op=dist.ReduceOp.SUM):
    """In-place all-reduce that autograd does not see (for statistics computed without grad)."""
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _ReduceIdentityBackward(torch.autograd.Function):
    """Sum over the group in forward, identity in backward (Megatron's reduce-from-model-parallel region):
    every rank then holds the same replicated value and back-propagates it into its own shard only."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_from_group(tensor, group):
    return _ReduceIdentityBackward.apply(tensor, group)


class _GatherColumns(torch.autograd.Function):
    """All-gather of the last dimension in forward; backward keeps this rank's own columns (Megatron's
    gather-from-model-parallel region, as used by an output layer with gather_output=True), or, with
    sum_backward, first sums the replicated gradient over the group (a DTensor redistributed from Shard to
    Replicate, whose backward all-reduces)."""

    @staticmethod
    def forward(ctx, tensor, group, sum_backward=False):
        size = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        ctx.group = group
        ctx.sum_backward = sum_backward
        widths = [torch.zeros((), dtype=torch.int64, device=tensor.device) for _ in range(size)]
        dist.all_gather(widths, torch.tensor(tensor.shape[-1], device=tensor.device), group=group)
        widths = [int(w) for w in widths]
        ctx.widths = widths
        # gathered as raw bytes padded to the widest shard: gloo gathers equal sizes only and no bf16
        widest = max(widths)
        padded = tensor.new_zeros(tensor.shape[:-1] + (widest,))
        padded[..., :tensor.shape[-1]] = tensor
        raw = padded.contiguous().view(torch.uint8)
        pieces = [torch.empty_like(raw) for _ in widths]
        dist.all_gather(pieces, raw, group=group)
        return torch.cat([p.view(tensor.dtype)[..., :w] for p, w in zip(pieces, widths)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_backward:  # summed in float32: gloo has no bf16 sum
            summed = grad.float().contiguous()
            dist.all_reduce(summed, group=ctx.group)
            grad = summed.to(grad.dtype)
        begin = sum(ctx.widths[:ctx.rank])
        return grad[..., begin:begin + ctx.widths[ctx.rank]].contiguous(), None, None


def gather_columns(tensor, group, sum_backward=False):
    return _GatherColumns.apply(tensor, group, sum_backward)
