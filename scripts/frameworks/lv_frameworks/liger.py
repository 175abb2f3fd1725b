"""Liger-Kernel's cross entropy (`liger_kernel.transformers.functional.liger_cross_entropy`, Triton, whole rows
on one rank) and its vocabulary-parallel cross entropy (`LigerVocabParallelCrossEntropy`, tp 1 and 2, both
smoothing formulas and modes), imported from a checkout's src/ as its users import them. On one GPU the two
ranks of tp 2 share it over gloo (--backend gloo)."""
import os
import sys

from lv_frameworks import Run, adapt, checkout, cross_entropy_cases, git_commit
from lv_frameworks.single_gpu import single_rank_runs

NAME = "Liger-Kernel"
EXPLANATIONS = ["smoothing-partition-vocab", "smoothing-log-after-exp", "grad-rounded-early"]
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


def _vocab_parallel(logits, labels, ctx, mode):
    sys.path.insert(0, os.path.join(checkout(), "src"))
    from liger_kernel.transformers import LigerVocabParallelCrossEntropy
    ce = LigerVocabParallelCrossEntropy(ignore_index=ctx.loss.ignore_index, label_smoothing=ctx.loss.label_smoothing,
                                        label_smoothing_formula=ctx.loss.smoothing_convention,
                                        label_smoothing_mode=mode)
    # [S, B, V_local] logits and [S, B] global targets: the rows as S, a batch of one
    return ce(logits.unsqueeze(1), labels.unsqueeze(1), tp_group=ctx.tp_group).squeeze(1)


def vocab_parallel_global(logits, labels, ctx):
    """label_smoothing_mode "global" (the default): H(u, p) averaged over the whole vocabulary."""
    return _vocab_parallel(logits, labels, ctx, "global")


def vocab_parallel_partition(logits, labels, ctx):
    """label_smoothing_mode "partition": H(u, p) averaged over each rank's shard, documented as
    mirroring Megatron's behaviour."""
    return _vocab_parallel(logits, labels, ctx, "partition")


def describe(path):
    return {"commit": git_commit(path), "source": "src/liger_kernel/ops/cross_entropy.py"}


def runs(cases):
    def supports(loss):  # Liger smooths with the pytorch convention
        return adapt(loss, convention="pytorch")
    out = single_rank_runs(__name__, "cross_entropy", cases, supports)
    for name, case, loss in cross_entropy_cases(cases):  # the vocabulary-parallel module: z-loss and softcap off
        if case["shape"]["vocab"] % 2:
            continue
        overrides, _ = adapt(loss, without=("z_loss_weight", "softcap"))
        ga = case.get("layout", {}).get("ga", 1)
        for tp in (1, 2):
            layout = {"tp": tp, "cp": 1, "dp": 1, "ga": ga}
            out.append(Run(f"{__name__}:vocab_parallel_global", name, layout, overrides, "global mode"))
            if loss.get("label_smoothing", 0) and tp > 1:
                out.append(Run(f"{__name__}:vocab_parallel_partition", name, layout, overrides, "partition mode"))
    return out
