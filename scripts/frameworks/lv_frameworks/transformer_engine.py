"""TransformerEngine's `parallel_cross_entropy` (Triton), loaded from a checkout: its three cross-entropy
files, unmodified. Only the package __init__ files around them are skipped (they load TE's compiled
library, which the loss does not use). tp 1 and 2 on one GPU: the two ranks of tp 2 share it over gloo."""
import os

from lv_frameworks import Run, adapt, checkout, git_commit
from lv_frameworks.single_gpu import package_shell, single_rank_runs

NAME = "TransformerEngine"
EXPLANATIONS = ["smoothing-local-sum"]
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
    return out
