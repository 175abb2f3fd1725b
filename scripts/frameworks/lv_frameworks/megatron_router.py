"""Megatron-LM's MoE router auxiliary losses (`transformer.moe.router.TopKRouter` and `moe_utils`), imported from a
checkout and driven as a training step drives them.

The checkout's `moe_utils.py`, `router.py`, `tensor_parallel/mappings.py` (the counts' all-reduce) and
`pipeline_parallel/schedules.py` (`forward_step_calc_loss`, which sets MoEAuxLossAutoScaler's scale) are loaded
unmodified. One real `TopKRouter` per MoE layer is built once per step and its `routing(logits, padding_mask)` is
called on each micro-batch: the z-loss, the top-k routing, `compute_routing_scores_for_aux_loss`, the aux, sequence
aux and global aux losses (`switch_load_balancing_loss_func`, `get_tokens_per_expert_and_token_count`) and
`attach_and_log_load_balancing_loss` all run as shipped, and the gradient reaches the logits only through
MoEAuxLossAutoScaler's backward. Stubbed, none of it math (STUBS): the package __init__ files; `megatron.core.utils`
(a group's rank and size, the torch-version probe, identity decorators); `megatron.core.transformer.module`
(MegatronModule as a plain torch.nn.Module holding its config); `megatron.core.jit` (jit_fuser as the identity);
`megatron.core.extensions.transformer_engine` (HAVE_TE False: the unfused path); the MoE metrics tracker (it
records what Megatron logs: the adapter reads the recorded values back); `torch.cuda.current_device()` answered
"cpu" while a router is built (the device of its global-aux buffers); on torch < 2 `torch.compile` as the identity
while router.py is imported (it decorates InferenceTopKRouter, not judged); every other megatron module a placeholder.
The router's config is a namespace of the TransformerConfig fields it reads; its process groups are the run's.

How a case maps onto the router's input (no math, LAYOUT): Megatron routes [seq_length, bsz, E] logits, one column
per sequence of the micro-batch (its sequence aux loss is per column). The rank's rows of each sequence of the
micro-batch that has a valid token on some rank of the sequence partition become that sequence's column, in order,
padded to the rank's longest column; `padding_mask` is True on padding and on masked rows (True means padding in
the code of z_loss_func and compute_routing_scores_for_aux_loss, whatever the docstrings say). Megatron trains MoE
with TP > 1 only under sequence parallelism (MoELayer.forward raises otherwise), so every run at tp > 1 sets
layout.sp.
"""
import contextlib
import os
import sys
import types

import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lossverify.torch.kinds.router import expert_bias, micro_batch_weight
from lv_frameworks import Run, checkout, git_commit, stub_megatron_core_utils, stub_module
from lv_frameworks import megatron, megatron_mtp

NAME = "Megatron-LM"
EXPLANATIONS = ["moe-aux-local-counts", "moe-aux-topk-squared", "moe-aux-tp-sum", "moe-aux-cp-missing",
                "moe-aux-padding-counted", "moe-aux-no-grad", "moe-aux-ga-overweight", "moe-aux-per-token-divided",
                "moe-aux-per-token-tp-cp", "moe-seq-aux-mbs", "moe-aux-count-not-returned", "moe-aux-global-topk",
                "moe-aux-per-token-rank-count", "moe-aux-log-doubled", "moe-zloss-rank-mean",
                "moe-aux-per-token-reduced-count", "moe-seq-aux-mean-length", "moe-global-aux-mean-counts",
                "moe-global-aux-batch-tokens", "moe-aux-mask-ignored", "moe-seq-aux-packed"]
