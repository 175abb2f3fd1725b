"""DeepSpeed-MoE's gating losses (`deepspeed.moe.sharded_moe`: `top1gating`, `top2gating`, `topkgating`, the `l_aux`
that `deepspeed.moe.layer.MoE.forward` returns), imported from a checkout and driven as the documented recipe drives
them: the model returns each MoE layer's `l_aux`, the user adds `coeff * sum(l_aux)` to the loss (`--moe-loss-coeff`,
docs/_tutorials/mixture-of-experts-nlg.md; tests/unit/v1/moe/test_moe.py adds `l_aux` to the loss it hands to
`engine.backward`), and the engine scales it.

Loaded unmodified from the checkout: `deepspeed/moe/layer.py` (MoE), `sharded_moe.py` (MOELayer, TopKGate and the three
gating functions), `experts.py`, `mappings.py`, `utils/bwc.py`, `utils/torch.py`, `utils/groups.py` (its defaults:
no mpu, expert-TP size 1), `runtime/utils.py` (`register_output_backward_hooks`) and `runtime/engine.py`
(`DeepSpeedEngine._backward_prologue_per_tensor`). One real `MoE` layer per MoE layer of the case (ep_size 1,
num_experts E, the case's k, `drop_tokens=False`; its other arguments DeepSpeed's defaults) is called on each
micro-batch; its gate's `wg` is the identity (hidden_size E), so the gate's logits are the case's router logits
exactly (a product by 1 plus zeros) and their gradient flows back unchanged. The engine's GA scaling runs as the engine
registers it: `register_output_backward_hooks` on the outputs of the model's forward, with the engine's
`_backward_prologue_per_tensor` (each output's gradient / gradient_accumulation_steps; since DeepSpeed #7665
`engine.backward` no longer divides the loss itself) on an engine stand-in that answers `_scale_wrt_gas` True and
`gradient_accumulation_steps()` the run's GA. The engine's all-reduce averages the gate's gradient over DP
(`gradient_average`, the default: `framework.grad_reduce avg`); the adapter leaves it to lossverify's framework model.

Stubbed, none of it math (STUBS): the package __init__ files of deepspeed, deepspeed.moe, deepspeed.utils and
deepspeed.runtime (not run); `deepspeed.utils.logger` and `log_dist` (logging), `instrument_w_nvtx` (the identity);
every other deepspeed module the loaded files import (deepspeed.comm, deepspeed.accelerator, the timers, ZeRO, ...):
placeholders, never called on these runs (ep_size 1: no all-to-all; no mpu: no TP token dropping).

Capacity: the three gating functions compute `l_aux` from the routing masks before any capacity is applied (top1:
`ce` from `mask1` before the `top_idx` scatter; top2 and topk: before `mask *= locations < capacity`), so the
judgement holds at any capacity factor; `drop_tokens=False` (DeepSpeed's "infinite capacity") keeps the dispatch free
of dropped routes.

Conventions (MOE.md §1), selected per k as DeepSpeed's TopKGate dispatches: k = 1 `top1gating`, the Switch form
E/T^2 sum_e c_e sum_t p_te; k = 2 `top2gating`, first choices only and not divided by k (`counts: first`:
`ce = mean(mask1)`, `l_aux = mean(me * ce) E^2`); k > 2 `topkgating`, the Switch form over the top-k divided by k.
Softmax scores only, one loss per layer (layers add, as Megatron-DeepSpeed sums moe_losses), no z-loss, no sequence or
global aux loss, no expert bias.

How a case maps onto the layer's input (no math, LAYOUT): each MoE layer's logits of the rank's rows are the layer's
hidden states [rows, E]. Two inputs are judged. `moe_step` (as shipped): every row of the rank, with
`used_token` = the loss mask (int64; MoE.forward's documented "mask only used tokens"; a float mask fails in top1's
token selection). `moe_step_valid`: only the rank's valid rows, `used_token` None, as a caller that removes padding
and masked tokens before the layer; it judges the formulas and the scaling free of DeepSpeed's masking. DeepSpeed's
MoE has no sequence-partition scope (its gate all-reduces nothing; MOELayer's TP path de-duplicates replicated
tokens for the experts only), so the runs are TP without sequence parallelism (every TP rank holds every token and
computes the same l_aux), DP and GA; no SP, no CP.
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

from lossverify.torch import Reduced
from lossverify.torch.kinds.router import micro_batch_weight
from lv_frameworks import Run, checkout, git_commit
from lv_frameworks.megatron_mtp import _Placeholders as _MegatronPlaceholders, _placeholder_attribute

NAME = "DeepSpeed"
EXPLANATIONS = ["moe-aux-mask-ignored", "moe-aux-mask-counts-only", "moe-aux-ga-double-divide", "moe-aux-padding-counted",
                "moe-aux-ga-overweight", "moe-aux-no-grad", "moe-aux-topk-squared", "moe-aux-global-topk",
                "moe-aux-local-counts", "moe-aux-log-doubled"]
STUBS = ["deepspeed, deepspeed.moe, deepspeed.utils, deepspeed.runtime: package __init__ files not run",
         "deepspeed.utils.logger, log_dist: logging; instrument_w_nvtx: the identity",
         "every other deepspeed module imported by the loaded files (deepspeed.comm, deepspeed.accelerator, timers, "
         "ZeRO, ...): placeholders, never called (ep_size 1, no mpu)",
         "the engine: a stand-in answering _scale_wrt_gas True and gradient_accumulation_steps() = GA to the real "
         "DeepSpeedEngine._backward_prologue_per_tensor"]
LAYOUT = ("each MoE layer's logits of the rank's rows as the layer's hidden states [rows, E] with the gate's wg the "
          "identity; moe_step: every row, used_token = the loss mask; moe_step_valid: the valid rows only")
REAL = ("deepspeed.moe.sharded_moe", "deepspeed.moe.layer", "deepspeed.moe.experts", "deepspeed.moe.mappings",
        "deepspeed.utils.bwc", "deepspeed.utils.torch", "deepspeed.utils.groups", "deepspeed.runtime.utils",
        "deepspeed.runtime.engine")
_modules = {}


class _Placeholders(_MegatronPlaceholders):
    """Every deepspeed module but the REAL ones is a placeholder."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("deepspeed.") and name not in REAL and name not in sys.modules:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None


