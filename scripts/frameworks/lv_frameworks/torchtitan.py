"""torchtitan's vocabulary-parallel cross entropy (`torchtitan.components.loss._LossParallelCrossEntropy`) and
its trainer's loss (`CrossEntropyLoss`: a sum over local tokens divided by the step's global valid-token
count), imported from a checkout. Needs torch >= 2.4 (functional collectives, DTensor).

The module is loaded unmodified. Stubbed around it, none of its math: the package __init__ files, the
`spmd_types` type checker (its decorator and assertions become no-ops), torchtitan's config base classes,
its logger, and the two helpers that tell the loss which SPMD backend runs and which TP group it has (the
runs' own group).
"""
import contextlib
import dataclasses
import logging
import os
import sys
import types

from lossverify.torch import Reduced
from lv_frameworks import Run, adapt, checkout, cross_entropy_cases, git_commit, stub_module as _stub
from lv_frameworks.single_gpu import package_shell

NAME = "torchtitan"
EXPLANATIONS = ["dp-local-mean", "ga-microbatch-mean", "cp-duplicated-loss"]
IGNORE_INDEX = -100  # torchtitan's, fixed
_module = None
_tp = {"group": None, "size": 1}  # what the stubbed mesh helpers answer; set per call


def _stub_imports():
    _stub("spmd_types", register_autograd_function=lambda cls: cls, assert_type=lambda *a, **k: None,
          is_type_checking=lambda: False, no_typecheck=contextlib.nullcontext, get_local_type=lambda t: {},
          S=lambda dim: ("S", dim), I="I", P="P", R="R")

    class Configurable:
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config:
            pass

    _stub("torchtitan.config", Configurable=Configurable, CompileConfig=object)
    mesh = types.SimpleNamespace(get_group=lambda name: _tp["group"])
    _stub("torchtitan.distributed.spmd_types", current_spmd_mesh=lambda: mesh,
          spmd_mesh_size=lambda name: _tp["size"] if name == "tp" else 1)
    _stub("torchtitan.distributed.utils", get_spmd_backend=lambda: "spmd_types")
    _stub("torchtitan.tools.logging", logger=logging.getLogger("torchtitan"))


def _load():
    global _module
    if _module is None:
        root = os.path.join(checkout(), "torchtitan")
        for package in ("", ".components", ".distributed", ".tools"):
            package_shell("torchtitan" + package, os.path.join(root, *package.split(".")[1:]))
        _stub_imports()
        from torchtitan.components import loss
        _module = loss
    return _module


def loss_parallel_per_token(logits, labels, ctx):
    """The kernel: `_LossParallelCrossEntropy.apply(logits.float(), labels, tp_group, V, "none")`, the
    per-token NLL its GRPO path takes."""
    return _load()._LossParallelCrossEntropy.apply(logits.float(), labels, ctx.tp_group, ctx.vocab_size, "none")


def trainer_loss(logits, labels, ctx):
    """The trainer's step: CrossEntropyLoss(pred, labels, global_valid_tokens), the local sum over the step's
    valid-token count (labels != -100 of every micro-batch, summed over the batch mesh); FSDP's gradient
    division is off, so the gradients are summed over DP x CP (the runs set grad_reduce sum)."""
    loss = _load()
    _tp["group"], _tp["size"] = ctx.tp_group, ctx.tp_size
    ce = loss.CrossEntropyLoss(loss.CrossEntropyLoss.Config(global_vocab_size=ctx.vocab_size))
    value, _ = ce(logits, labels, global_valid_tokens=ctx.num_valid_tokens)
    return Reduced(value)


def describe(path):
    return {"commit": git_commit(path), "source": "torchtitan/components/loss.py"}


def _same_shards(vocab, tp):
    """torchtitan's columns (ceil(V/TP) per rank, the last rank fewer) equal lossverify's
    (r floor(V/TP) + min(r, V mod TP)) on every rank."""
    chunk = -(-vocab // tp)
    ours = [r * (vocab // tp) + min(r, vocab % tp) for r in range(tp + 1)]
    theirs = [min(vocab, chunk * r) for r in range(tp + 1)]
    return ours == theirs


def runs(cases):
    """Every shipped cross-entropy case at tp 1, 2 and 4 where torchtitan's shards are lossverify's, with the
    case's cp, dp and ga; no smoothing, z-loss or softcap (torchtitan has none), ignore_index -100. The
    per-token kernel everywhere; the trainer's loss on the mean-reduced cases, with torchtitan's framework
    model (gradients summed over DP x CP and micro-batches)."""
    out = []
    for name, case, loss in cross_entropy_cases(cases):
        overrides, notes = adapt(loss, without=("z_loss_weight", "softcap"))
        if loss.get("label_smoothing", 0):
            overrides["loss.label_smoothing"] = 0
            notes.append("no smoothing")
        if loss.get("ignore_index", IGNORE_INDEX) != IGNORE_INDEX:
            overrides["loss.ignore_index"] = IGNORE_INDEX
            notes.append("ignore_index -100")
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):
            if not _same_shards(case["shape"]["vocab"], tp):
                continue
            out.append(Run(f"{__name__}:loss_parallel_per_token", name, {"tp": tp, **rest}, overrides,
                           ", ".join(notes)))
            if loss.get("reduction", "mean") == "mean":
                trainer = {**overrides, "framework.grad_reduce": "sum", "framework.ga_reduce": "sum"}
                out.append(Run(f"{__name__}:trainer_loss", name, {"tp": tp, **rest}, trainer,
                               ", ".join(notes + ["gradients summed"])))
    return out
