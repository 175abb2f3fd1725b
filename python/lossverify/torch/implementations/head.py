"""The LM head in PyTorch (../../../../docs/pytorch.md, "An LM head"): `fn(h, W, b, labels, ctx)` for a case with a
head in front of its kind, usable as `--fn lossverify.torch.implementations.head:correct`.

`correct` is a vocab-parallel head in front of the case's kind (cross-entropy, KD or the policy kind): u = h W_r^T
(+ b_r) in float32 from the exact input values, stored in the case's dtype for the kind's correct vocab-parallel loss
(implementations.correct), whose gradient g of u comes back through the head's backward: dh = g W_r in float32, summed
over the TP group where the head's contract says so (`dh_reduce: head`, Megatron's copy-to-model-parallel region:
identity forward, all-reduce backward; under `framework` each rank returns its shard's partial dh), dW_r = g^T h and
db_r = sum_t g_t in float32, accumulated by autograd over the step's micro-batches into the float32 leaves the harness
hands over. Under sequence parallelism with the head's contract h is the rank's token shard: the head all-gathers it
over TP (Megatron's gather-from-sequence-parallel region) and reduce-scatters dh back to the shards. Every other name
is one of the head's catalogued bugs (`lossverify list`, snake_case here), a switch of `HeadBugs`, written the way its
source wrote it. `CATALOGUE` maps every name to its function.
"""

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from lossverify.torch.implementations.catalogue import correct as correct_loss

__all__ = ["CATALOGUE", "HeadBugs", "head_logits", "correct", "head_dh_shard_partial", "head_dh_double_reduce",
           "head_dw_16bit_accumulate", "head_grad_output_first", "head_target_rounded_early", "head_smoothing_dropped",
           "head_softcap_dropped", "head_bias_repeated"]


@dataclasses.dataclass(frozen=True)
class HeadBugs:
    """The head's catalogued bugs as switches (all off: the correct head)."""

    dh_reductions: Optional[int] = None  # how many times dh is summed over TP (None: as the contract says)
    bias_on_label: bool = False  # the bias added a second time to the target logit
    dw_16bit_accumulate: bool = False  # dW and db accumulated across the step's chunks in the 16-bit dtype
    grad_output_first: bool = False  # dW and db with the first valid token's upstream weight for every token
    target_rounded_early: bool = False  # the true class's gradient rounded into the dtype before w is subtracted


def shards_tokens(ctx):
    """Whether h is the rank's token shard (sequence parallelism under the head's dh contract)."""
    return ctx.sp and _contract_reductions(ctx) == 1


def _contract_reductions(ctx):
    """How many times the head sums dh over TP: once under the head's contract, never under the framework's."""
    return 1 if ctx.head.get("dh_reduce", "head") == "head" else 0


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


class _GatherTokensOverGroup(torch.autograd.Function):
    """Sequence parallelism: the ranks' token shards [part, H] all-gathered into the micro-batch's `rows` rows (the
    padding past the last row dropped); backward sums the gradient over the group `times` times (a reduce-scatter
    is once) and keeps the rank's own shard."""

    @staticmethod
    def forward(fctx, shard, group, rows, times):
        fctx.group, fctx.times, fctx.part = group, times, shard.shape[0]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts)[:rows]

    @staticmethod
    def backward(fctx, grad):
        size, part = dist.get_world_size(fctx.group), fctx.part
        block = grad.new_zeros((part * size, grad.shape[1]))
        block[:grad.shape[0]] = grad
        for _ in range(fctx.times):
            dist.all_reduce(block, group=fctx.group)
        mine = dist.get_rank(fctx.group)
        return block[mine * part:(mine + 1) * part].clone(), None, None, None


def _gathered_hidden(h, ctx, reductions):
    """h in float32 as the head's matmul reads it: every row of the micro-batch, dh summed over TP `reductions`
    times in backward (under sequence parallelism: gathered from the token shards, dh reduce-scattered)."""
    if shards_tokens(ctx):
        return _GatherTokensOverGroup.apply(h.float(), ctx.tp_group, ctx.current.rows, reductions)
    return _SumGradientOverGroup.apply(h.float(), ctx.tp_group, reductions)


# ---------------------------------------------------------------------------------------------------------
# the head's backward: the kind's gradient g of u in, dh = g W, dW = g^T h and db = sum_t g_t out


def _round(values, dtype):
    """Float32 values rounded to `dtype` and back."""
    return values.to(dtype).float()