STUBS = ["megatron, megatron.core, megatron.core.transformer, megatron.core.transformer.moe, "
         "megatron.core.tensor_parallel, megatron.core.pipeline_parallel: package __init__ files not run",
         "megatron.core.utils: get_pg_rank/get_pg_size, get_tensor_model_parallel_group_if_none, divide, "
         "is_torch_min_version; deprecated and internal_api as identity decorators; other names placeholders",
         "megatron.core.transformer.module.MegatronModule: a torch.nn.Module holding its config",
         "megatron.core.jit.jit_fuser: the identity",
         "megatron.core.extensions.transformer_engine: HAVE_TE = False (the unfused path)",
         "megatron.core.transformer.moe.moe_logging.get_moe_metrics_tracker: a recorder of the values Megatron logs",
         "torch.cuda.current_device(): 'cpu' while a TopKRouter is built (its buffers' device)",
         "torch.compile (torch < 2): the identity while router.py is imported (InferenceTopKRouter's decorator)",
         "every other megatron module imported by router.py, moe_utils.py, mappings.py, schedules.py: placeholders",
         "TransformerConfig: a namespace of the fields the router reads; pg_collection: the run's groups"]
LAYOUT = ("the rank's rows of each sequence of the micro-batch with a valid token in the sequence partition as one "
          "column of Megatron's [seq_length, bsz] input, padded; padding_mask True on padding and masked rows")
REAL = ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.router",
        "megatron.core.tensor_parallel.mappings", "megatron.core.pipeline_parallel.schedules",
        "megatron.core.tensor_parallel.utils")
_modules = {}


class _Tracker:
    """The MoE metrics tracker's stand-in: keeps what `record` is given (name, value, layer number) for the
    current micro-batch."""

    def __init__(self):
        self.records = []

    def record(self, name, value, layer_number, num_layers, **kwargs):
        self.records.append((name, value.detach().double().reshape(()), layer_number))


_tracker = _Tracker()


