"""verl's Megatron backend for MoE: Megatron-LM's real `TopKRouter` (lv_frameworks.megatron_router's machinery, a
Megatron-LM checkout named by LV_MEGATRON_CHECKOUT) inside verl's own loss path, imported from a verl checkout (the
framework checkout).

What verl decides, and where (verl-project/verl):
- the router config: the Megatron-Bridge engine (`verl/workers/engine/megatron/transformer_impl.py`,
  `_build_tf_config`) forces `moe_router_load_balancing_type: "none"` (aux losses off, "it hurts perf in RL"); a user
  turns them on through `override_transformer_config` (`moe_router_load_balancing_type`, `moe_aux_loss_coeff`,
  `moe_z_loss_coeff`), which the engine applies over that default. The legacy converter
  (`verl/models/mcore/config_converter.py`, the vanilla-mbridge path) sets "none" for Qwen/Mixtral and
  `seq_aux_loss` with sigmoid scores and an expert bias for DeepSeek-V3. The runs use each case's terms (a user who
  turned them on) and, separately, the z-loss alone (verl's default with the examples' `moe_z_loss_coeff`);
- `calculate_per_token_loss`: Megatron-Bridge turns it on at CP > 1 (the engine says so), and dynamic CP sets it.
  So the runs at cp 1 use Megatron's default mode and those at cp > 1 its per-token mode (loss.scaling);
- the router's input: verl passes no `padding_mask` to the model outside dynamic CP (`router_padding_mask = None` in
  `forward_step`). With `use_remove_padding` (THD, the default) the rollout's padding is removed and the
  micro-batch's sequences are packed into one `[tokens, 1]` sequence; with BSHD the padded batch goes in whole;
- the loss's return (`postprocess_micro_batch_func`, verl's own code, run here): in default mode `(loss x
  num_micro_batch, output)`; in per-token mode (verl #6836, which fixed #6609) the 3-tuple `(loss x
  routed_num_tokens / dp_size, routed tokens of the micro-batch // cp_size, output)`, whose count Megatron's
  schedule accumulates and `finalize_model_grads` all-reduces over DP x CP and divides every gradient by.

verl never calls `MoEAuxLossAutoScaler.set_loss_scale` in the Megatron engine (only its Automodel engine sets the
scaler's scale): Megatron's schedule `forward_step_calc_loss` (the checkout's, run here with verl's
postprocess_micro_batch_func as its loss_func) sets it, `cp / num_microbatches` in default mode and 1 in per-token
mode.

Each run calls verl's `MegatronEngineWithLMHead.postprocess_micro_batch_func` (imported unmodified; a stand-in
`self` carries the engine's config and groups) with a placeholder main loss (0, not judged here) through Megatron's
schedule; the routers are megatron_router's (one real TopKRouter per layer, `routing(logits, padding_mask=None)`).
Re-implemented (REIMPLEMENTED): finalize_model_grads' division of the gradients by the all-reduced count. The
harness divides the router gradient by the step's valid tokens N in per-token mode; verl's finalize divides by
N_verl, the sum over DP x CP and micro-batches of verl's returned counts, so the adapter multiplies the logits'
gradient by N / N_verl (1 whenever every micro-batch's routed tokens divide by cp).

How a case reaches the router (LAYOUTS): `thd`: the rank's valid rows of the micro-batch, in order, as one column
(verl's no-padding path drops the padding; the case's masked rows are that padding), bsz 1; `bshd`: every row of the
rank, the case's masked rows standing for the padding of verl's padded batch, routed without a mask, as one column
(for the aux loss and the z-loss, sums over the scope's tokens, that is the [s, b] batch's arithmetic without the
filler rows the case has no logits for; the sequence aux loss is not run in bshd). Not modelled: THD's alignment
padding (each sequence padded to a multiple of TP x CP x 2 under CP, of TP under SP, and routed unmasked): the case
has no logits for pad tokens.
"""
import functools
import os
import sys
import types

import torch
import torch.distributed as dist

from lossverify.torch.kinds.router import scope_group
from lv_frameworks import Run, git_commit, stub_module
from lv_frameworks import megatron_mtp, megatron_router
from lv_frameworks.megatron_router import _routers, _tracker, step_result
from lv_frameworks.single_gpu import package_shell

