"""NeMo Automodel's knowledge-distillation loss (`nemo_automodel.components.loss.kd_loss.KDLoss`), imported
from a checkout, at tp 1, 2 and 4, with the normalisation its KD recipe (recipes/llm/kd.py) gives it.

The module is loaded unmodified; only the package __init__ files above it are skipped (they import the rest
of the library). KDLoss takes plain local shards and an explicit `tp_group`, as its TP path documents.
"""
import os

import torch

from lossverify.torch import Reduced
from lv_frameworks import Run, checkout, git_commit
from lv_frameworks.single_gpu import package_shell

NAME = "NeMo Automodel"
EXPLANATIONS = ["kd-tp-grad-sum", "kd-untracked-allreduce", "kd-local-softmax", "kd-no-t2", "kd-double-t2"]
_class = None


def _load():
    global _class
    if _class is None:
        root = os.path.join(checkout(), "nemo_automodel")
        package_shell("nemo_automodel", root)
        package_shell("nemo_automodel.components", os.path.join(root, "components"))
        package_shell("nemo_automodel.components.loss", os.path.join(root, "components", "loss"))
        from nemo_automodel.components.loss.kd_loss import KDLoss
        _class = KDLoss
    return _class


def kd_loss(logits, labels, ctx):
    """The recipe's student step with kd_ratio 1: KDLoss(student, teacher, labels, num_batch_labels) times the
    DP group size, back-propagated; FSDP then averages the gradients over DP (the case's framework model)."""
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    loss_fn = _load()(ignore_index=ctx.loss.ignore_index, temperature=ctx.loss.temperature, tp_group=tp_group)
    count = ctx.num_valid_tokens  # the recipe's num_label_tokens: valid labels of the step, summed over DP
    # KDLoss reads labels only to mask tokens. lossverify's KD counts the tokens of its loss mask, the last
    # position of a sequence included (a next-token data loader gives it no label): pass that mask.
    mask_labels = torch.where(ctx.loss_mask, 0, ctx.loss.ignore_index)
    loss = loss_fn(logits, ctx.teacher_logits, mask_labels, num_batch_labels=count)
    return Reduced(loss * ctx.dp_size * ctx.cp_size, num_tokens=count)


def describe(path):
    return {"commit": git_commit(path), "source": "nemo_automodel/components/loss/kd_loss.py"}


def runs(cases):
    """The shipped KD cases at tp 1, 2 and 4 with their own dp and ga (T^2 scaling on, as KDLoss always
    applies it). KD in the recipe has no context parallelism."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "kd" or not loss.get("t2_scaling", True):
            continue
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):
            if case["shape"]["vocab"] % tp == 0:
                out.append(Run(f"{__name__}:kd_loss", name, {"tp": tp, **rest}))
    return out