def _identity_decorator(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda function: function


class _MegatronModule(torch.nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config


def _load(root=None):
    """The router, moe_utils and schedules modules of a Megatron-LM checkout (the judged one unless `root` names
    another: the slime_router and ms_swift_router adapters pass the Megatron-LM their framework trains with), with
    the stubs of the module docstring. Loaded once per process."""
    if not _modules:
        root = root or checkout()
        core = os.path.join(root, "megatron", "core")
        megatron._package("megatron", os.path.join(root, "megatron"))
        megatron._package("megatron.core", core)
        for sub in ("transformer", "transformer/moe", "tensor_parallel", "pipeline_parallel"):
            megatron._package("megatron.core." + sub.replace("/", "."), os.path.join(core, sub))
        utils = stub_megatron_core_utils()
        utils.deprecated = _identity_decorator
        utils.internal_api = _identity_decorator
        utils.__getattr__ = megatron_mtp._placeholder_attribute
        stub_module("megatron.core.transformer.module", MegatronModule=_MegatronModule)
        stub_module("megatron.core.jit", jit_fuser=lambda function: function)
        stub_module("megatron.core.extensions.transformer_engine", HAVE_TE=False)
        stub_module("megatron.core.transformer.moe.moe_logging", get_moe_metrics_tracker=lambda: _tracker)
        saved = megatron_mtp.REAL
        megatron_mtp.REAL = REAL
        compile_missing = not hasattr(torch, "compile")
        if compile_missing:  # torch < 2: router.py's InferenceTopKRouter (not judged) decorates with it
            torch.compile = lambda function=None, **kwargs: function if function else (lambda f: f)
        try:
            for name in ("moe_utils", "router"):
                _modules[name] = megatron_mtp._import_with_placeholders("megatron.core.transformer.moe." + name)
            _modules["schedules"] = megatron_mtp._import_with_placeholders(megatron_mtp.SCHEDULES)
        finally:
            megatron_mtp.REAL = saved
            if compile_missing:
                del torch.compile
    return _modules


@contextlib.contextmanager
def _cpu_device():
    """torch.cuda.current_device() answers "cpu" while a router registers its buffers."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _aux_types(loss):
    """Megatron's moe_router_load_balancing_type list and moe_aux_loss_coeff list for the case's coefficients."""
    pairs = [("aux_loss", loss.aux_coef), ("seq_aux_loss", loss.seq_aux_coef),
             ("global_aux_loss", loss.global_aux_coef)]
    pairs = [(name, float(coef)) for name, coef in pairs if coef > 0]
    return [name for name, _ in pairs] or ["none"], [coef for _, coef in pairs] or [0.0]


def _config(ctx):
    """The TransformerConfig fields TopKRouter and the schedule read, from the case's settings."""
    loss = ctx.loss
    types_, coefs = _aux_types(loss)
    grouped = loss.map == "routed" and int(loss.groups) > 1
    return types.SimpleNamespace(
        num_moe_experts=ctx.vocab_size // int(loss.layers), hidden_size=1, add_bias_linear=False,
        perform_initialization=False, params_dtype=torch.float32, sequence_parallel=bool(ctx.sp),
        calculate_per_token_loss=loss.scaling == "per_token", moe_router_topk=int(loss.top_k),
        moe_router_load_balancing_type=types_, moe_aux_loss_coeff=coefs, moe_router_score_function=loss.score,
        moe_router_enable_expert_bias=False, moe_enable_routing_replay=False, moe_router_pre_softmax=False,
        moe_router_num_groups=int(loss.groups) if grouped else None,
        moe_router_group_topk=int(loss.top_groups) if grouped else None, moe_router_topk_scaling_factor=None,
        moe_router_fusion=False, moe_expert_capacity_factor=None,
        moe_z_loss_coeff=float(loss.z_loss_coef) if loss.z_loss_coef > 0 else None,
        num_layers=int(loss.layers), mtp_num_layers=None, mtp_use_repeated_layer=False, moe_input_jitter_eps=None,
        moe_router_force_load_balancing=False, moe_router_force_biased=None, moe_router_dtype=None,
        grad_scale_func=None, timers=None)


def _routers(ctx):
    """One TopKRouter per MoE layer, built at the step's first micro-batch (the global aux loss's counts live in
    its buffers across the step's micro-batches). Under map: routed the case's expert bias is loaded for dispatch."""
    if "megatron_routers" not in ctx.state:
        modules = _load()
        config = _config(ctx)
        groups = types.SimpleNamespace(tp=ctx.tp_group, cp=ctx.cp_group, tp_cp=ctx.tp_cp_group,
                                       tp_dp_cp=ctx.batch_group)
        routers = []
        with _cpu_device():
            for layer in range(int(ctx.loss.layers)):
                router = modules["router"].TopKRouter(config, pg_collection=groups)
                router.set_layer_number(layer + 1)
                routers.append(router)
        if ctx.loss.map == "routed" and ctx.loss.expert_bias:
            bias = expert_bias(ctx.loss, len(routers), config.num_moe_experts)
            for layer, router in enumerate(routers):
                router.expert_bias = bias[layer].clone()
        ctx.state["megatron_routers"] = (config, routers)
    return ctx.state["megatron_routers"]


def _step_sequences(ctx):
    """The step's number of sequence ids (an upper bound for per-sequence sums), over every rank."""
    if "megatron_sequences" not in ctx.state:
        top = max([int(mb.sequences.max()) for mb in ctx.micro_batches if mb.rows] or [-1]) + 1
        value = torch.tensor(top, dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=ctx.batch_group)
        ctx.state["megatron_sequences"] = int(value.item())
    return ctx.state["megatron_sequences"]


def _columns(ctx):
    """(rows, positions, columns, seq_length, bsz): where each of the rank's rows goes in Megatron's [s, b] input
    (LAYOUT). The columns are the micro-batch's sequences with a valid token on some rank of the partition."""
    ids, valid = ctx.sequences, ctx.loss_mask
    present = torch.zeros(_step_sequences(ctx), dtype=torch.float64)
    if ids.numel():
        keep = ids >= 0
        present.index_add_(0, ids[keep], valid[keep].double())
    dist.all_reduce(present, group=ctx.tp_cp_group)
    column_of = {int(s): j for j, s in enumerate(torch.nonzero(present > 0).flatten().tolist())}
    rows, positions, columns, filled = [], [], [], {}
    for row, s in enumerate(ids.tolist()):
        if s in column_of:
            j = column_of[s]
            rows.append(row)
            positions.append(filled.get(j, 0))
            columns.append(j)
            filled[j] = filled.get(j, 0) + 1
    seq_length = max(list(filled.values()) + [1])
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)
    return as_tensor(rows), as_tensor(positions), as_tensor(columns), seq_length, max(len(column_of), 1)


def _megatron_input(logits, ctx, layer, width, where):
    """One layer's logits as Megatron's [s, b, E] (differentiable in the case's logits) and its padding mask."""
    rows, positions, columns, seq_length, bsz = where
    part = logits[:, layer * width:(layer + 1) * width]
    dense = part.new_zeros(seq_length, bsz, width).index_put((positions, columns), part[rows])
    padding = torch.ones(seq_length, bsz, dtype=torch.bool)
    padding[positions, columns] = ~ctx.loss_mask[rows].bool()
    return dense, padding


def packed_input(keep=None):
    """The router input of a packed (thd) micro-batch: the rank's rows (those where `keep`, default all of them,
    padding and masked rows included) in order as one column [rows, 1, E], and no padding mask (every token counts).
    slime and ms-swift (padding_free) pack a micro-batch's sequences into one stream, pad each to a multiple of 2 CP
    at CP > 1 and split it into its zigzag chunks, split the stream over TP in contiguous parts under SP, as
    lossverify does, and pass GPTModel no padding_mask. Returns a layer_input for route()."""
    def layer_input(logits, layer, width):
        part = logits[:, layer * width:(layer + 1) * width]
        if keep is not None:
            part = part[keep]
        return part.unsqueeze(1), None
    return layer_input


def step_rows(ctx):
    """Every row of the step over the rank's sequence partition (TP x CP), for a framework's own token counts:
    per micro-batch a list of (tp rank, cp rank, sequence, position, token, loss mask), CP rank by CP rank and within
    one TP rank by TP rank (a CP rank's stream in order), gathered once per step (all_gather_object over
    ctx.tp_cp_group)."""
    if "megatron_step_rows" not in ctx.state:
        mine = [[(ctx.tp_rank, ctx.cp_rank, s, p, t, int(m)) for s, p, t, m in
                 zip(mb.sequences.tolist(), mb.positions.tolist(), mb.tokens.tolist(), mb.loss_mask.tolist())]
                for mb in ctx.micro_batches]
        parts = [None] * dist.get_world_size(ctx.tp_cp_group)
        dist.all_gather_object(parts, mine, group=ctx.tp_cp_group)
        ctx.state["megatron_step_rows"] = [
            sorted((row for part in parts for row in part[k]), key=lambda r: (r[1], r[0]))
            for k in range(len(ctx.micro_batches))]
    return ctx.state["megatron_step_rows"]


def _set_scale(ctx, config):
    """The schedule's forward_step_calc_loss (the checkout's) sets MoEAuxLossAutoScaler's scale for the micro-batch:
    loss_scale * cp / num_microbatches by default, loss_scale in per-token mode (loss_scale 1: no grad_scale_func).
    The main loss it is given is a placeholder; it is not judged here."""
    def main_loss(output):
        return output, torch.ones((), dtype=torch.int), {}

    schedules = _load()["schedules"]
    # it imports multi_token_prediction when called (for MTP's scale; config.mtp_num_layers is None): a placeholder
    sys.meta_path.insert(0, megatron_mtp._Placeholders())
    try:
        schedules.forward_step_calc_loss(None, torch.zeros(()), main_loss, config, None, False, ctx.ga, [],
                                         cp_group_size=ctx.cp_size, is_last_stage=True)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, megatron_mtp._Placeholders)]


