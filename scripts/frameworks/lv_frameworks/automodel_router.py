"""NeMo Automodel's MoE router aux loss (`nemo_automodel.components.moe.layers.Gate`, which injects its gradient
through `components/moe/megatron/moe_utils.MoEAuxLossAutoScaler`), imported from a checkout and driven as its LLM
fine-tuning recipe (recipes/llm/train_ft.py) drives it.

Loaded unmodified from the checkout: `components/moe/layers.py` (Gate: the routing, `_compute_expert_load`,
`_compute_aux_loss` with its CP all-reduces, the MoEAuxLossAutoScaler call), `components/moe/config.py` (MoEConfig),
`components/moe/megatron/moe_utils.py` (MoEAuxLossAutoScaler), `components/moe/router_replay.py` (its
replay_selection is on the routing path, a no-op here), `components/moe/load_balance_metrics.py` (the tracking the
recipe enables and the expert loads it logs), `shared/utils.py`, and `recipes/base_recipe.py`, whose
`BaseRecipe._set_moe_aux_loss_backward_scale` (with `_get_cp_group_size`) sets the autoscaler's scale once per step,
as `_run_train_optim_step` calls it before the micro-batches. Stubbed, none of it math (STUBS): the package
__init__ files; `nemo_automodel.shared.import_utils` (safe_import_te answers no Transformer Engine: moe_utils only
uses it for the fused permute kernels); every other nemo_automodel module and the third-party imports of
base_recipe.py (torchdata, transformers, yaml) are placeholders (the experts, linear layers, checkpointing,
tokenizers: never called here); the recipe object is a BaseRecipe whose device mesh answers the run's CP size
(`device_mesh["cp"].size()`, all the non-PP branch reads) with pp_enabled False. On a torch without
`torch.distributed.tensor` (torch 1.13: `from torch.distributed.device_mesh import DeviceMesh` in layers.py fails
first, then `from torch.distributed.tensor import DTensor, Partial, Replicate`), those two modules are stand-ins:
`DTensor.from_local(t, cp_mesh, [Partial()]).full_tensor()` (the only DTensor use on this path, the aux loss's CP
all-reduce of the token count, the expert loads and the score sums) is an all-reduce over the CP group whose
backward hands the gradient on unchanged, as torch's redistribute does from Partial to Replicate ("we keep the
replicate grad here"). On torch >= 2.4 the real DTensor runs on a DeviceMesh made from the run's CP group. On
torch < 2 `torch.compile` is the identity while moe_utils.py is imported (it decorates the activation functions).

How the case maps onto the gate (no math, LAYOUT): one Gate per MoE layer, dim = experts and its weight the identity
(float32, no bias), so `F.linear(x, weight)` hands the case's router logits through exactly and dL/dx is dL/dscores;
`token_mask` is the loss mask (the recipe passes ~padding_mask, and the case's ignored tokens stand for padding);
`cp_mesh` is the CP group's mesh at cp > 1, None otherwise (apply_cp sets it only when CP is enabled). Automodel's
custom-MoE TP keeps the router replicated on every TP rank (parallelizer.py rejects sequence parallelism), so tp > 1
runs without SP: each TP rank routes every token of its group. The score function is Qwen3-MoE's for softmax cases
(softmax before top-k, norm_topk_prob) and DeepSeek-V3's for sigmoid ones (sigmoid, norm_topk_prob: the aux loss
reads sigma / sum sigma; with map routed its expert groups and the case's expert bias loaded as
e_score_correction_bias, never updated).

Around the gate, as train_ft.py's step does outside pipeline parallelism: the scale CP / num_batches set before
micro-batch 0; each micro-batch's Gate.forward per layer; the routing weights feed the experts, whose loss is not
this case's, so their gradient here is 0 and the router logits' gradient is what MoEAuxLossAutoScaler's backward
injects; FSDP2 then averages the gradients over the DP x CP mesh and the micro-batches' gradients add
(framework.grad_reduce avg, ga_reduce sum; the recipe multiplies only the main loss by the DP x CP size, and
scale_grads_and_clip_grad_norm divides only expert and PP gradients). Logged: the aux loss values the gate tracks
(`_last_aux_loss`, which the recipe's moe/aux_loss_mean reads, times the coefficient), weighed by the micro-batch's
weight in the step's loss and divided by CP (every CP rank holds the whole scope's value); Automodel's own metric is
rank 0's last micro-batch, not a step mean, so it is not what is judged. Counts (dp 1 only): collect_expert_loads
over the recipe's DP x CP group after each micro-batch, the scope's counts when DP is 1 (with DP > 1 the recipe logs
them summed over DP by design).

Older checkouts, for the history of the catalogue's two Automodel entries: before #3359 the step set the scale inline
in train_ft.py's _run_train_optim_step (BaseRecipe has no _set_moe_aux_loss_backward_scale), so the adapter applies
that commit's non-PP rule, transcribed (_scale_before_3359): DP x CP from #1412 on, never set before it (the
autoscaler's backward then uses 1.0). The gate and the autoscaler still load from that checkout; router_replay.py is
loaded where it exists, MoEConfig gets only the fields its dataclass has, and on torch < 2.6 the FSDP2
MixedPrecisionPolicy that config.py imported before #1412 is a placeholder.
"""
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lossverify.torch.implementations._collectives import reduce_from_group
from lossverify.torch.kinds.router import expert_bias, micro_batch_weight
from lv_frameworks import Run, checkout, git_commit, stub_module
from lv_frameworks import megatron_mtp
from lv_frameworks.single_gpu import package_shell

