"""torchtitan's RL log-prob pass (`torchtitan.components.loss.compute_logprobs`) and its RL experiment's
DAPO/GRPO loss (`torchtitan.experiments.rl.losses.dapo.DAPOLoss`; GRPOLoss is DAPOLoss with equal clips),
imported from a checkout, at tp 1, 2 and 4 where torchtitan's vocabulary shards are lossverify's. Needs
torch >= 2.4 (DTensor, functional collectives).

compute_logprobs has two TP paths: logits as a DTensor sharded on the vocabulary (the `partial_dtensor`
SPMD backend: `redistribute` to Replicate, then `.to_local()`), and plain local shards under the
`spmd_types` backend (`spmd.redistribute(src=S(-1), dst=I)`, the fix of #3827, which needs the real
`spmd_types` package: its runs are listed only where it is installed). The catalogue entry
`rl-logprob-allgather-grad-sum` (#3827) was the spmd_types path with dst=R.

The modules are loaded unmodified. Stubbed around them, none of their math: the package __init__ files,
`spmd_types` where it is not installed (type-checker no-ops, as in lv_frameworks/torchtitan.py),
torchtitan's config base classes, its logger, and the helpers that tell the loss which SPMD backend runs
and which TP group it has (the runs' own group). For the DTensor path the adapter wraps the rank's shard
as a DTensor on a one-dimensional TP mesh built from the run's TP group (DeviceMesh.from_group).

What the adapter does around DAPOLoss, as the RL trainer (experiments/rl/actors/trainer.py) does:
`loss_fn(pred, labels, num_global_valid_tokens, generator_logprobs=, advantages=, loss_mask=)` with N of
the whole step (every micro-batch and DP rank, counted by the batcher), `loss.backward()` per micro-batch,
FSDP's gradient division off (gradients summed over DP and micro-batches: the runs set grad_reduce and
ga_reduce to sum). The trainer applies no temperature (its generator returns vLLM's raw log-probs, also
at T = 1): the runs set T = 1.
"""
import contextlib
import dataclasses
import importlib.util
import logging
import os

import torch

from lossverify.torch import LogProbs, Reduced
from lv_frameworks import Run, checkout, git_commit
from lv_frameworks.nemo_rl import cleared, derived_case
from lv_frameworks.single_gpu import package_shell
from lv_frameworks.torchtitan import _same_shards, _stub

NAME = "torchtitan RL"
EXPLANATIONS = ["rl-logprob-allgather-grad-sum", "rl-logprob-untracked-allreduce", "rl-temperature-one-side",
                "dp-local-mean", "ga-microbatch-mean", "rl-schedule-double-divide"]
IGNORE_INDEX = -100
_state = {"loss": None, "dapo": None, "backend": "partial_dtensor", "group": None, "size": 1}


def _has_spmd_types():
    return importlib.util.find_spec("spmd_types") is not None


def _stub_imports():
    if not _has_spmd_types():
        _stub("spmd_types", register_autograd_function=lambda cls: cls, assert_type=lambda *a, **k: None,
              is_type_checking=lambda: False, no_typecheck=contextlib.nullcontext, get_local_type=lambda t: {},
              S=lambda dim: ("S", dim), I="I", P="P", R="R")

    class Configurable:
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config:
            pass

    _stub("torchtitan.config", Configurable=Configurable, CompileConfig=object)

    class _Mesh:
        def get_group(self, name):
            return _state["group"]

    _stub("torchtitan.distributed.spmd_types", current_spmd_mesh=lambda: _Mesh(),
          spmd_mesh_size=lambda name: _state["size"] if name == "tp" else 1)
    _stub("torchtitan.distributed.utils", get_spmd_backend=lambda: _state["backend"])
    _stub("torchtitan.tools.logging", logger=logging.getLogger("torchtitan"))


def _load():
    if _state["loss"] is None:
        root = os.path.join(checkout(), "torchtitan")
        for package in ("", ".components", ".distributed", ".tools", ".experiments", ".experiments.rl",
                        ".experiments.rl.losses"):
            package_shell("torchtitan" + package, os.path.join(root, *package.split(".")[1:]))
        _stub_imports()
        from torchtitan.components import loss
        from torchtitan.experiments.rl.losses import dapo
        _state["loss"], _state["dapo"] = loss, dapo
    return _state["loss"], _state["dapo"]


def _labels(labels, ctx):
    """The trainer's labels: the token ids, IGNORE_INDEX where the loss mask is off."""
    return torch.where(ctx.loss_mask, labels, torch.full_like(labels, IGNORE_INDEX))


