"""Apple's Cut Cross-Entropy (`cut_cross_entropy.linear_cross_entropy(e, c, targets, bias=, ignore_index=, softcap=,
reduction=, shift=, return_lse=, impl=, vocab_parallel_options=)`) on lossverify's LM-head cases (`head-ce-*`),
imported from a checkout as its users import it.

Judged: its PyTorch implementation (impl "torch_compile", cut_cross_entropy/torch_compile.py: `e @ c.T` in the
inputs' dtype, plus the bias, softcapped, then `F.cross_entropy(logits.float(), ...)` on the valid rows), its
vocabulary-parallel variant (`VocabParallelOptions(start, stop, group, reduce_e_grad)`,
vocab_parallel/vocab_parallel_torch_compile.py: per-shard log-sum-exp and target logit, all-reduced; the option
`reduce_e_grad` decides whether it all-reduces dh over the group itself, "typically true, but some frameworks may
require setting this to false"), and, on a GPU only, its Triton kernel (impl "cce" and the presets "cce_exact" and
"cce_kahan_full_c", cut_cross_entropy/cce.py), with and without vocabulary parallelism. The z-loss is CCE's own:
`return_lse=True` and `cut_cross_entropy.utils.compute_z_loss(lse, targets, ignore_index=, reduction=)` added with
the case's weight, as its README shows.

The model side written out here: c = W.to(ctx.dtype) and bias = b.to(ctx.dtype) (the model's output layer in its
dtype: e and c must share one), e = h, targets = the micro-batch's labels with the case's ignore_index (CCE's
default -100), shift 0 (lossverify's labels are already next-token labels). Vocab-parallel: start and stop are the
rank's columns [ctx.vocab_start, ctx.vocab_end), group ctx.tp_group; reduce_e_grad=True is the head's dh contract
(dh_reduce "head"), False the framework's ("framework"); each is also run under the other contract, where it must
fail as head-dh-double-reduce or head-dh-shard-partial. CCE has no sequence-parallel gather: a case under sequence
parallelism runs with the framework's contract (the framework's linear gathers h and reduce-scatters dh, and CCE
must not reduce dh: reduce_e_grad=False) or without sequence parallelism. CCE is a library with no trainer: reduction
"none" returns the per-token losses (the harness reduces them: 1/N_v, or the upstream weights g_t), and "sum" and
"mean" are normalised as a caller must (`sum / N_v / framework_factor`; `mean * n_local / N_v / framework_factor`).

Loaded unmodified. Stubbed, none of their math, only on a CPU without Triton (torch < 2): the package's __init__ is
not run (it imports the Triton kernel's module), `cut_cross_entropy.cce` (the Triton kernel's module: the torch path
never calls it) stands in with `cce_linear_cross_entropy = None`, and, where torch has no `torch.compile` (torch
1.13), `torch.compile` is an identity decorator: the functions it decorates (the torch path, softcapping,
compute_z_loss, the vocab-parallel reductions) run as the same Python, eagerly, not compiled. The decorator is not
the only obstacle on torch 1.13: `_build_flat_valids` returns the valid rows as int32 and torch < 2 indexes with
int64 only (`e[valids]` raises IndexError), so there its result, the same row numbers, is widened to int64 by a
wrapper around it (`_widen_indices`); its code and everything after it run unchanged. On a machine with torch >= 2
nothing is stubbed or wrapped (with Triton, the package is imported whole), and torch.compile compiles.
"""
import os
import sys

import torch

from lossverify.torch import Reduced
from lv_frameworks import (Run, adapt, checkout, git_commit, head_cross_entropy_cases, head_overrides, stub_module,
                           triton_gpu, with_fp32)
from lv_frameworks.single_gpu import package_shell

NAME = "Apple Cut Cross-Entropy"
EXPLANATIONS = ["head-dh-shard-partial", "head-dh-double-reduce", "head-dw-16bit-accumulate",
                "head-target-rounded-early", "head-bias-repeated", "head-softcap-dropped",
                "head-grad-output-first", "head-smoothing-dropped"]