NAME = "NeMo Automodel"
EXPLANATIONS = ["moe-aux-local-counts", "moe-aux-topk-squared", "moe-aux-tp-sum", "moe-aux-cp-missing",
                "moe-aux-padding-counted", "moe-aux-no-grad", "moe-aux-ga-overweight", "moe-aux-per-token-divided",
                "moe-aux-per-token-tp-cp", "moe-seq-aux-mbs", "moe-aux-count-not-returned", "moe-aux-global-topk",
                "moe-aux-per-token-rank-count", "moe-aux-log-doubled"]
STUBS = ["nemo_automodel, .components, .components.moe, .components.moe.megatron, .shared, .recipes: package "
         "__init__ files not run",
         "nemo_automodel.shared.import_utils.safe_import_te: (False, None) (no Transformer Engine: the unfused path)",
         "every other nemo_automodel module imported by layers.py and base_recipe.py, and base_recipe.py's torchdata, "
         "transformers and yaml: placeholders",
         "BaseRecipe: an instance with pp_enabled False and a device mesh answering device_mesh['cp'].size()",
         "torch < 2: torch.compile as the identity while moe_utils.py is imported (it decorates the activation "
         "functions, not judged)",
         "torch < 2.4: torch.distributed.device_mesh.DeviceMesh (the CP group) and torch.distributed.tensor "
         "(DTensor.from_local(..., [Partial()]).full_tensor(): an all-reduce over the CP group, backward the "
         "identity, as torch's Partial -> Replicate redistribute)"]
LAYOUT = ("one Gate per layer with dim = experts and the identity as its weight (the case's logits are its scores); "
          "token_mask = the loss mask; cp_mesh the CP group's at cp > 1; tp > 1 without SP (the router replicated)")
# The checkout's modules loaded as shipped; every other nemo_automodel module imported while loading is a placeholder.
REAL = ("nemo_automodel.components.moe.layers", "nemo_automodel.components.moe.config",
        "nemo_automodel.components.moe.megatron.moe_utils", "nemo_automodel.components.moe.router_replay",
        "nemo_automodel.components.moe.load_balance_metrics", "nemo_automodel.shared.utils",
        "nemo_automodel.recipes.base_recipe")
# Third-party packages base_recipe.py imports for its checkpointing and data loading, never used here.
THIRD_PARTY = ("torchdata", "transformers", "yaml")
_modules = {}