def _dtensor(logits, ctx):
    """The rank's shard as the model's output under partial_dtensor: a DTensor Shard(-1) on the TP mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = DeviceMesh.from_group(ctx.tp_group, ctx.device.type, mesh_dim_names=("tp",))
    return DTensor.from_local(logits, mesh, [Shard(logits.dim() - 1)], run_check=False,
                              shape=torch.Size((logits.shape[0], ctx.vocab_size)), stride=(ctx.vocab_size, 1))


def _pred(logits, ctx, backend):
    _state["backend"], _state["group"], _state["size"] = backend, ctx.tp_group, ctx.tp_size
    if ctx.tp_size > 1 and backend == "partial_dtensor":
        return _dtensor(logits, ctx)
    return logits


def _logprobs(backend):
    def fn(logits, labels, ctx):
        loss, _ = _load()
        logprob = loss.compute_logprobs(_pred(logits, ctx, backend), _labels(labels, ctx))
        return LogProbs(logprob)

    fn.__name__ = f"compute_logprobs_{'dtensor' if backend == 'partial_dtensor' else 'spmd'}"
    fn.__doc__ = f"compute_logprobs(logits, labels) under the {backend} SPMD backend (the entropy it returns is " \
                 "computed without gradient: not judged)."
    return fn


compute_logprobs_dtensor = _logprobs("partial_dtensor")
compute_logprobs_spmd = _logprobs("spmd_types")


def _dapo(backend):
    def fn(logits, labels, ctx):
        _, dapo = _load()
        lc = ctx.loss
        loss_fn = dapo.DAPOLoss(dapo.DAPOLoss.Config(ratio_clip_low=lc.clip_low, ratio_clip_high=lc.clip_high))
        value, metrics = loss_fn(_pred(logits, ctx, backend), _labels(labels, ctx), ctx.num_valid_tokens,
                                 generator_logprobs=ctx.old_logprob.float(), advantages=ctx.advantages.float(),
                                 loss_mask=ctx.loss_mask)
        # trainer/entropy/mean: the micro-batch's entropy sum / N (SUM-reduced over DP by the trainer)
        return Reduced(value, stats={"entropy": float(metrics["trainer/entropy/mean"])})

    fn.__name__ = f"dapo_loss_{'dtensor' if backend == 'partial_dtensor' else 'spmd'}"
    fn.__doc__ = f"DAPOLoss(...)(pred, labels, N, generator_logprobs=old, advantages=A, loss_mask=m) under the " \
                 f"{backend} SPMD backend."
    return fn


dapo_loss_dtensor = _dapo("partial_dtensor")
dapo_loss_spmd = _dapo("spmd_types")


def describe(path):
    return {"commit": git_commit(path), "source": "torchtitan/components/loss.py (compute_logprobs), "
                                                  "torchtitan/experiments/rl/losses/dapo.py (DAPOLoss)"}


def runs(cases):
    """Every RL case at T = 1 (torchtitan's trainer has none) and cp 1 (its RL trainer has no CP), tp 1, 2
    and 4 where torchtitan's shards (ceil(V/TP) per rank) are lossverify's, with the case's dp and ga.
    compute_logprobs on every case (objective as the case has it, entropy bonus off: its entropy carries no
    gradient); DAPOLoss on the policy-loss cases as DAPO has it: token-mean, no KL, no entropy bonus, no
    dual clip, no whitening, token ratio; its logged entropy judged. The spmd_types runs only where the
    package is installed. One sweep per case and function."""
    out = []
    backends = ["dtensor"] + (["spmd"] if _has_spmd_types() else [])
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy":
            continue
        layout = case.get("layout", {})
        rest = {"cp": 1, **{k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}}
        tps = [tp for tp in (1, 2, 4) if _same_shards(case["shape"]["vocab"], tp)]
        common = {}
        if loss.get("temperature", 1.0) != 1.0:
            common["loss.temperature"] = 1.0
        if loss.get("entropy_coef", 0):
            common["loss.entropy_coef"] = 0
        lp_case = name  # the harness builds the case's objective on the log-probs
        for backend in backends:
            fn = f"{__name__}:compute_logprobs_{backend}"
            for tp in tps:
                out.append(Run(fn, lp_case, {"tp": tp, **rest}, common))
            out.append(Run(fn, lp_case, None, common, "sweep",
                           sweep=[f"tp{tp}-cp1-dp{d}-ga{g}" for tp in tps for d in (1, 2) for g in (1, 2)]))
        if loss.get("objective", "policy_loss") == "logprob":
            continue
        dapo_over = dict(common, **{"loss.kl_coef": 0} if loss.get("kl_coef", 0) else {})
        dapo_over["framework.grad_reduce"] = "sum"
        dapo_over["framework.ga_reduce"] = "sum"
        dapo_over["loss.aggregation"] = "token-mean"
        if loss.get("ratio") == "sequence":
            dapo_over["loss.ratio"] = "token"
        drop = cleared(loss, aggregation="token-mean", whiten=False, dual_clip=0)
        dapo_case = derived_case(name, case, drop) if drop else name
        if dapo_over["loss.aggregation"] == loss.get("aggregation"):
            del dapo_over["loss.aggregation"]
        for backend in backends:
            fn = f"{__name__}:dapo_loss_{backend}"
            for tp in tps:
                out.append(Run(fn, dapo_case, {"tp": tp, **rest}, dapo_over, "gradients summed"))
            out.append(Run(fn, dapo_case, None, dapo_over, "sweep",
                           sweep=[f"tp{tp}-cp1-dp{d}-ga{g}" for tp in tps for d in (1, 2) for g in (1, 2)]))
    return out