def _rounded_target(g, labels, ctx):
    """g with each valid row's true-class entry formed as a fused linear cross-entropy forms it: w p_y (g_y + w, w the
    row's backward weight) rounded into the dtype's buffer before w is subtracted (Liger-Kernel #1268)."""
    if ctx.loss.kind != "cross_entropy":  # only a cross-entropy step has a w p_y - w to form
        return g
    w = (ctx.aggregation_weights() / ctx.framework_factor).to(torch.float32)
    local = labels - ctx.vocab_start
    rows = (ctx.loss_mask & (local >= 0) & (local < g.shape[1])).nonzero().squeeze(-1)
    g = g.clone()
    target = g[rows, local[rows]]
    g[rows, local[rows]] = _round(target + w[rows], ctx.dtype) - w[rows]
    return g


def _first_weight_scale(ctx):
    """Each row's factor that turns its upstream weight into the first valid row's (1 where it has none)."""
    weights = ctx.upstream_weights.double()
    valid = ctx.loss_mask & (weights != 0)
    if not bool(valid.any()):
        return torch.ones_like(weights, dtype=torch.float32)
    first = weights[valid.nonzero()[0, 0]]
    return torch.where(valid, first / weights, torch.ones_like(weights)).to(torch.float32)


def _step_chunks(ctx):
    """The rank's rows over the step cut into the case's `chunks` (lossverify's own head: row boundaries
    rows * c / chunks over every micro-batch's rows): (this micro-batch's first row, [(begin, end) of each chunk])."""
    counts = [mb.rows for mb in ctx.micro_batches]
    total = sum(counts)
    chunks = max(1, min(int(ctx.head.get("chunks", 1)), total))
    return sum(counts[:ctx.micro_batch]), [(total * c // chunks, total * (c + 1) // chunks) for c in range(chunks)]


def _accumulated_16bit(g, x, ctx, with_bias):
    """dW (and db) of this micro-batch as a head whose accumulator is the 16-bit dtype: each chunk's float32 partial
    sum added to the step's accumulator, which is rounded to the dtype after every chunk (axolotl #1601, Liger-Kernel
    #830). The accumulator and a chunk still open at the micro-batch's end carry over to the next (ctx.state); the
    micro-batch's gradient is the accumulator's change, which the float32 leaves add up to the accumulator."""
    state = ctx.state.get("head_dw_16bit")
    if state is None:
        shapes = {"dW": (g.shape[1], x.shape[1]), "db": (g.shape[1],)}
        state = ctx.state["head_dw_16bit"] = {
            key: torch.zeros(shapes[name], dtype=torch.float32, device=g.device)
            for name in shapes for key in (name, "open_" + name)}
    before = {name: state[name].clone() for name in ("dW", "db")}
    offset, chunks = _step_chunks(ctx)
    end = offset + g.shape[0]
    for begin, last in chunks:
        lo, hi = max(begin, offset) - offset, min(last, end) - offset
        if lo >= hi:
            continue
        state["open_dW"] += g[lo:hi].t() @ x[lo:hi]
        state["open_db"] += g[lo:hi].sum(0)
        if last <= end:  # the chunk closes in this micro-batch
            for name in ("dW", "db"):
                state[name] = _round(state[name] + state["open_" + name], ctx.dtype)
                state["open_" + name].zero_()
    return state["dW"] - before["dW"], (state["db"] - before["db"]) if with_bias else None


class _HeadBackward:
    """How the head turns the kind's gradient g [rows, columns] (float32) into dh, dW and db under `bugs`."""

    def __init__(self, labels, ctx, bugs):
        self.labels, self.ctx, self.bugs = labels, ctx, bugs

    def kind_gradient(self, g):
        return _rounded_target(g, self.labels, self.ctx) if self.bugs.target_rounded_early else g

    def weight_gradients(self, g, x, with_bias):
        if self.bugs.grad_output_first:
            g = g * _first_weight_scale(self.ctx).to(g.device)[:, None]
        if self.bugs.dw_16bit_accumulate:
            return _accumulated_16bit(g, x, self.ctx, with_bias)
        return g.t() @ x, g.sum(0) if with_bias else None


class _Linear(torch.autograd.Function):
    """u = x W^T (+ b) in float32; backward through a _HeadBackward."""

    @staticmethod
    def forward(fctx, x, W, b, head_backward):
        fctx.save_for_backward(x, W)
        fctx.head_backward, fctx.with_bias = head_backward, b is not None
        u = x @ W.t()
        return u + b if b is not None else u

    @staticmethod
    def backward(fctx, grad):
        x, W = fctx.saved_tensors
        g = fctx.head_backward.kind_gradient(grad.float())
        dW, db = fctx.head_backward.weight_gradients(g, x, fctx.with_bias)
        return g @ W, dW.to(W.device), db, None


def head_logits(h, W, b, labels, ctx, bugs=HeadBugs()):
    """u = h W^T (+ b) in float32, in the case's dtype; dh summed over TP as the contract says (or `bugs`)."""
    reductions = _contract_reductions(ctx) if bugs.dh_reductions is None else bugs.dh_reductions
    u = _Linear.apply(_gathered_hidden(h, ctx, reductions), W, b, _HeadBackward(labels, ctx, bugs))
    if b is not None and bugs.bias_on_label:
        local = labels - ctx.vocab_start
        owned = ((local >= 0) & (local < u.shape[1])).nonzero().squeeze(-1)
        u = u + torch.zeros_like(u).index_put((owned, local[owned]), b[local[owned]])
    return u.to(ctx.dtype)


def _head(h, W, b, labels, ctx, **switches):
    return correct_loss(head_logits(h, W, b, labels, ctx, HeadBugs(**switches)), labels, ctx)


def correct(h, W, b, labels, ctx):
    """The head, then the case's kind's correct vocab-parallel loss (per-token losses [rows], or the policy kind's
    Reduced)."""
    return _head(h, W, b, labels, ctx)


def head_dh_shard_partial(h, W, b, labels, ctx):
    """dh of the rank's vocabulary shard never summed over TP (Apple ml-cross-entropy #42, b616b22); under sequence
    parallelism the rank's token shard of its own partial (a scatter in place of the reduce-scatter)."""
    return _head(h, W, b, labels, ctx, dh_reductions=0)


def head_dh_double_reduce(h, W, b, labels, ctx):
    """dh summed over TP by the head and once more (Apple ml-cross-entropy #42): x TP under the head's contract,
    whole instead of partial under the framework's; under sequence parallelism an all-reduce before the
    reduce-scatter."""
    return _head(h, W, b, labels, ctx, dh_reductions=_contract_reductions(ctx) + 1)


def head_dw_16bit_accumulate(h, W, b, labels, ctx):
    """dW and db accumulated across the head's chunks in the 16-bit dtype (axolotl #1601; Liger-Kernel #830, whose
    `accum_dtype` fixed it; OLMo-core #370)."""
    return _head(h, W, b, labels, ctx, dw_16bit_accumulate=True)


def head_grad_output_first(h, W, b, labels, ctx):
    """Reduction none: dW and db take the first valid token's upstream weight for every token (Liger-Kernel #1298,
    9ac26bb8; earlier #678/#680, #496); dh keeps each token's own."""
    return _head(h, W, b, labels, ctx, grad_output_first=True)


def head_target_rounded_early(h, W, b, labels, ctx):
    """The true class's gradient w p_y rounded into the 16-bit buffer before w is subtracted (Liger-Kernel #1268 ->
    #1329, be1cdc17): half a 16-bit unit of w p_y at confident rows, where the correct head carries one rounding of
    w (p_y - 1). Cross-entropy only."""
    return _head(h, W, b, labels, ctx, target_rounded_early=True)


def _with_setting(ctx, **changes):
    """ctx with the kind's settings changed where the kind has them (a fused path that drops them)."""
    kept = {key: value for key, value in changes.items() if hasattr(ctx.loss, key)}
    return dataclasses.replace(ctx, loss=ctx.loss.replace(**kept)) if kept else ctx


def head_smoothing_dropped(h, W, b, labels, ctx):
    """Label smoothing not passed through the fused path (Liger-Kernel #243 -> #244)."""
    return correct_loss(head_logits(h, W, b, labels, ctx), labels, _with_setting(ctx, label_smoothing=0.0))


def head_softcap_dropped(h, W, b, labels, ctx):
    """The softcap never applied in the fused path of a model that has one (Apple ml-cross-entropy #48 -> #50)."""
    return correct_loss(head_logits(h, W, b, labels, ctx), labels, _with_setting(ctx, softcap=0.0))


def head_bias_repeated(h, W, b, labels, ctx):
    """The bias added a second time to the target logit (Apple ml-cross-entropy #52 -> #53)."""
    return _head(h, W, b, labels, ctx, bias_on_label=True)


CATALOGUE = {
    "correct": correct,
    "head_dh_shard_partial": head_dh_shard_partial,
    "head_dh_double_reduce": head_dh_double_reduce,
    "head_dw_16bit_accumulate": head_dw_16bit_accumulate,
    "head_grad_output_first": head_grad_output_first,
    "head_target_rounded_early": head_target_rounded_early,
    "head_smoothing_dropped": head_smoothing_dropped,
    "head_softcap_dropped": head_softcap_dropped,
    "head_bias_repeated": head_bias_repeated,
}