def _logged_values(records, config, tp_cp_size, layers):
    """Each layer's aux terms and z-loss as Megatron records them (aux_loss / coeff, z_loss / (coeff / TP CP)),
    put back in loss units: the rank's share of each."""
    coefs = dict(zip(config.moe_router_load_balancing_type, config.moe_aux_loss_coeff))
    names = {"load_balancing_loss": "aux_loss", "seq_load_balancing_loss": "seq_aux_loss",
             "global_load_balancing_loss": "global_aux_loss"}
    aux = torch.zeros(layers, dtype=torch.float64)
    z = torch.zeros(layers, dtype=torch.float64)
    for name, value, layer_number in records:
        if name == "z_loss":
            z[layer_number - 1] += value * config.moe_z_loss_coeff / tp_cp_size
        else:
            aux[layer_number - 1] += value * coefs[names[name]]
    return aux, z


def _take_records():
    """What Megatron logged since the last call, as (name, value, layer number): the metrics tracker's records
    (the stub's) and, on checkouts whose router still logs through moe_utils' save_to_aux_losses_tracker (before
    moe_logging, e.g. 1dcf0daf), the per-layer values of moe_utils' own tracker, read back and then cleared with
    its clear_aux_losses_tracker."""
    records, _tracker.records = _tracker.records, []
    modules = _load()
    if hasattr(modules["router"], "save_to_aux_losses_tracker"):
        moe_utils = modules["moe_utils"]
        for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items():
            for layer, value in enumerate(entry["values"].tolist()):
                if value:
                    records.append((name, torch.tensor(value, dtype=torch.float64), layer + 1))
        moe_utils.clear_aux_losses_tracker()
    return records