NAME = "verl"
EXPLANATIONS = megatron_router.EXPLANATIONS
MEGATRON = os.path.abspath(os.environ.get("LV_MEGATRON_CHECKOUT", ""))
ENGINE = "verl.workers.engine.megatron.transformer_impl"
STUBS = megatron_router.STUBS + [
    "verl, verl.workers, verl.workers.engine, verl.workers.engine.megatron: package __init__ files not run",
    "verl.workers.engine.base: BaseEngine and BaseEngineCtx as object, EngineRegistry.register as the identity",
    "verl.utils.tensordict_utils.get_non_tensor_data: the field's value from a dict (the TensorDict lookup)",
    "megatron.core.package_info.__version__: a version string",
    "every other verl, megatron, tensordict and omegaconf module transformer_impl.py imports: placeholders",
    "the engine object (self of postprocess_micro_batch_func): its tf_config, engine_config (cp size, "
    "dynamic_context_parallel off, use_remove_padding on) and DP group",
]
REIMPLEMENTED = ["finalize_model_grads' division by the all-reduced count (the gradient x N / N_verl)",
                 "forward_backward_batch's routed_num_tokens: verl's _routed_num_tokens of the rank's mini-batch, "
                 "all-reduced over DP (it scales only the placeholder main loss)"]
_engine = {}


class _Placeholders(megatron_mtp._Placeholders):
    """megatron_mtp's finder, widened to the verl, tensordict and omegaconf modules transformer_impl.py imports."""

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if name == ENGINE or name in sys.modules:
            return None
        if top in ("verl", "tensordict", "omegaconf"):
            import importlib.machinery
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return super().find_spec(name, path, target)


def _verl_engine():
    """verl's MegatronEngineWithLMHead class from the checkout's transformer_impl.py."""
    if not _engine:
        if not os.path.isdir(os.path.join(MEGATRON, "megatron", "core")):
            raise RuntimeError("verl trains MoE through Megatron-LM's router: set LV_MEGATRON_CHECKOUT to a Megatron-LM "
                               "checkout")
        megatron_router.checkout = lambda: MEGATRON  # megatron_router loads Megatron from its own checkout
        megatron_router._load()  # the real router, moe_utils, mappings and schedules, megatron's stubs
        root = os.environ["LV_FRAMEWORK_CHECKOUT"]
        for name in ("verl", "verl.workers", "verl.workers.engine", "verl.workers.engine.megatron"):
            package_shell(name, os.path.join(root, *name.split(".")))

        class _Registry:
            @staticmethod
            def register(*args, **kwargs):
                return lambda cls: cls

        stub_module("verl.workers.engine.base", BaseEngine=object, BaseEngineCtx=object, EngineRegistry=_Registry)
        utils = package_shell("verl.utils", os.path.join(root, "verl", "utils"))
        utils.tensordict_utils = stub_module("verl.utils.tensordict_utils",  # `from verl.utils import ... as tu`
                                             get_non_tensor_data=lambda data, key, default: data.get(key, default))
        if "megatron.core.package_info" not in sys.modules:
            stub_module("megatron.core.package_info", __version__="0.0.0")
        finder = _Placeholders()
        sys.meta_path.insert(0, finder)
        saved = megatron_mtp.REAL
        megatron_mtp.REAL = megatron_router.REAL
        try:
            import importlib
            module = importlib.import_module(ENGINE)
        finally:
            megatron_mtp.REAL = saved
            sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
        _engine["class"] = module.MegatronEngineWithLMHead
    return _engine["class"]


class _Data(dict):
    """What postprocess_micro_batch_func reads of a micro-batch's TensorDict: its fields, by key."""


def _engine_self(ctx, config):
    """The engine object verl's postprocess_micro_batch_func is a method of: its config and groups only."""
    engine = types.SimpleNamespace(
        tf_config=config,
        engine_config=types.SimpleNamespace(dynamic_context_parallel=False, use_remove_padding=True,
                                            context_parallel_size=ctx.cp_size),
        get_data_parallel_group=lambda: ctx.dp_group if hasattr(ctx, "dp_group") else None)
    cls = _verl_engine()
    engine.prepare_model_outputs = functools.partial(cls.prepare_model_outputs, engine)
    engine._routed_num_tokens = functools.partial(cls._routed_num_tokens, engine)
    return cls, engine


def _micro_batch_data(ctx, micro_batch, routed_num_tokens=None):
    """A micro-batch's fields for verl: the attention mask of its sequences (each sequence's valid tokens over the
    sequence partition, as the CP-replicated batch holds them), input_ids, num_micro_batch, dp_size and the step's
    routed_num_tokens."""
    present = torch.zeros(megatron_router._step_sequences(ctx), dtype=torch.float64)
    ids, valid = micro_batch.sequences, micro_batch.loss_mask
    if ids.numel():
        keep = ids >= 0
        present.index_add_(0, ids[keep], valid[keep].double())
    dist.all_reduce(present, group=scope_group(ctx))
    lengths = [int(x) for x in present.tolist() if x > 0] or [0]
    mask = torch.zeros(len(lengths), max(lengths + [1]), dtype=torch.int64)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return _Data(attention_mask=mask, input_ids=torch.zeros(1, dtype=torch.int64), num_micro_batch=ctx.ga,
                 dp_size=ctx.dp_size, routed_num_tokens=routed_num_tokens)