STUBS = ["cut_cross_entropy: package shell (its __init__ not run; CPU only)",
         "cut_cross_entropy.cce: cce_linear_cross_entropy = None (the Triton kernel's module; CPU only)",
         "torch.compile: identity decorator (torch < 2 only; the decorated functions run eagerly)",
         "cut_cross_entropy.torch_compile._build_flat_valids: its int32 row indices widened to int64 (torch < 2 only)"]
_api = {}


def _identity_compile(fn=None, **kwargs):
    """torch.compile where torch has none: the function itself (the same math, not compiled)."""
    return fn if fn is not None else (lambda f: f)


def _widen_indices():
    """torch < 2 indexes tensors with int64 (or bool) indices only, and CCE's `_build_flat_valids` returns the
    valid rows as int32 (`.to(torch.int32)`), which `e[valids]` and `handle_reduction_none` index with: its result,
    the same row numbers, is widened to int64. Its own code runs unchanged; torch >= 2 needs nothing."""
    import cut_cross_entropy.torch_compile as module
    build = module._build_flat_valids

    def widened(*args):
        valids = build(*args)
        return valids.long() if valids is not None else None
    module._build_flat_valids = widened


def _load():
    if not _api:
        root = checkout()
        if root not in sys.path:
            sys.path.insert(0, root)
        try:
            import triton  # noqa: F401
            have_triton = True
        except ImportError:
            have_triton = False
        if not hasattr(torch, "compile"):
            torch.compile = _identity_compile
        if not have_triton:
            package_shell("cut_cross_entropy", os.path.join(root, "cut_cross_entropy"))
            stub_module("cut_cross_entropy.cce", cce_linear_cross_entropy=None)
        from cut_cross_entropy.linear_cross_entropy import linear_cross_entropy
        if int(torch.__version__.split(".")[0]) < 2:
            _widen_indices()
        from cut_cross_entropy.utils import compute_z_loss
        from cut_cross_entropy.vocab_parallel import VocabParallelOptions
        _api.update(lce=linear_cross_entropy, z=compute_z_loss, vp=VocabParallelOptions, triton=have_triton)
    return _api


def _call(h, W, b, labels, ctx, impl, reduction, vp=None):
    """linear_cross_entropy on the model's weight (and bias) in the case's dtype; with the case's z-loss through
    return_lse and compute_z_loss."""
    api = _load()
    z_weight = ctx.loss.z_loss_weight
    bias = b.to(ctx.dtype) if b is not None else None
    out = api["lce"](h, W.to(ctx.dtype), labels, bias=bias, ignore_index=ctx.loss.ignore_index,
                     softcap=ctx.loss.softcap or None, reduction=reduction, shift=0, return_lse=bool(z_weight),
                     impl=impl, vocab_parallel_options=vp)
    if not z_weight:
        return out
    loss, lse = out
    return loss + z_weight * api["z"](lse, labels, ignore_index=ctx.loss.ignore_index, reduction=reduction)


def _options(ctx, reduce_e_grad):
    return _load()["vp"](ctx.vocab_start, ctx.vocab_end, group=ctx.tp_group, reduce_e_grad=reduce_e_grad)


def _per_token(impl):
    def fn(h, W, b, labels, ctx):
        return _call(h, W, b, labels, ctx, impl, "none")
    fn.__doc__ = f'impl "{impl}", reduction "none": the per-token losses (the harness applies 1/N_v or g_t).'
    return fn


def _summed(impl):
    def fn(h, W, b, labels, ctx):
        return Reduced(_call(h, W, b, labels, ctx, impl, "sum") / ctx.num_valid_tokens / ctx.framework_factor)
    fn.__doc__ = f'impl "{impl}", reduction "sum", over the step\'s N_v (a caller\'s token mean).'
    return fn


def _averaged(impl):
    def fn(h, W, b, labels, ctx):
        local = (labels != ctx.loss.ignore_index).sum()
        value = _call(h, W, b, labels, ctx, impl, "mean")
        return Reduced(value * local / ctx.num_valid_tokens / ctx.framework_factor)
    fn.__doc__ = f'impl "{impl}", reduction "mean" (over the micro-batch), times its count over N_v.'
    return fn