def route(logits, ctx, config, routers, layer_input, grad_factor=1.0):
    """One micro-batch through each layer's TopKRouter.routing, with the schedule's aux-loss scale (_set_scale).
    `layer_input(logits, layer, width)` gives the layer's router input [s, b, E] (differentiable in the case's
    logits) and its padding mask (None: every token counts). `grad_factor` multiplies the gradient that reaches
    the logits (a framework whose finalize divides by another count than the harness's N, in per-token mode).
    The gradient is what MoEAuxLossAutoScaler injects (the routing probabilities' own path carries a zero
    gradient: they feed the experts, whose loss is not this case's). Logged: the shares Megatron records,
    weighed by the micro-batch's weight in the step's loss."""
    width = config.num_moe_experts
    _take_records()
    _set_scale(ctx, config)
    probs = []
    for layer, router in enumerate(routers):
        dense, padding = layer_input(logits, layer, width)
        if grad_factor != 1.0 and dense.requires_grad:
            dense.register_hook(lambda grad: grad * grad_factor)
        layer_probs, _ = router.routing(dense, padding_mask=padding)
        probs.append(layer_probs)
    return step_result(probs, _take_records(), config, ctx)


def step_result(probs, records, config, ctx):
    """The micro-batch's Reduced: a zero objective through the layers' routing probabilities (the gradient is the one
    MoEAuxLossAutoScaler injects), and the shares Megatron `records`, weighed by the micro-batch's weight."""
    layers = len(probs)
    aux, z = _logged_values(records, config, dist.get_world_size(ctx.tp_cp_group), layers)
    weight = micro_batch_weight(ctx)
    stats = {"aux_loss": weight * aux.sum() / layers, "z_loss": weight * z.sum() / layers}
    if layers > 1:
        for layer in range(layers):
            stats[f"aux_loss.layer{layer}"] = weight * aux[layer]
            stats[f"z_loss.layer{layer}"] = weight * z[layer]
    objective = sum(p.sum() for p in probs) * 0.0
    return Reduced(objective, logged=float(weight * (aux.sum() + z.sum())), stats=stats)


