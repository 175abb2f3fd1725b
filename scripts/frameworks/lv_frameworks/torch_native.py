"""`torch.nn.functional.cross_entropy` in a DDP-style training loop: per-token losses, and the loop most
scripts write, a micro-batch mean divided by the accumulation steps whose gradients DDP averages over DP.

CHECKOUT is the installed torch package's folder (the torch the ranks import is the one on the path; the
folder only names what was judged). Whole rows only (tp = 1); the logits are upcast to float32 first, as
training loops do.
"""
import torch
import torch.nn.functional as F

from lossverify.torch import Reduced
from lv_frameworks import Run, adapt, cross_entropy_cases

NAME = "PyTorch"
EXPLANATIONS = ["dp-local-mean", "ga-microbatch-mean", "microbatch-local-mean"]


def _cross_entropy(logits, labels, ctx, reduction):
    return F.cross_entropy(logits.float(), labels, ignore_index=ctx.loss.ignore_index, reduction=reduction,
                           label_smoothing=ctx.loss.label_smoothing)


def per_token(logits, labels, ctx):
    """The kernel: F.cross_entropy(reduction="none")."""
    return _cross_entropy(logits, labels, ctx, "none")


def ddp_microbatch_mean(logits, labels, ctx):
    """The loop: loss = F.cross_entropy(reduction="mean") / grad_accum_steps; loss.backward(); DDP averages
    the gradients over DP x CP (the harness applies that average as the case's framework model)."""
    loss = _cross_entropy(logits, labels, ctx, "mean") / ctx.ga
    return Reduced(loss, token_loss=_cross_entropy(logits, labels, ctx, "none").detach())


def describe(path):
    return {"commit": f"torch {torch.__version__}", "source": "torch.nn.functional.cross_entropy"}


def runs(cases):
    """Every shipped cross-entropy case at tp 1 with its own cp, dp and ga: the per-token kernel, and the
    DDP-style loop on the cases split over ranks or micro-batches whose framework is DDP's (gradients
    averaged over DP x CP, micro-batches summed)."""
    out = []
    for name, case, loss in cross_entropy_cases(cases):
        overrides, notes = adapt(loss, without=("z_loss_weight", "softcap"), convention="pytorch")
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        out.append(Run(f"{__name__}:per_token", name, {"tp": 1, **rest}, overrides, ", ".join(notes)))
        framework = case.get("framework", {})
        ddp = framework.get("grad_reduce", "avg") == "avg" and framework.get("ga_reduce", "sum") == "sum"
        if rest and ddp and loss.get("reduction", "mean") == "mean":
            out.append(Run(f"{__name__}:ddp_microbatch_mean", name, {"tp": 1, **rest}, overrides,
                           ", ".join(notes + ["micro-batch mean / GA, DDP average"])))
    return out