def _placeholder_loss(model_output, data, dp_group=None, config=None):
    """The main (policy) loss verl's ppo_loss would return: a placeholder 0 (not judged by the router kind)."""
    return torch.zeros(()), {}


def _postprocess(ctx, config, data):
    """verl's postprocess_micro_batch_func, bound as forward_backward_batch binds it, as the schedule's loss_func."""
    cls, engine = _engine_self(ctx, config)
    loss_function = functools.partial(_placeholder_loss, config=types.SimpleNamespace(loss_agg_mode="token-mean"))
    return functools.partial(cls.postprocess_micro_batch_func, engine, data=data, forward_only=False,
                             loss_function=loss_function)


def _step_counts(ctx, config):
    """(N_verl, verl's count of each of the rank's micro-batches): what verl's loss path returns per micro-batch in
    per-token mode, summed over micro-batches and all-reduced over DP x CP as finalize_model_grads does."""
    if "verl_counts" not in ctx.state:
        datas = [_micro_batch_data(ctx, mb) for mb in ctx.micro_batches]
        _, engine = _engine_self(ctx, config)
        routed = torch.tensor(float(sum(float(engine._routed_num_tokens(d)) for d in datas)), dtype=torch.float64)
        dist.all_reduce(routed, group=ctx.dp_group)  # forward_backward_batch: over DP
        counts = []
        for data in datas:
            data["routed_num_tokens"] = routed.item()
            _, count, _ = _postprocess(ctx, config, data)(torch.zeros(()))
            counts.append(float(count))
        total = torch.tensor(sum(counts), dtype=torch.float64)
        dist.all_reduce(total, group=ctx.dp_cp_group)  # finalize_model_grads
        ctx.state["verl_counts"] = (total.item(), counts, routed.item())
    return ctx.state["verl_counts"]


def _schedule_step(ctx, config):
    """Megatron's forward_step_calc_loss (the checkout's) on verl's postprocess_micro_batch_func: it sets
    MoEAuxLossAutoScaler's scale and returns the micro-batch's count."""
    routed = _step_counts(ctx, config)[2] if config.calculate_per_token_loss else None
    data = _micro_batch_data(ctx, ctx.micro_batches[ctx.micro_batch], routed)
    schedules = megatron_router._load()["schedules"]
    sys.meta_path.insert(0, megatron_mtp._Placeholders())
    try:
        _, num_tokens = schedules.forward_step_calc_loss(None, torch.zeros(()), _postprocess(ctx, config, data),
                                                         config, None, False, ctx.ga, [], cp_group_size=ctx.cp_size,
                                                         is_last_stage=True)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, megatron_mtp._Placeholders)]
    return num_tokens


class _GradScale(torch.autograd.Function):
    """finalize_model_grads' division by verl's count where the harness divides by N (REIMPLEMENTED)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _rows(ctx, layout):
    """The rank's rows that enter the router, in order: its valid rows (thd) or all its rows (bshd)."""
    if layout == "thd":
        return torch.nonzero(ctx.loss_mask.bool()).flatten()
    return torch.arange(ctx.loss_mask.numel())


def _step(logits, ctx, layout):
    _verl_engine()
    config, routers = _routers(ctx)
    width = config.num_moe_experts
    rows = _rows(ctx, layout)
    _tracker.records = []
    num_tokens = _schedule_step(ctx, config)
    scale = 1.0
    if config.calculate_per_token_loss:
        total, counts, _ = _step_counts(ctx, config)
        assert float(num_tokens) == counts[ctx.micro_batch]
        scale = float(ctx.num_valid_tokens) / total
    x = _GradScale.apply(logits, scale) if scale != 1.0 else logits
    probs = []
    for layer, router in enumerate(routers):
        part = x[:, layer * width:(layer + 1) * width][rows]
        if part.shape[0]:
            dense, padding = part.unsqueeze(1), None
        else:  # no row on this rank: one padded token
            dense, padding = part.new_zeros(1, 1, width) + part.sum(), torch.ones(1, 1, dtype=torch.bool)
        layer_probs, _ = router.routing(dense, padding_mask=padding)
        probs.append(layer_probs)
    return step_result(probs, _tracker.records, config, ctx)


def router_step_thd(logits, labels, ctx):
    """One micro-batch of verl's THD path (use_remove_padding): the valid rows packed into one sequence, no padding
    mask, verl's postprocess_micro_batch_func through Megatron's schedule."""
    return _step(logits, ctx, "thd")