def router_step(logits, labels, ctx):
    """One micro-batch through Megatron's TopKRouter.routing per layer (route), each sequence a column of
    Megatron's [s, b] input with its padding mask (LAYOUT)."""
    config, routers = _routers(ctx)
    where = _columns(ctx)
    return route(logits, ctx, config, routers,
                 lambda x, layer, width: _megatron_input(x, ctx, layer, width, where))


def describe(path):
    return {"commit": git_commit(path), "source": "megatron/core/transformer/moe/router.py (TopKRouter), "
            "megatron/core/transformer/moe/moe_utils.py"}


def _conventions(loss):
    """The --set overrides that select Megatron's conventions (MOE.md §1), and notes saying them: the Switch form
    divided by k, one loss per layer, counts over the top-k of the scores (compute_routing_scores_for_aux_loss:
    not the routed map, whatever the expert bias and groups), the global aux loss's running counts."""
    overrides, notes = {}, []
    if not loss.get("divide_by_k", True):
        overrides["loss.divide_by_k"] = True
        notes.append("divided by k")
    if loss.get("pool_layers", False):
        overrides["loss.pool_layers"] = False
        notes.append("one loss per layer")
    if loss.get("map", "top_k") == "routed":
        overrides["loss.map"] = "top_k"
        notes.append("counts from the plain top-k map")
    if loss.get("counts", "top_k") != "top_k":
        overrides["loss.counts"] = "top_k"
        notes.append("counts over the top-k")
    if loss.get("global_aux_coef", 0) and loss.get("global_counts", "step") != "running":
        overrides["loss.global_counts"] = "running"
        notes.append("running global counts")
    if loss.get("scaling", "default") == "per_token":
        overrides.update({"framework.grad_reduce": "sum", "framework.ga_reduce": "sum"})
        notes.append("per-token mode: gradients summed, finalize divides by N")
    else:
        overrides.update({"framework.grad_reduce": "avg", "framework.ga_reduce": "sum"})
        notes.append("default mode: the schedule's scale, DDP averages over DP x CP")
    return overrides, notes


# The runs: per case, its layouts ((tp, cp, dp, ga); tp > 1 runs under SP, as Megatron trains MoE with TP) and the
# runs that set one term's coefficient to 0 to say which term a failure comes from (each still Megatron's code).
PLAN = {
    "moe-aux-replicated-tp8-e6": [((1, 1, 2, 2), {}), ((2, 1, 2, 2), {}), ((8, 1, 1, 2), {})],
    "moe-aux-sp-tp2-cp2": [((1, 1, 1, 2), {}), ((1, 2, 1, 2), {}), ((2, 2, 1, 2), {}),
                           ((2, 2, 1, 2), {"loss.z_loss_coef": 0}), ((2, 2, 1, 2), {"loss.aux_coef": 0})],
    "moe-global-aux-dp2-ga2": [((1, 1, 1, 1), {}), ((1, 1, 1, 2), {}), ((1, 1, 2, 1), {}), ((1, 1, 2, 2), {}),
                               ((2, 1, 2, 2), {}), ((2, 1, 2, 2), {"loss.global_aux_coef": 0}),
                               ((1, 1, 1, 2), {"loss.aux_coef": 0}), ((1, 1, 2, 1), {"loss.aux_coef": 0})],
    "moe-per-token-sp-cp2-dp2": [((1, 1, 2, 2), {}), ((1, 2, 2, 2), {}), ((2, 2, 2, 2), {}),
                                 ((1, 1, 2, 2), {"loss.z_loss_coef": 0, "loss.seq_aux_coef": 0}),
                                 ((1, 2, 2, 2), {"loss.z_loss_coef": 0, "loss.seq_aux_coef": 0}),
                                 ((2, 2, 2, 2), {"loss.z_loss_coef": 0, "loss.seq_aux_coef": 0}),
                                 ((1, 1, 2, 2), {"loss.z_loss_coef": 0, "loss.aux_coef": 0})],
    "moe-pooled-transformers-dp2-ga2": [((1, 1, 2, 2), {}), ((2, 1, 2, 2), {})],
    "moe-routed-groups-bias": [((1, 1, 1, 2), {}), ((1, 2, 1, 2), {}), ((2, 2, 1, 2), {}),
                               ((2, 2, 1, 2), {"loss.z_loss_coef": 0})],
    "moe-sigmoid-seq-aux": [((1, 1, 1, 1), {}), ((1, 2, 1, 1), {}), ((2, 2, 1, 1), {}),
                            ((2, 2, 1, 1), {"loss.seq_aux_coef": 0})],
}
_OFF = {"loss.z_loss_coef": "z-loss off", "loss.aux_coef": "aux loss off", "loss.seq_aux_coef": "sequence aux off",
        "loss.global_aux_coef": "global aux off"}


