"""An LM head case on one rank (../docs/pytorch.md, "An LM head"): fn(h, W, b, labels, ctx) per micro-batch.

h is the micro-batch's hidden states, a leaf of the case's dtype that requires grad; W and b are the rank's
vocabulary shard of the weight and bias, float32 leaves that hold the dtype's values exactly (a master weight, as
mixed-precision trainers keep it), shared by the step's micro-batches, so that autograd accumulates dW and db over
them in float32 as a trainer's main gradient does. fn returns what a logits loss returns (per-token losses or
Reduced). The dump holds h, W and b as exported, dh = h.grad of each micro-batch, and dW and db rounded once to the
dtype; check-dump judges them.

Under sequence parallelism with the head's dh contract (layout.sp, dh_reduce "head") h arrives token-sharded over TP:
each rank gets its shard of the micro-batch's rows (sequence_parallel_slots: ceil(rows / TP) rows, zeros past the
last row), all-gathers it itself and reduce-scatters its dh back, so h.grad holds its shard's rows. A dump's dh is per
row of the micro-batch, so the harness all-gathers the shards' h.grad over TP for it: every TP rank's dump holds the
group's dh, each row as the rank holding it returned it. Under dh_reduce "framework" the framework's linear gathers h
before the head and reduce-scatters dh after it, so the head gets every row, as without sequence parallelism.
"""

import torch
import torch.distributed as dist

from lossverify.kinds import kind_inputs
from lossverify.torch._worker import (UserCodeError, _StepLog, _context, _dump_writer, _micro_batches,
                                      _report_changed_labels, _report_changed_micro_batches, _user_traceback)
from lossverify.torch.context import FrameworkConfig, LossConfig
from lossverify.torch.kinds import harness_kind
from lossverify.layout import framework_factor, sequence_parallel_slots
from lossverify.dump import _describe_change


def _shard_leaves(rank_inputs, device):
    """The rank's W (and b) as exported, and float32 leaves of the same values that require grad."""
    exported = {name: t.to(device, copy=True) for name, t in rank_inputs.shard().items()}
    # fresh copies for every job: a float32 export is not copied by .float(), and its grad would carry over
    leaves = {name: t.to(torch.float32, copy=True).requires_grad_(True) for name, t in exported.items()}
    return exported, leaves


def head_shards_tokens(inputs):
    """Whether each TP rank gets its token shard of h (sequence parallelism under the head's dh contract)."""
    return inputs.layout.sp and inputs.head.get("dh_reduce", "head") == "head"


def _token_shard(rows, tp, tp_rank):
    """The rank's token shard of a micro-batch's h [rows, H] (sequence_parallel_slots; zero rows on the padding)."""
    slots = torch.tensor(sequence_parallel_slots(rows.shape[0], tp, tp_rank), dtype=torch.int64, device=rows.device)
    shard = torch.zeros((slots.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    held = slots >= 0
    shard[held] = rows[slots[held]]
    return shard


def _gathered_rows(shard_grad, rows, group):
    """The TP group's dh of every row of the micro-batch: each rank's shard of it, all-gathered, the padding dropped."""
    raw = shard_grad.detach().contiguous().view(torch.uint8)  # as bytes: gloo gathers no 16-bit floats
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, raw, group=group)
    return torch.cat(parts).view(shard_grad.dtype)[:rows]


def run_head_job(job, fn, me):
    inputs, rank_inputs = me.inputs, me.rank_inputs
    loss = LossConfig.from_case(inputs.case["loss"])
    framework = FrameworkConfig(**inputs.framework)
    factor = framework_factor(inputs.layout, framework.grad_reduce, framework.ga_reduce)
    writer = _dump_writer(job, inputs)
    rank_dump = writer.rank(rank_inputs.tp, rank_inputs.cp, rank_inputs.dp, vocab=rank_inputs.vocab)
    micro_batches, hidden = _micro_batches(inputs, rank_inputs, me.device)
    exported_shard, leaves = _shard_leaves(rank_inputs, me.device)
    rank_dump.head_shard(**exported_shard)
    weight, bias = leaves["W"], leaves.get("b")
    step = _StepLog(loss, factor, me.num_valid)
    sharded = head_shards_tokens(inputs)
    state = {}
    for k, mb in enumerate(micro_batches):
        exported = rank_inputs.micro_batch(k)
        rows = hidden[k]
        leaf = (_token_shard(rows, inputs.layout.tp, rank_inputs.tp) if sharded else rows.clone()).requires_grad_(True)
        labels = mb.labels.clone()
        handed = labels.clone()
        dump_mb = rank_dump.begin_micro_batch(
            exported["tokens"], h=rows, labels=exported["labels"] if kind_inputs(loss.kind).labels else None,
            loss_mask=exported["loss_mask"], teacher_logits=exported.get("teacher_logits"),
            grad_output=exported["upstream_weights"] if harness_kind(loss.kind).dumps_grad_output(loss) else None,
            **{name: exported.get(name) for name in kind_inputs(loss.kind).row_inputs})
        if mb.rows == 0:  # its TP peers hold the same (no) rows and skip it too
            dump_mb.finish(dh=torch.zeros_like(rows))
            continue
        ctx = _context(me, loss, framework, factor, micro_batches, k, state)
        try:
            result = fn(leaf, weight, bias, labels, ctx)
        except BaseException as e:  # sys.exit() in the loss function too
            raise UserCodeError(_user_traceback(e), micro_batch=k, job=job.name) from None
        objective, token_loss, per_token = step.add(result, job.returns, ctx, k, job.name)
        try:
            objective.backward()
        except BaseException as e:
            raise UserCodeError("backward through the returned loss failed:\n" + _user_traceback(e),
                                micro_batch=k, job=job.name) from None
        if leaf.grad is None:
            raise UserCodeError("the returned loss does not depend on h (its .grad is None after backward)",
                                micro_batch=k, job=job.name)
        _report_changed_labels(writer, dump_mb, labels, handed, loss.kind)
        dh = _gathered_rows(leaf.grad, mb.rows, me.groups["tp"]) if sharded else leaf.grad
        dump_mb.finish(dh=dh, token_loss=token_loss, **per_token)
    _report_changed_micro_batches(writer, rank_dump, micro_batches, rank_inputs)
    _report_changed_shard(writer, rank_dump, exported_shard, leaves)
    dtype = inputs.torch_dtype
    gradients = {"d" + name: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach().to(dtype)
                 for name, leaf in leaves.items()}
    rank_dump.head_shard(**gradients)
    logged, num_tokens, statistics = step.finish(me.groups["batch"], me.device)
    rank_dump.stats(loss=logged, num_tokens=num_tokens, **statistics)
    writer.logged_loss_precision = step.logged_precision
    writer.close(group=me.control)
    return writer.modified_inputs


def _report_changed_shard(writer, rank_dump, exported, leaves):
    """W or b changed in place during the step (the dump holds the exported values)."""
    for name, leaf in leaves.items():
        change = _describe_change(name, exported[name].float(), leaf.detach())
        if change:
            writer._report_modified(f"{rank_dump.where}: {change}; the dump holds the exported values")
