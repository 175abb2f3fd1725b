"""The LM head in PyTorch (../../../../docs/pytorch.md, "An LM head"): `fn(h, W, b, labels, ctx)` for a case with a
head in front of its kind, usable as `--fn lossverify.torch.implementations.head:correct`.

`correct` is a vocab-parallel head in front of the case's kind: u = h W_r^T (+ b_r) in float32 from the exact input
values, stored in the case's dtype for the kind's correct vocab-parallel loss (implementations.correct), whose
gradient of u comes back through autograd: dh = g W_r in float32, summed over the TP group where the head's contract
says so (`dh_reduce: head`, Megatron's copy-to-model-parallel region: identity forward, all-reduce backward; under
`framework` each rank returns its shard's partial dh), dW_r = g^T h and db_r = sum_t g_t in float32, accumulated by
autograd over the step's micro-batches into the float32 leaves the harness hands over. Every other name is one of the
head's catalogued bugs (`lossverify list`, snake_case here), written the way its source wrote it. `CATALOGUE` maps
every name to its function.
"""

import dataclasses

import torch
import torch.distributed as dist

from lossverify.torch.implementations.catalogue import correct as correct_loss

__all__ = ["CATALOGUE", "correct", "head_dh_shard_partial", "head_dh_double_reduce", "head_smoothing_dropped",
           "head_softcap_dropped", "head_bias_repeated"]


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over the group `times` times in backward (0: the rank's own)."""

    @staticmethod
    def forward(fctx, x, group, times):
        fctx.group, fctx.times = group, times
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        grad = grad.contiguous().clone()
        for _ in range(fctx.times):
            dist.all_reduce(grad, group=fctx.group)
        return grad, None, None


def _contract_reductions(ctx):
    """How many times the head sums dh over TP: once under the head's contract, never under the framework's."""
    return 1 if ctx.head.get("dh_reduce", "head") == "head" else 0


def head_logits(h, W, b, ctx, reductions=None, bias_on_label=None):
    """u = h W^T (+ b) in float32, in the case's dtype; dh summed over TP `reductions` times in backward.
    bias_on_label: the labels whose own bias is added a second time (head-bias-repeated)."""
    x = _SumGradientOverGroup.apply(h.float(), ctx.tp_group,
                                    _contract_reductions(ctx) if reductions is None else reductions)
    u = x @ W.t()
    if b is not None:
        u = u + b
        if bias_on_label is not None:
            local = bias_on_label - ctx.vocab_start
            owned = ((local >= 0) & (local < u.shape[1])).nonzero().squeeze(-1)
            extra = torch.zeros_like(u).index_put((owned, local[owned]), b[local[owned]])
            u = u + extra
    return u.to(ctx.dtype)


def correct(h, W, b, labels, ctx):
    """The head, then the case's kind's correct vocab-parallel loss: per-token losses [rows]."""
    return correct_loss(head_logits(h, W, b, ctx), labels, ctx)


def head_dh_shard_partial(h, W, b, labels, ctx):
    """dh of the rank's vocabulary shard never summed over TP (Apple ml-cross-entropy #42, b616b22)."""
    return correct_loss(head_logits(h, W, b, ctx, reductions=0), labels, ctx)


def head_dh_double_reduce(h, W, b, labels, ctx):
    """dh summed over TP by the head and once more (Apple ml-cross-entropy #42): x TP under the head's contract,
    whole instead of partial under the framework's."""
    return correct_loss(head_logits(h, W, b, ctx, reductions=_contract_reductions(ctx) + 1), labels, ctx)


def _with_setting(ctx, **changes):
    """ctx with the kind's settings changed where the kind has them (a fused path that drops them)."""
    kept = {key: value for key, value in changes.items() if hasattr(ctx.loss, key)}
    return dataclasses.replace(ctx, loss=ctx.loss.replace(**kept)) if kept else ctx


def head_smoothing_dropped(h, W, b, labels, ctx):
    """Label smoothing not passed through the fused path (Liger-Kernel #243 -> #244)."""
    return correct_loss(head_logits(h, W, b, ctx), labels, _with_setting(ctx, label_smoothing=0.0))


def head_softcap_dropped(h, W, b, labels, ctx):
    """The softcap never applied in the fused path of a model that has one (Apple ml-cross-entropy #48 -> #50)."""
    return correct_loss(head_logits(h, W, b, ctx), labels, _with_setting(ctx, softcap=0.0))


def head_bias_repeated(h, W, b, labels, ctx):
    """The bias added a second time to the target logit (Apple ml-cross-entropy #52 -> #53)."""
    return correct_loss(head_logits(h, W, b, ctx, bias_on_label=labels), labels, ctx)


CATALOGUE = {
    "correct": correct,
    "head_dh_shard_partial": head_dh_shard_partial,
    "head_dh_double_reduce": head_dh_double_reduce,
    "head_smoothing_dropped": head_smoothing_dropped,
    "head_softcap_dropped": head_softcap_dropped,
    "head_bias_repeated": head_bias_repeated,
}