def _vocab_parallel(impl, reduce_e_grad):
    def fn(h, W, b, labels, ctx):
        return _call(h, W, b, labels, ctx, impl, "none", vp=_options(ctx, reduce_e_grad))
    fn.__doc__ = (f'impl "{impl}" with VocabParallelOptions(vocab_start, vocab_end, tp_group, '
                  f'reduce_e_grad={reduce_e_grad}), reduction "none".')
    return fn


# The PyTorch implementation (CPU and GPU).
torch_none = _per_token("torch_compile")
torch_sum = _summed("torch_compile")
torch_mean = _averaged("torch_compile")
torch_vp_reduce_dh = _vocab_parallel("torch_compile", True)
torch_vp_local_dh = _vocab_parallel("torch_compile", False)
# The Triton kernel (GPU only).
cce_none = _per_token("cce")
cce_sum = _summed("cce")
cce_exact_none = _per_token("cce_exact")
cce_kahan_full_c_none = _per_token("cce_kahan_full_c")
cce_vp_reduce_dh = _vocab_parallel("cce", True)
cce_vp_local_dh = _vocab_parallel("cce", False)

TORCH = ("torch_none", "torch_sum", "torch_mean")
TRITON = ("cce_none", "cce_sum", "cce_exact_none", "cce_kahan_full_c_none")


def describe(path):
    return {"commit": git_commit(path),
            "source": "cut_cross_entropy/linear_cross_entropy.py, torch_compile.py, vocab_parallel/, cce.py"}


def runs(cases):
    """Every shipped cross-entropy LM-head case. Label smoothing turned off (CCE has none); ignore_index the
    case's; bias, softcap and z-loss kept. At tp 1 (cp, dp, ga the case's, no sequence parallelism): reduction none
    on every case, sum and mean on the token-mean cases, in the case's dtype and, for a bf16 case, fp32 too.
    Vocabulary-parallel at tp 2 and 4 (cp, dp, ga the case's) with reduce_e_grad True and False, each under both dh
    contracts; a sequence-parallel case also with sp under the framework's contract. The Triton functions only where
    Triton and a GPU are present."""
    out = []
    functions = TORCH + (TRITON if triton_gpu() else ())
    vocab_parallel = ("torch_vp_reduce_dh", "torch_vp_local_dh") + (
        ("cce_vp_reduce_dh", "cce_vp_local_dh") if triton_gpu() else ())
    for name, case, loss in head_cross_entropy_cases(cases):
        stage = case.get("stage", {})
        overrides, notes = adapt(loss, without=("label_smoothing",))
        layout = case.get("layout", {})
        rest = {k: layout.get(k, 1) for k in ("cp", "dp", "ga")}
        upstream = "upstream_weights" in loss
        tp1, tp1_notes = head_overrides(case, loss, without=("label_smoothing",), sp=False)
        for these, said in with_fp32(case, tp1, tp1_notes):
            for function in functions:
                if upstream and not function.endswith("_none"):
                    continue  # upstream weights: reduction none only
                out.append(Run(f"{__name__}:{function}", name, {"tp": 1, **rest}, these, said))
        own = stage.get("dh_reduce", "head")
        for tp in (2, 4):
            for contract in (own, "framework" if own == "head" else "head"):
                for sp in ((False, True) if layout.get("sp") else (False,)):
                    if sp and contract == "head":
                        continue  # CCE does not gather a token-sharded h
                    these, said = dict(overrides), list(notes)
                    if contract != own:
                        these["stage.dh_reduce"] = contract
                        said.append(f"dh_reduce {contract}")
                    if layout.get("sp") and not sp:
                        these["layout.sp"] = False
                        said.append("no sequence parallelism")
                    for function in vocab_parallel:
                        out.append(Run(f"{__name__}:{function}", name, {"tp": tp, **rest}, these, ", ".join(said)))
    return out