def runs(cases):
    """Every shipped router case (PLAN) with Megatron's conventions selected: at tp 1 and at tp > 1 under SP, with
    CP, DP and GA as the case has them, and runs with one term off that say which term a failure comes from."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "router" or name not in PLAN:
            continue
        overrides, notes = _conventions(loss)
        for (tp, cp, dp, ga), off in PLAN[name]:
            layout = {"tp": tp, "cp": cp, "dp": dp, "ga": ga}
            sets = {**overrides, "layout.sp": tp > 1, **off}
            out.append(Run(f"{__name__}:router_step", name, layout, sets,
                           ", ".join(notes + [_OFF[k] for k in off] + (["SP"] if tp > 1 else []))))
    return out


def no_padding(case):
    """The --set overrides that leave a case's streams without padding or masked tokens: inputs.ignore_fraction 0 and
    every sequence length rounded up to a multiple of 2 CP TP over the case's layouts in PLAN (no CP padding, and
    under SP every rank's share whole)."""
    unit = 2 * max(cp * tp for (tp, cp, _, _), _ in PLAN[case["name"]])
    lengths = [-(-n // unit) * unit for n in case["batch"]["sequence_lengths"]]
    return {"inputs.ignore_fraction": 0, "batch.sequence_lengths": lengths}


def framework_runs(module, cases, per_token="router_step", labels=None):
    """The runs of a framework that trains through Megatron's router (slime_router, ms_swift_router), in both of
    Megatron's modes as the framework sets calculate_per_token_loss, each case judged by the contract of the mode
    (default: the micro-batches' mean, through `router_step`; per-token: each micro-batch weighing its share of the
    step's valid tokens, through `per_token`): every shipped router case as shipped (its masked tokens and padding)
    at the first and the last of its layouts in PLAN (tp > 1 under SP); the same cases without padding or masked
    tokens (no_padding) at every layout of PLAN: the framework's scaling alone; and, with `labels`, per-token mode
    through that function at the layouts without padding."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "router" or name not in PLAN:
            continue
        layouts = [layout for layout, off in PLAN[name] if not off]
        clean = no_padding({**case, "name": name})
        for scaling, function in (("default", "router_step"), ("per_token", per_token)):
            overrides, notes = _conventions({**loss, "scaling": scaling})
            if loss.get("scaling", "default") != scaling:
                overrides["loss.scaling"] = scaling
            plan = [(function, layout, {}, []) for layout in dict.fromkeys([layouts[0], layouts[-1]])]
            plan += [(function, layout, clean, ["no padding, no masked tokens"]) for layout in layouts]
            if labels and scaling == "per_token":
                plan += [(labels, layout, clean, ["no padding, no masked tokens"]) for layout in layouts]
            for function_name, (tp, cp, dp, ga), more, what in plan:
                layout = {"tp": tp, "cp": cp, "dp": dp, "ga": ga}
                sets = {**overrides, "layout.sp": tp > 1, **more}
                out.append(Run(f"{module}:{function_name}", name, layout, sets,
                               ", ".join(notes + what + (["SP"] if tp > 1 else []))))
    return out
