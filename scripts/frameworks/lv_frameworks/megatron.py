"""Megatron-LM's `tensor_parallel.vocab_parallel_cross_entropy`, imported from a checkout.

Its module is loaded unmodified from the checkout. Only what surrounds it is stubbed, none of its math:
the package __init__ files of `megatron` and `megatron.core` (they import the whole library), and the two
modules it takes process-group helpers from, `megatron.core.parallel_state` (the default TP group; the
runs pass theirs) and `megatron.core.utils` (a group's rank and size, and torch-version probes).
"""
import inspect
import os
import sys
import types

import torch

from lv_frameworks import Run, adapt, checkout, cross_entropy_cases, git_commit, stub_megatron_core_utils

NAME = "Megatron-LM"
# Catalogued bugs a failure is compared with (judge.py: same failing checks, same loss margin).
EXPLANATIONS = ["smoothing-partition-vocab", "smoothing-log-after-exp", "full-vocab-through-tp", "mtp-local-count-ratio",
                "dp-local-mean", "microbatch-local-mean"]
_function = None
_tp_group = {"group": None}  # the current run's TP group, for the stubbed parallel_state


def _package(name, path):
    """A package whose __init__ is not run; its submodules load from `path`."""
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
    return module


def _load():
    global _function
    if _function is None:
        root = checkout()
        core = os.path.join(root, "megatron", "core")
        _package("megatron", os.path.join(root, "megatron"))
        _package("megatron.core", core)
        _package("megatron.core.tensor_parallel", os.path.join(core, "tensor_parallel"))
        # The default TP group, for a checkout whose function reads it (older ones take no tp_group): the run's.
        state = types.ModuleType("megatron.core.parallel_state")
        state.get_tensor_model_parallel_group = lambda *args, **kwargs: _tp_group["group"]
        state.get_tensor_model_parallel_rank = lambda *args, **kwargs: torch.distributed.get_rank(_tp_group["group"])
        state.get_tensor_model_parallel_world_size = (
            lambda *args, **kwargs: torch.distributed.get_world_size(_tp_group["group"]))
        sys.modules["megatron.core.parallel_state"] = state
        stub_megatron_core_utils()
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
        _function = vocab_parallel_cross_entropy
    return _function


def cross_entropy(logits, labels, label_smoothing, tp_group):
    """The checkout's vocab_parallel_cross_entropy on the run's TP group: passed as `tp_group` where the
    function takes one, else answered by the stubbed parallel_state."""
    function = _load()
    _tp_group["group"] = tp_group
    if "tp_group" in inspect.signature(function).parameters:
        return function(logits, labels, label_smoothing, tp_group=tp_group)
    return function(logits, labels, label_smoothing)


def vocab_parallel_ce(logits, labels, ctx):
    """[rows, V/TP] logits, [rows] targets: Megatron's per-token losses."""
    return cross_entropy(logits, labels, ctx.loss.label_smoothing, ctx.tp_group)