def router_step_thd_aux_as_seq(logits, labels, ctx):
    """Diagnostic, not a shipped configuration: verl's THD path with the case's aux loss configured as Megatron's
    sequence aux loss (moe_router_load_balancing_type "seq_aux_loss", the same coefficient), judged against the
    case's micro-batch aux loss. It passes when Megatron's sequence aux loss over verl's packed [tokens, 1] input is
    the micro-batch's aux loss."""
    if "megatron_routers" not in ctx.state:
        saved = megatron_router._aux_types

        def as_sequence(loss):
            names, coefs = saved(loss)
            return ["seq_aux_loss" if n == "aux_loss" else n for n in names], coefs

        megatron_router._aux_types = as_sequence
        try:
            _verl_engine()
            _routers(ctx)
        finally:
            megatron_router._aux_types = saved
    return _step(logits, ctx, "thd")


def router_step_bshd(logits, labels, ctx):
    """One micro-batch of verl's BSHD path (use_remove_padding=False, default mode only: verl refuses per-token mode
    there): every row, padding included, routed without a mask."""
    return _step(logits, ctx, "bshd")


def describe(path):
    return {"commit": git_commit(path),
            "source": "verl/workers/engine/megatron/transformer_impl.py (postprocess_micro_batch_func) around "
                      "Megatron-LM's TopKRouter (LV_MEGATRON_CHECKOUT)"}


# (case, path, (tp, cp, dp, ga), terms off). cp 1: Megatron's default mode; cp > 1: per-token mode (Megatron-Bridge
# turns calculate_per_token_loss on at CP > 1). tp > 1 under SP.
PLAN = [
    ("moe-aux-replicated-tp8-e6", "thd", (1, 1, 2, 2), {}),
    ("moe-aux-replicated-tp8-e6", "bshd", (1, 1, 2, 2), {}),
    ("moe-aux-sp-tp2-cp2", "thd", (1, 1, 1, 2), {}),
    ("moe-aux-sp-tp2-cp2", "bshd", (1, 1, 1, 2), {}),
    ("moe-aux-sp-tp2-cp2", "bshd", (1, 1, 1, 2), {"loss.aux_coef": 0}),
    ("moe-aux-sp-tp2-cp2", "thd", (1, 2, 1, 2), {}),
    ("moe-aux-sp-tp2-cp2", "thd", (1, 2, 1, 2), {"loss.aux_coef": 0}),
    ("moe-aux-sp-tp2-cp2", "thd", (2, 2, 1, 2), {"loss.aux_coef": 0}),
    ("moe-per-token-sp-cp2-dp2", "thd", (1, 1, 2, 2), {}),
    ("moe-per-token-sp-cp2-dp2", "thd", (1, 2, 2, 2), {}),
    ("moe-per-token-sp-cp2-dp2", "thd", (1, 2, 2, 2), {"loss.z_loss_coef": 0, "loss.seq_aux_coef": 0}),
    ("moe-per-token-sp-cp2-dp2", "thd", (2, 2, 2, 2), {"loss.z_loss_coef": 0, "loss.seq_aux_coef": 0}),
    ("moe-per-token-sp-cp2-dp2", "thd", (1, 2, 2, 2), {"loss.aux_coef": 0, "loss.seq_aux_coef": 0}),
    ("moe-sigmoid-seq-aux", "thd", (1, 1, 1, 1), {}),
    ("moe-sigmoid-seq-aux", "thd", (1, 1, 1, 1), {"loss.seq_aux_coef": 0}),
    ("moe-routed-groups-bias", "thd", (1, 1, 1, 2), {}),
    ("moe-aux-replicated-tp8-e6", "thd_aux_as_seq", (1, 1, 2, 2), {}),
]
_OFF = megatron_router._OFF


def runs(cases):
    """PLAN, each case with Megatron's conventions (megatron_router._conventions) and verl's mode: default at cp 1,
    per-token at cp > 1."""
    out = []
    for name, path, (tp, cp, dp, ga), off in PLAN:
        if name not in cases:
            continue
        loss = dict(cases[name].get("loss", {}), scaling="per_token" if cp > 1 else "default")
        overrides, notes = megatron_router._conventions(loss)
        if cases[name]["loss"].get("scaling", "default") != loss["scaling"]:
            overrides["loss.scaling"] = loss["scaling"]
        sets = {**overrides, "layout.sp": tp > 1, **off}
        notes = [path.replace("_aux_as_seq", ", diagnostic: aux loss configured as seq_aux_loss")] + notes + \
            [_OFF[k] for k in off] + (["SP"] if tp > 1 else [])
        out.append(Run(f"{__name__}:router_step_{path}", name, {"tp": tp, "cp": cp, "dp": dp, "ga": ga}, sets,
                       ", ".join(notes)))
    return out
