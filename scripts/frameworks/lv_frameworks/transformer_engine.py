"""TransformerEngine's `parallel_cross_entropy` (Triton), loaded from a checkout: its three cross-entropy
files, unmodified. Only the package __init__ files around them are skipped (they load TE's compiled
library, which the loss does not use). tp 1 and 2 on one GPU: the two ranks of tp 2 share it over gloo.

`cross_entropy_z_loss` is for a checkout whose function takes `z_loss_weight` (PR #2707's head): every
cross-entropy case with z-loss on (its own weight, or 1e-4 where it has none)."""
import os

from lv_frameworks import Run, adapt, checkout, git_commit
from lv_frameworks.single_gpu import package_shell, single_rank_runs

NAME = "TransformerEngine"
EXPLANATIONS = ["smoothing-local-sum", "grad-rounded-early"]
_function = None


def _load():
    global _function
    if _function is None:
        root = os.path.join(checkout(), "transformer_engine")
        for name, path in (("transformer_engine", root), ("transformer_engine.pytorch", os.path.join(root, "pytorch")),
                           ("transformer_engine.pytorch.triton", os.path.join(root, "pytorch", "triton")),
                           ("transformer_engine.common", os.path.join(root, "common")),
                           ("transformer_engine.common.triton", os.path.join(root, "common", "triton"))):
            package_shell(name, path)
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
        _function = parallel_cross_entropy
    return _function


def cross_entropy(logits, labels, ctx):
    """(B, SQ, V/TP) logits and (B, SQ) targets; float32 per-token losses back (reduce_loss False)."""
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    loss = _load()(logits.unsqueeze(0), labels.unsqueeze(0), ctx.loss.label_smoothing, False, tp_group,
                   ctx.loss.ignore_index)
    return loss.squeeze(0)


def cross_entropy_z_loss(logits, labels, ctx):
    """As `cross_entropy`, with the case's z-loss weight passed as `z_loss_weight` (PR #2707)."""
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    loss = _load()(logits.unsqueeze(0), labels.unsqueeze(0), ctx.loss.label_smoothing, False, tp_group,
                   ctx.loss.ignore_index, z_loss_weight=ctx.loss.z_loss_weight)
    return loss.squeeze(0)


def describe(path):
    return {"commit": git_commit(path), "source": "transformer_engine/pytorch/cross_entropy.py (+ triton/)"}


def runs(cases):
    def supports(loss):  # no z-loss, no softcap; the pytorch smoothing convention
        return adapt(loss, without=("z_loss_weight", "softcap"), convention="pytorch")
    out = single_rank_runs(__name__, "cross_entropy", cases, supports)
    # tp = 2: the TP path no one else judges (TE's own tests pass no process group). Even shards only (TE
    # takes a rank's columns as rank * width); on one GPU the two ranks share it over gloo (--backend gloo).
    for run in list(out):
        if cases[run.case]["shape"]["vocab"] % 2 == 0:
            out.append(Run(run.function, run.case, {**run.layout, "tp": 2}, run.overrides, run.note))
    return out + _z_loss_runs(cases)


def _z_loss_runs(cases):
    """PR #2707: each cross-entropy case with z-loss on, at tp 1 and (even V) tp 2; at tp 2 a smoothed case
    also without smoothing, which main's TP path gets wrong (`smoothing-local-sum`)."""
    def supports(loss):
        overrides, notes = adapt(loss, without=("softcap",), convention="pytorch")
        if not loss.get("z_loss_weight", 0):
            overrides["loss.z_loss_weight"] = 1e-4
            notes.append("z-loss 1e-4")
        return overrides, notes
    out = single_rank_runs(__name__, "cross_entropy_z_loss", cases, supports)
    for run in list(out):
        if cases[run.case]["shape"]["vocab"] % 2:
            continue
        out.append(Run(run.function, run.case, {**run.layout, "tp": 2}, run.overrides, run.note))
        if cases[run.case].get("loss", {}).get("label_smoothing", 0):
            out.append(Run(run.function, run.case, {**run.layout, "tp": 2}, {**run.overrides, "loss.label_smoothing": 0},
                           ", ".join(filter(None, [run.note, "no smoothing"]))))
    return out