def _shell(name, path, **attributes):
    """A package whose __init__ is not run; submodules load from `path`."""
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def _load():
    """The checkout's MoE layer, runtime utils and engine modules, with the stubs of the module docstring."""
    if not _modules:
        root = os.path.join(checkout(), "deepspeed")
        _shell("deepspeed", root)
        _shell("deepspeed.moe", os.path.join(root, "moe"))
        _shell("deepspeed.runtime", os.path.join(root, "runtime"))
        _shell("deepspeed.utils", os.path.join(root, "utils"), logger=_placeholder_attribute("logger"),
               log_dist=lambda *args, **kwargs: None, instrument_w_nvtx=lambda function: function,
               __getattr__=_placeholder_attribute)
        sys.meta_path.insert(0, _Placeholders())
        try:
            for name in ("deepspeed.utils.groups", "deepspeed.moe.layer", "deepspeed.runtime.utils",
                         "deepspeed.runtime.engine"):
                _modules[name.split(".")[-1]] = importlib.import_module(name)
        finally:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Placeholders)]
    return _modules


def _layers(ctx):
    """One DeepSpeed MoE layer per MoE layer of the case, built at the step's first micro-batch: E experts (the
    identity; the experts' output is not judged), the case's k, ep_size 1, drop_tokens False, the gate's wg the
    identity."""
    if "deepspeed_layers" not in ctx.state:
        modules = _load()
        width = ctx.vocab_size // int(ctx.loss.layers)
        layers = []
        for _ in range(int(ctx.loss.layers)):
            moe = modules["layer"].MoE(hidden_size=width, expert=torch.nn.Identity(), num_experts=width, ep_size=1,
                                       k=int(ctx.loss.top_k), drop_tokens=False)
            with torch.no_grad():
                moe.deepspeed_moe.gate.wg.weight.copy_(torch.eye(width))
            layers.append(moe.to(ctx.device))
        ctx.state["deepspeed_layers"] = layers
    return ctx.state["deepspeed_layers"]


