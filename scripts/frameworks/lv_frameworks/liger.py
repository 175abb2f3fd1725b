"""Liger-Kernel's cross entropy (`liger_kernel.transformers.functional.liger_cross_entropy`, Triton), imported
from a checkout's src/ as its users import it; one rank on one GPU (whole rows)."""
import os
import sys

from lv_frameworks import checkout, git_commit
from lv_frameworks.single_gpu import single_rank_runs

NAME = "Liger-Kernel"
EXPLANATIONS = []
_function = None


def _load():
    global _function
    if _function is None:
        sys.path.insert(0, os.path.join(checkout(), "src"))
        from liger_kernel.transformers.functional import liger_cross_entropy
        _function = liger_cross_entropy
    return _function


def cross_entropy(logits, labels, ctx):
    """Per-token losses (reduction "none"), with smoothing, z-loss (lse_square_scale) and softcap."""
    return _load()(logits, labels, ignore_index=ctx.loss.ignore_index, reduction="none",
                   label_smoothing=ctx.loss.label_smoothing, lse_square_scale=ctx.loss.z_loss_weight,
                   softcap=ctx.loss.softcap or None)


def describe(path):
    return {"commit": git_commit(path), "source": "src/liger_kernel/ops/cross_entropy.py"}


def runs(cases):
    def supports(loss):  # Liger smooths with the pytorch convention
        if loss.get("label_smoothing", 0) and loss.get("smoothing_convention", "pytorch") != "pytorch":
            return {"loss.smoothing_convention": "pytorch"}, ["pytorch convention"]
        return {}, []
    return single_rank_runs(__name__, "cross_entropy", cases, supports)