class _Placeholders(megatron_mtp._Placeholders):
    """Every nemo_automodel module outside REAL (and not yet loaded), and base_recipe.py's third-party imports, is a
    placeholder module while the real ones load."""

    def find_spec(self, name, path=None, target=None):
        root = name.split(".")[0]
        ours = name.startswith("nemo_automodel.") and name not in REAL
        if (ours or root in THIRD_PARTY) and name not in sys.modules:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None


class _StandInMesh:
    """torch 1.13's DeviceMesh stand-in: a one-dimensional mesh over a process group."""

    def __init__(self, group):
        self.group = group

    def get_group(self, *args, **kwargs):
        return self.group

    def size(self, *args, **kwargs):
        return dist.get_world_size(self.group)


class _StandInPlacement:
    def is_partial(self):
        return isinstance(self, _StandInPartial)

    def is_replicate(self):
        return isinstance(self, _StandInReplicate)


class _StandInPartial(_StandInPlacement):
    pass


class _StandInReplicate(_StandInPlacement):
    pass


class _StandInDTensor:
    """torch 1.13's DTensor stand-in: from_local with Partial placements, then full_tensor (the gate's CP sums)."""

    def __init__(self, local, mesh):
        self._local = local
        self._mesh = mesh

    @staticmethod
    def from_local(local_tensor, device_mesh=None, placements=None, **kwargs):
        if not placements or not all(isinstance(p, _StandInPartial) for p in placements):
            raise NotImplementedError(f"the torch 1.13 DTensor stand-in only sums Partial tensors, not {placements}")
        return _StandInDTensor(local_tensor, device_mesh)

    def full_tensor(self, *args, **kwargs):
        # the sum over the mesh's group, its backward the identity (torch's redistribute keeps a Replicate gradient as
        # it is on its way back to Partial)
        return reduce_from_group(self._local, self._mesh.get_group())

    def to_local(self):
        return self._local


_dtensor = []


def _torch_version():
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _has_dtensor():
    """Whether this torch has DTensor (asked once, before the stand-ins may be registered)."""
    if not _dtensor:
        _dtensor.append(importlib.util.find_spec("torch.distributed.tensor") is not None)
    return _dtensor[0]


def _stub_torch_distributed():
    """On a torch without DTensor (1.13), the two torch.distributed modules layers.py imports (module docstring);
    and where torch has no FSDP2 (< 2.6), the MixedPrecisionPolicy that config.py imported before #1412 (a type
    annotation of a parallelizer config, never built here)."""
    if _torch_version() < (2, 6):  # (asking find_spec would import torch 1.13's fsdp, which fails on Python 3.11)
        stub_module("torch.distributed.fsdp._fully_shard",
                    MixedPrecisionPolicy=megatron_mtp._placeholder_attribute("MixedPrecisionPolicy"))
    if _has_dtensor():
        return
    stub_module("torch.distributed.device_mesh", DeviceMesh=_StandInMesh,
                init_device_mesh=megatron_mtp._placeholder_attribute("init_device_mesh"))
    stub_module("torch.distributed.tensor", DTensor=_StandInDTensor, Partial=_StandInPartial,
                Replicate=_StandInReplicate, Shard=megatron_mtp._placeholder_attribute("Shard"),
                distribute_tensor=megatron_mtp._placeholder_attribute("distribute_tensor"))


def _load():
    """The checkout's gate, autoscaler and load-balance metrics, with the stubs of the docstring (BaseRecipe: _recipe)."""
    if not _modules:
        root = os.path.join(checkout(), "nemo_automodel")
        for package in ("", "components", "components/moe", "components/moe/megatron", "shared", "recipes"):
            name = "nemo_automodel" + ("." + package.replace("/", ".") if package else "")
            package_shell(name, os.path.join(root, package) if package else root)
        stub_module("nemo_automodel.shared.import_utils", safe_import_te=lambda: (False, None))
        _stub_torch_distributed()
        compile_missing = not hasattr(torch, "compile")
        if compile_missing:  # torch < 2: moe_utils.py decorates its activation functions (not judged) with it
            torch.compile = lambda function=None, **kwargs: function if function else (lambda f: f)
        try:
            for name in REAL[:-1]:
                if _in_checkout(root, name):  # router_replay.py came after #1412
                    _modules[name.rpartition(".")[2]] = _import_with_placeholders(name)
        finally:
            if compile_missing:
                del torch.compile
    return _modules