def _engine_hooks(outputs, ctx):
    """What DeepSpeedEngine.forward does to the model's outputs: register_output_backward_hooks with the engine's
    _backward_prologue_per_tensor (each output's gradient / gradient_accumulation_steps)."""
    modules = _load()
    engine = types.SimpleNamespace(_scale_wrt_gas=True, gradient_accumulation_steps=lambda: ctx.ga)
    per_tensor = types.MethodType(modules["engine"].DeepSpeedEngine._backward_prologue_per_tensor, engine)
    return modules["utils"].register_output_backward_hooks(outputs, preprocess_once_fn=lambda: None,
                                                          preprocess_per_tensor_fn=per_tensor)


def _step(logits, ctx, valid_only, loss_in_forward=False):
    """One micro-batch: the model's forward (each layer's MoE on its logits, returning the outputs and every layer's
    l_aux), the engine's hooks on those outputs, and the recipe's loss coeff * sum of the layers' l_aux. With
    loss_in_forward the model adds coeff * sum(l_aux) to its loss inside forward and returns the loss and the summed
    aux loss, as transformers' MoE models return `loss` and `aux_loss`; the engine hooks both."""
    layers = _layers(ctx)
    width = ctx.vocab_size // len(layers)
    mask = ctx.loss_mask.bool()
    outputs, l_aux = [], []
    for layer, moe in enumerate(layers):
        hidden = logits[:, layer * width:(layer + 1) * width]
        if valid_only:
            output, aux, _ = moe(hidden[mask])
        else:
            output, aux, _ = moe(hidden, mask.long())
        outputs.append(output)
        l_aux.append(aux)
    coeff = float(ctx.loss.aux_coef)
    if loss_in_forward:
        aux_loss = sum(l_aux)
        objective = coeff * aux_loss
        hooks = _engine_hooks({"loss": objective, "aux_loss": aux_loss}, ctx)
    else:
        hooks = _engine_hooks((outputs, l_aux), ctx)
        objective = coeff * sum(l_aux)
    del hooks  # tied to the outputs' lifetime, as the engine's is
    values = torch.stack([a.detach().double().reshape(()) for a in l_aux]) * coeff
    weight = micro_batch_weight(ctx)
    stats = {"aux_loss": weight * values.sum() / len(layers), "z_loss": torch.zeros((), dtype=torch.float64)}
    if len(layers) > 1:
        for layer in range(len(layers)):
            stats[f"aux_loss.layer{layer}"] = weight * values[layer]
            stats[f"z_loss.layer{layer}"] = torch.zeros((), dtype=torch.float64)
    return Reduced(objective, logged=float(weight * values.sum()), stats=stats)


def moe_step(logits, labels, ctx):
    """As shipped: every row of the rank through MoE.forward(hidden, used_token=loss mask)."""
    return _step(logits, ctx, valid_only=False)


def moe_step_valid(logits, labels, ctx):
    """The rank's valid rows only through MoE.forward(hidden) (a caller that drops padding and masked tokens)."""
    return _step(logits, ctx, valid_only=True)


def moe_step_loss_in_forward(logits, labels, ctx):
    """The valid rows, with the model returning its loss (coeff * sum of l_aux, added inside forward) beside the
    summed aux loss, both hooked by the engine."""
    return _step(logits, ctx, valid_only=True, loss_in_forward=True)