class _GatherVocab(torch.autograd.Function):
    """The TP shards gathered along the vocabulary, as `gather_output=True` / `runtime_gather_output=True`
    make Megatron's output layer do (Megatron-LM issue #7452); the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group, ctx.width = group, shard.shape[-1]
        wide = shard.float().contiguous()  # gloo gathers no bf16; the round trip through float32 is exact
        parts = [torch.empty_like(wide) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, wide, group=group)
        return torch.cat(parts, dim=-1).to(shard.dtype)

    @staticmethod
    def backward(ctx, grad):
        rank = torch.distributed.get_rank(ctx.group)
        return grad[..., rank * ctx.width:(rank + 1) * ctx.width].contiguous(), None


def gathered_logits_ce(logits, labels, ctx):
    """Megatron's GPT model with TP > 1 and gathered output logits: the whole vocabulary on every TP rank,
    passed to the vocabulary-parallel cross entropy all the same (issue #7452's first item)."""
    full = _GatherVocab.apply(logits, ctx.tp_group)
    return _load()(full, labels, ctx.loss.label_smoothing, tp_group=ctx.tp_group)


def describe(path):
    return {"commit": git_commit(path), "source": "megatron/core/tensor_parallel/cross_entropy.py"}


def _sweep_layouts(case, max_ranks=8):
    """The case's "sweep" product where V splits evenly over tp, up to `max_ranks` processes (CPU gloo)."""
    import itertools
    layout, sweep = case.get("layout", {}), case.get("sweep", {})
    axes = {k: sweep.get(k, [layout.get(k, 1)]) for k in ("tp", "cp", "dp", "ga")}
    labels = []
    for tp, cp, dp, ga in itertools.product(axes["tp"], axes["cp"], axes["dp"], axes["ga"]):
        if case["shape"]["vocab"] % tp == 0 and tp * cp * dp <= max_ranks:
            labels.append(f"tp{tp}-cp{cp}-dp{dp}-ga{ga}")
    return labels


def runs(cases):
    """Every shipped cross-entropy case at tp 1, 2 and 4 (where V splits evenly: Megatron derives a rank's
    columns from its shard width), with the case's own cp, dp and ga. Megatron has no z-loss and no softcap
    (set to 0) and smooths with the megatron convention."""
    out = []
    for name, case, loss in cross_entropy_cases(cases):
        overrides, notes = adapt(loss, without=("z_loss_weight", "softcap"), convention="megatron")
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):
            if case["shape"]["vocab"] % tp == 0:
                out.append(Run(f"{__name__}:vocab_parallel_ce", name, {"tp": tp, **rest}, overrides, ", ".join(notes)))
        if loss.get("label_smoothing", 0):  # the same case without smoothing
            for tp in (2, 4):
                if case["shape"]["vocab"] % tp == 0:
                    out.append(Run(f"{__name__}:vocab_parallel_ce", name, {"tp": tp, **rest},
                                   {**overrides, "loss.label_smoothing": 0}, ", ".join(notes + ["no smoothing"])))
        sweep = _sweep_layouts(case)
        if len(sweep) > 1:  # the case's own sweep, with the invariance check between its layouts
            out.append(Run(f"{__name__}:vocab_parallel_ce", name, {}, overrides, ", ".join(notes), sweep=sweep))
    for tp in (2, 4):  # issue #7452: gathered logits into the vocabulary-parallel cross entropy
        out.append(Run(f"{__name__}:gathered_logits_ce", "smoothing-megatron", {"tp": tp},
                       {"loss.label_smoothing": 0}, "no smoothing, logits gathered over TP first"))
    return out + _mtp_runs()


def _mtp_runs():
    """process_mtp_loss: issue #7452's per-token mode (gradients summed over DP x CP) and, for issue #3943, the
    default mode with the schedule's own scale (gradients averaged over DP x CP), on layouts that give every
    rank rows, with CP > 1 on the MTP case."""
    per_token = {"framework.grad_reduce": "sum", "framework.ga_reduce": "sum"}
    default = {"framework.grad_reduce": "avg", "framework.ga_reduce": "sum"}
    module = "lv_frameworks.megatron_mtp"
    mtp_layouts = [{"tp": 1, "cp": 1, "dp": 1, "ga": 1}, {"tp": 2, "cp": 1, "dp": 2, "ga": 2},
                   {"tp": 4, "cp": 1, "dp": 2, "ga": 2}, {"tp": 1, "cp": 2, "dp": 1, "ga": 1},
                   {"tp": 1, "cp": 2, "dp": 1, "ga": 2}, {"tp": 2, "cp": 2, "dp": 2, "ga": 2}]
    out = [Run(f"{module}:mtp_per_token_loss", "dp-unequal-tokens", layout, per_token, "per-token mode")
           for layout in ({"tp": 1, "dp": 1}, {"tp": 1, "dp": 2}, {"tp": 1, "dp": 4}, {"tp": 2, "dp": 4})]
    for function, overrides, note in (("mtp_per_token_loss", per_token, "per-token mode"),
                                      ("mtp_loss", default, "default mode, the schedule's scale")):
        out += [Run(f"{module}:{function}", "mtp-per-token-dp-unequal", layout, overrides, note)
                for layout in mtp_layouts]
    return out