def _in_checkout(root, name):
    return os.path.exists(os.path.join(os.path.dirname(root), *name.split(".")) + ".py")


def _import_with_placeholders(name):
    sys.meta_path.insert(0, _Placeholders())
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Placeholders)]


def _recipe():
    """The checkout's BaseRecipe (recipes/base_recipe.py, imported at the first step)."""
    if "base_recipe" not in _modules:
        _load()
        _modules["base_recipe"] = _import_with_placeholders(REAL[-1])
    return _modules["base_recipe"].BaseRecipe


def _moe_config(ctx):
    """The gate's MoEConfig: Qwen3-MoE's router for softmax cases, DeepSeek-V3's for sigmoid ones (module docstring);
    the expert MLP fields are the dataclass's required ones and never read by the gate."""
    loss = ctx.loss
    experts = ctx.vocab_size // int(loss.layers)
    sigmoid = loss.score == "sigmoid"
    routed = loss.map == "routed"
    grouped = routed and int(loss.groups) > 1
    settings = dict(
        n_routed_experts=experts, n_shared_experts=0, n_activated_experts=int(loss.top_k),
        n_expert_groups=int(loss.groups) if grouped else 0, n_limited_groups=int(loss.top_groups) if grouped else 0,
        train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=float(loss.aux_coef),
        score_func="sigmoid" if sigmoid else "softmax", route_scale=1.0, dim=experts, inter_dim=1, moe_inter_dim=1,
        norm_topk_prob=True, softmax_before_topk=not sigmoid,
        force_e_score_correction_bias=routed and bool(loss.expert_bias), dtype=torch.float32)
    config = _load()["config"].MoEConfig
    known = {field.name for field in dataclasses.fields(config)}
    return config(**{key: value for key, value in settings.items() if key in known})


def _gates(ctx):
    """One Gate per MoE layer (a ModuleList, in training mode, with the recipe's load-balance tracking on), built at
    the step's first micro-batch; its weight the identity; under map routed with a bias, the case's expert bias as its
    e_score_correction_bias."""
    if "automodel_gates" not in ctx.state:
        modules = _load()
        config = _moe_config(ctx)
        gates = torch.nn.ModuleList([modules["layers"].Gate(config) for _ in range(int(ctx.loss.layers))])
        gates.to(ctx.device)
        with torch.no_grad():
            for gate in gates:
                gate.weight.copy_(torch.eye(config.dim, dtype=torch.float32))
        if config.force_e_score_correction_bias:
            bias = expert_bias(ctx.loss, len(gates), config.n_routed_experts, device=ctx.device)
            for layer, gate in enumerate(gates):
                gate.e_score_correction_bias.copy_(bias[layer])
        gates.train()
        modules["load_balance_metrics"].enable_load_balance_tracking(gates)
        ctx.state["automodel_gates"] = gates
    return ctx.state["automodel_gates"]


def _cp_mesh(ctx):
    """The mesh the model hands the gate: the CP group's at cp > 1 (apply_cp), None otherwise."""
    if ctx.cp_size == 1:
        return None
    if "automodel_cp_mesh" not in ctx.state:
        if _has_dtensor():
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh.from_group(ctx.cp_group, ctx.device.type, mesh_dim_names=("cp",))
        else:
            mesh = _StandInMesh(ctx.cp_group)
        ctx.state["automodel_cp_mesh"] = mesh
    return ctx.state["automodel_cp_mesh"]


class _RecipeMesh:
    """The recipe's device mesh as the non-PP branch of _set_moe_aux_loss_backward_scale reads it: the CP axis's size."""

    def __init__(self, ctx):
        self.cp = types.SimpleNamespace(size=lambda: ctx.cp_size)

    def __getitem__(self, axis):
        if axis != "cp":
            raise KeyError(f"the recipe's mesh stand-in has only the cp axis, not {axis!r}")
        return self.cp