def describe(path):
    return {"commit": git_commit(path), "source": "deepspeed/moe/sharded_moe.py (top1gating, top2gating, "
            "topkgating), deepspeed/moe/layer.py (MoE), deepspeed/runtime/engine.py (the GA hooks)"}


def _conventions(loss, top_k):
    """The --set overrides that select DeepSpeed's conventions for its gating function at k, and notes."""
    overrides, notes = {"framework.grad_reduce": "avg", "framework.ga_reduce": "sum"}, []
    if top_k != loss.get("top_k", 2):
        overrides["loss.top_k"] = top_k
    gate = {1: "top1gating", 2: "top2gating"}.get(top_k, "topkgating")
    notes.append(f"k {top_k}: {gate}")
    if top_k == 2:
        overrides["loss.counts"] = "first"
        notes.append("first choices (counts: first)")
    elif loss.get("counts", "top_k") != "top_k":
        overrides["loss.counts"] = "top_k"
    if not loss.get("divide_by_k", True):
        overrides["loss.divide_by_k"] = True  # topkgating divides by k; under counts: first no effect
    if loss.get("pool_layers", False):
        overrides["loss.pool_layers"] = False
        notes.append("one loss per layer")
    for key, what in (("z_loss_coef", "no z-loss"), ("seq_aux_coef", "no sequence aux"),
                      ("global_aux_coef", "no global aux")):
        if loss.get(key, 0):
            overrides[f"loss.{key}"] = 0
            notes.append(what)
    if loss.get("scaling", "default") != "default":
        overrides["loss.scaling"] = "default"
        notes.append("default scaling")
    notes.append("engine: grad / GA, DP average")
    return overrides, notes


# The runs: per case, its layouts ((tp, dp, ga); tp > 1 without SP: DeepSpeed's MoE replicates tokens over TP) and
# the k values judged (the case's own, and on the tp8 case k = 1 and k = 3 for top1gating and topkgating).
PLAN = {
    "moe-aux-replicated-tp8-e6": [((1, 2, 2), 2), ((8, 1, 2), 2), ((1, 2, 2), 1), ((8, 1, 2), 1), ((1, 2, 2), 3),
                                  ((8, 1, 2), 3)],
    "moe-aux-sp-tp2-cp2": [((1, 1, 2), 2), ((2, 1, 2), 2)],
    "moe-global-aux-dp2-ga2": [((1, 2, 2), 2), ((2, 2, 2), 2)],
    "moe-per-token-sp-cp2-dp2": [((1, 2, 2), 4), ((2, 2, 2), 4)],
    "moe-pooled-transformers-dp2-ga2": [((1, 2, 2), 2), ((2, 2, 2), 2)],
}

# The runs whose model returns its loss beside the aux loss (moe_step_loss_in_forward): GA 2 at tp 1.
IN_FORWARD = {("moe-aux-replicated-tp8-e6", 1, 2), ("moe-aux-replicated-tp8-e6", 1, 3),
              ("moe-global-aux-dp2-ga2", 1, 2)}


def runs(cases):
    """The softmax router cases (PLAN) with DeepSpeed's conventions for its gating function at k, each as shipped
    (moe_step: every row, used_token the loss mask) and on the valid rows only (moe_step_valid)."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "router" or name not in PLAN:
            continue
        for (tp, dp, ga), top_k in PLAN[name]:
            overrides, notes = _conventions(loss, top_k)
            layout = {"tp": tp, "cp": 1, "dp": dp, "ga": ga}
            sets = {**overrides, "layout.sp": False}
            out.append(Run(f"{__name__}:moe_step", name, layout, sets, ", ".join(notes + ["every row, used_token"])))
            out.append(Run(f"{__name__}:moe_step_valid", name, layout, sets, ", ".join(notes + ["valid rows only"])))
            if (name, tp, top_k) in IN_FORWARD:
                out.append(Run(f"{__name__}:moe_step_loss_in_forward", name, layout, sets,
                               ", ".join(notes + ["valid rows only", "loss and aux_loss returned"])))
    return out