def _set_scale(ctx):
    """BaseRecipe._set_moe_aux_loss_backward_scale (the checkout's) as _run_train_optim_step calls it before the
    step's micro-batches: num_batches the step's micro-batches on this rank, num_label_tokens N (read only under PP).
    A checkout from before #3359 has no such method: its step set the scale inline (_scale_before_3359)."""
    base = _recipe()
    if not hasattr(base, "_set_moe_aux_loss_backward_scale"):
        _scale_before_3359(ctx)
        return
    recipe = base.__new__(base)
    recipe.__dict__.update(pp_enabled=False, device_mesh=_RecipeMesh(ctx))
    recipe._set_moe_aux_loss_backward_scale(num_batches=ctx.ga, num_label_tokens=int(ctx.num_valid_tokens))


def _scale_before_3359(ctx):
    """For the history only (the catalogue's moe-aux-no-grad and moe-aux-ga-overweight): before #3359 the scale was
    set inline in train_ft.py's _run_train_optim_step, which cannot be called alone, so its non-PP rule is
    transcribed here: from #1412 on `main_loss_backward_scale = dp_group_size(include_cp=True)` (DP x CP); before
    #1412 it was never set, and the autoscaler's backward uses 1.0."""
    source = open(os.path.join(checkout(), "nemo_automodel", "recipes", "llm", "train_ft.py")).read()
    scaler = _load()["moe_utils"].MoEAuxLossAutoScaler
    if "main_loss_backward_scale" in source:
        scaler.main_loss_backward_scale = torch.tensor(float(ctx.dp_size * ctx.cp_size))
    else:
        scaler.main_loss_backward_scale = None


def _counts(ctx, gates):
    """The expert loads the recipe logs (collect_expert_loads over its DP x CP group: None when that group is one
    rank), [layers, experts]; only at dp 1, where they are the micro-batch scope's counts."""
    if ctx.dp_size != 1:
        return None
    group = ctx.dp_cp_group if ctx.cp_size > 1 else None
    loads = _load()["load_balance_metrics"].collect_expert_loads(gates, dp_group=group)
    return torch.stack([loads[str(layer)]["expert_load"].double() for layer in range(len(gates))])


def router_step(logits, labels, ctx):
    """One micro-batch through each layer's Gate.forward, with the scale the recipe set for the step; the gradient is
    what MoEAuxLossAutoScaler injects (the routing weights' own path carries a zero gradient: they feed the experts,
    whose loss is not this case's). Logged: the aux losses the gates track, with their coefficient, weighed by the
    micro-batch's weight in the step's loss, divided by CP."""
    gates = _gates(ctx)
    if ctx.micro_batch == 0:
        _set_scale(ctx)
    width = ctx.vocab_size // len(gates)
    token_mask = ctx.loss_mask.bool()
    cp_mesh = _cp_mesh(ctx)
    weights = []
    for layer, gate in enumerate(gates):
        layer_weights, _, _ = gate(logits[:, layer * width:(layer + 1) * width], token_mask, cp_mesh)
        weights.append(layer_weights)
    aux = torch.zeros(len(gates), dtype=torch.float64)
    for layer, gate in enumerate(gates):
        if gate._last_aux_loss is not None:
            aux[layer] = gate._last_aux_loss.double().cpu() * gate.aux_loss_coeff
    share = micro_batch_weight(ctx) / ctx.cp_size
    layers = len(gates)
    stats = {"aux_loss": share * aux.sum() / layers}
    if layers > 1:
        for layer in range(layers):
            stats[f"aux_loss.layer{layer}"] = share * aux[layer]
    objective = sum(w.sum() for w in weights) * 0.0
    return Reduced(objective, logged=float(share * aux.sum()), stats=stats, counts=_counts(ctx, gates))


def describe(path):
    return {"commit": git_commit(path), "source": "nemo_automodel/components/moe/layers.py (Gate), "
            "nemo_automodel/components/moe/megatron/moe_utils.py (MoEAuxLossAutoScaler), "
            "nemo_automodel/recipes/base_recipe.py (_set_moe_aux_loss_backward_scale)"}


def _conventions(loss):
    """The --set overrides that select Automodel's gate (MOE.md §1), and notes saying them: the Switch form divided by
    k, one loss per layer, counts over the top-k of the map it dispatches by (with groups: each group scored by its
    top-2 keys, DeepSeek-V3's rule, so top_groups = k / 2), no z-loss, no sequence or global aux loss, each
    micro-batch's aux loss weighing 1/(DP GA) whatever its tokens (the recipe's scale CP / num_batches, FSDP's average
    over DP x CP), and no sequence parallelism."""
    overrides, notes = {}, []
    if not loss.get("divide_by_k", True):
        overrides["loss.divide_by_k"] = True
        notes.append("divided by k")
    if loss.get("pool_layers", False):
        overrides["loss.pool_layers"] = False
        notes.append("one loss per layer")
    if loss.get("counts", "top_k") != "top_k":
        overrides["loss.counts"] = "top_k"
        notes.append("counts over the top-k")
    if loss.get("map", "top_k") == "routed" and loss.get("groups", 1) > 1:
        top_groups = loss["top_k"] // 2
        if loss.get("top_groups") != top_groups:
            overrides["loss.top_groups"] = top_groups
            notes.append(f"groups scored by their top-2 keys (top_groups {top_groups})")
    for key, what in (("z_loss_coef", "no z-loss"), ("seq_aux_coef", "no sequence aux loss"),
                      ("global_aux_coef", "no global aux loss")):
        if loss.get(key, 0):
            overrides[f"loss.{key}"] = 0
            notes.append(what)
    if loss.get("scaling", "default") == "per_token":
        overrides["loss.scaling"] = "default"
        notes.append("micro-batches weigh 1/(DP GA)")
    if loss.get("seq_aux_coef", 0) and loss.get("aux_coef", 0) < 0.01:
        # The sequence aux loss off, a small aux coefficient leaves the aux gradient at the grad check's floor
        # (atol 1e-6 x the token's weight): at moe-sigmoid-seq-aux's 0.001 a gate that dropped the whole aux gradient
        # passed at ga 1 (margin 0.13). 0.02 is the largest coefficient of the shipped cases (Mixtral's).
        overrides["loss.aux_coef"] = 0.02
        notes.append("aux_coef 0.02")
    overrides.update({"framework.grad_reduce": "avg", "framework.ga_reduce": "sum", "layout.sp": False})
    return overrides, notes


# The runs: per case, its layouts (tp, cp, dp, ga); tp > 1 without SP (the router replicated on every TP rank).
PLAN = {
    "moe-aux-replicated-tp8-e6": [(1, 1, 1, 1), (1, 1, 2, 2), (2, 1, 2, 2), (8, 1, 1, 2), (1, 1, 1, 3)],
    "moe-aux-sp-tp2-cp2": [(1, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2), (2, 2, 1, 3)],
    "moe-global-aux-dp2-ga2": [(1, 1, 1, 2), (1, 1, 2, 1), (1, 1, 2, 2), (2, 1, 2, 2)],
    "moe-per-token-sp-cp2-dp2": [(1, 1, 2, 2), (1, 2, 2, 2), (2, 2, 2, 2)],
    "moe-pooled-transformers-dp2-ga2": [(1, 1, 2, 2), (2, 1, 2, 2)],
    "moe-routed-groups-bias": [(1, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2)],
    "moe-sigmoid-seq-aux": [(1, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 1, 2)],
}


def runs(cases):
    """Every shipped router case (PLAN) with Automodel's conventions selected, at tp 1 and at tp > 1 without SP, with
    CP, DP and GA as the case has them."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "router" or name not in PLAN:
            continue
        overrides, notes = _conventions(loss)
        for tp, cp, dp, ga in PLAN[name]:
            out.append(Run(f"{__name__}:router_step", name, {"tp": tp, "cp": cp, "dp": dp, "ga": ga}, dict(overrides),
                           ", ".join(notes)))
    return out
