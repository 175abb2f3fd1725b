"""Megatron-LM's multi-token-prediction loss (`transformer.multi_token_prediction.process_mtp_loss`), in its
per-token mode (`calculate_per_token_loss`, the second item of Megatron-LM issue #7452) and in its default mode
with the scale the pipeline schedule gives it (issue #3943: CP > 1).

process_mtp_loss is loaded from the checkout unmodified, and so is the schedule's `forward_step_calc_loss`,
which sets MTPLossAutoScaler's scale for a micro-batch. Their modules import most of Megatron Core (layers,
checkpointing, inference, pipeline communication) for names these two functions never use; those imports
resolve to inert placeholders. The cross entropy is Megatron's own `vocab_parallel_cross_entropy` (the megatron
adapter's import), called as `LanguageModule.compute_language_model_loss` calls it.

How a case maps onto an MTP layer: the case's rows, logits and labels are the MTP layer's. process_mtp_loss
gets the main loss's labels and mask and rolls them one position left (across CP chunks at CP > 1, by its
own exchange with the neighbouring CP ranks), so the main label at a position is the token there, and the main
mask the case's mask one position earlier; the first position of a sequence is a valid main-loss token, as in
training, where the roll leaves the MTP layer one label short. Megatron's packed CP layout is lossverify's
(each sequence padded to a multiple of 2 CP, CP rank c holding chunks c and 2 CP - 1 - c), and cu_seqlens are
the padded sequences' global offsets, as Megatron passes them.

Gradients: in per-token mode they are summed over DP x CP and finalize_model_grads divides them by the step's
main-loss token count (applied through MTPLossAutoScaler's scale, which the schedule sets to 1 in this mode);
in the default mode DDP averages them over DP x CP and the schedule's scale is used as it is.
"""
import importlib
import importlib.abc
import inspect
import importlib.machinery
import os
import sys
import types

import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lv_frameworks import checkout
from lv_frameworks import megatron

_module = None
TARGET = "megatron.core.transformer.multi_token_prediction"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
REAL = (TARGET, SCHEDULES)
_schedules = None


class _PlaceholderType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderType(name, (_Placeholder,), {})

    def __getitem__(cls, item):
        return cls


class _Placeholder(metaclass=_PlaceholderType):
    """Stands for any name the MTP module imports but process_mtp_loss never uses: a class (attributes,
    subscripts and subclasses allowed), a value, a decorator or a function."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return _Placeholder

    def __call__(self, *args, **kwargs):
        return _Placeholder


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderType(name, (_Placeholder,), {})


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every megatron module but the ones loaded from the checkout is a placeholder (the adapter has loaded
    the real cross-entropy and utils modules before)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("megatron.") and name not in REAL and name not in sys.modules:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _load():
    global _module
    if _module is None:
        megatron._load()  # the real cross entropy and the stubbed utils
        utils = sys.modules["megatron.core.utils"]
        utils.__getattr__ = _placeholder_attribute  # names the two modules import from utils and never call
        core = os.path.join(checkout(), "megatron", "core")
        megatron._package("megatron.core.transformer", os.path.join(core, "transformer"))
        megatron._package("megatron.core.pipeline_parallel", os.path.join(core, "pipeline_parallel"))
        _module = _import_with_placeholders(TARGET)
    return _module


def _schedule():
    """The checkout's pipeline_parallel.schedules (its forward_step_calc_loss)."""
    global _schedules
    if _schedules is None:
        _load()
        _schedules = _import_with_placeholders(SCHEDULES)
    return _schedules


def _import_with_placeholders(name):
    """The checkout's module `name`, every other megatron module it imports resolved to a placeholder."""
    sys.meta_path.insert(0, _Placeholders())
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Placeholders)]


def _placeholder_attribute(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _PlaceholderType(name, (_Placeholder,), {})


def _main_loss_tokens(ctx):
    """The step's main-loss token count (finalize_model_grads' num_tokens): every micro-batch's main-loss
    mask, summed over DP x CP. Computed at this rank's first call; the runs give every rank rows."""
    if "mtp_main_tokens" not in ctx.state:
        local = sum(float(_main_inputs(ctx, mb)[1].sum()) for mb in ctx.micro_batches)
        count = torch.tensor([local], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(count, group=ctx.dp_cp_group)
        ctx.state["mtp_main_tokens"] = count.item()
    return ctx.state["mtp_main_tokens"]


def _main_inputs(ctx, micro_batch):
    """The main loss's labels and mask at the micro-batch's rows, and the packed sequences' global offsets.
    The main mask at position p is the case's mask at p - 1, which at the first row of a CP chunk lives on
    another CP rank: the micro-batch's (sequence, position, mask) are gathered over the CP group (every CP
    rank holds the same sequences, with the same number of rows)."""
    sequences, positions, mask = micro_batch.sequences, micro_batch.positions, micro_batch.loss_mask
    rows = [torch.stack([sequences, positions, mask.long()])]
    if ctx.cp_size > 1:
        rows = [torch.empty_like(rows[0]) for _ in range(ctx.cp_size)]
        dist.all_gather(rows, torch.stack([sequences, positions, mask.long()]), group=ctx.cp_group)
    mask_at = {(s, p): m for part in rows for s, p, m in zip(*(t.tolist() for t in part))}
    previous = [mask_at.get((s, p - 1), 0) if p > 0 else 1 for s, p in zip(sequences.tolist(), positions.tolist())]
    main_mask = torch.tensor(previous, dtype=torch.float32, device=mask.device)
    main_labels = micro_batch.token_ids.clamp(min=0)  # the token at each position (0 on padding rows)
    offsets = [0]
    for begin, end in _sequences(micro_batch):
        offsets.append(offsets[-1] + (end - begin) * ctx.cp_size)
    return main_labels, main_mask, offsets


def _sequences(micro_batch):
    """[(begin, end)] of each packed sequence's rows in a micro-batch."""
    ids = micro_batch.sequences.tolist()
    spans, begin = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[begin]:
            spans.append((begin, i))
            begin = i
    return spans


def _process_mtp_loss(logits, ctx, per_token):
    """process_mtp_loss on one MTP layer over the micro-batch; returns (its output, the normalised loss it
    hands MTPLossAutoScaler). The scaler's scale must be set before."""
    mtp = _load()
    main_labels, main_mask, offsets = _main_inputs(ctx, ctx.current)
    rows = main_labels.shape[0]

    def output_layer(hidden, weight=None, runtime_gather_output=None):
        return logits.unsqueeze(1), None  # [s, b, v_local]

    def compute_language_model_loss(layer_labels, layer_logits):  # LanguageModule's: labels [b, s]
        loss = megatron.cross_entropy(layer_logits.float(), layer_labels.transpose(0, 1).contiguous(), 0.0,
                                      ctx.tp_group)
        return loss.transpose(0, 1).contiguous()

    config = types.SimpleNamespace(mtp_num_layers=1, mtp_loss_scaling_factor=1.0, calculate_per_token_loss=per_token,
                                   mtp_detach_heads=False)
    packed = types.SimpleNamespace(cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32))
    hidden = torch.zeros(2 * rows, 1, 1, device=logits.device, requires_grad=True)
    groups = {"cp_group": ctx.cp_group}
    if "tp_group" in inspect.signature(mtp.process_mtp_loss).parameters:  # older checkouts take none
        groups["tp_group"] = ctx.tp_group
    out = mtp.process_mtp_loss(hidden, main_labels.unsqueeze(0), main_mask.unsqueeze(0), output_layer, None, None,
                               False, compute_language_model_loss, config, packed_seq_params=packed, **groups)
    return out, out.grad_fn.saved_tensors[0]


def mtp_per_token_loss(logits, labels, ctx):
    """One MTP layer in per-token mode: process_mtp_loss(hidden, main labels, main mask, ...) with
    config.calculate_per_token_loss, its gradient back-propagated through MTPLossAutoScaler."""
    main_tokens = _main_loss_tokens(ctx)
    _load().MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / main_tokens, device=logits.device))
    out, normalised = _process_mtp_loss(logits, ctx, per_token=True)
    # What the gradient differentiates: the normalised MTP loss process_mtp_loss hands MTPLossAutoScaler (its
    # saved tensor), times the loss scale. The returned loss carries that value; its gradient is the scaler's.
    value = normalised.detach().sum() / main_tokens
    return Reduced(out.sum() * 0.0 + value)


def mtp_loss(logits, labels, ctx):
    """One MTP layer in Megatron's default mode: the schedule's forward_step_calc_loss (the checkout's) runs
    on the micro-batch's main-loss output, with the step's micro-batch count and the CP group's size, and sets
    MTPLossAutoScaler's scale (loss_scale / num_microbatches, no grad_scale_func: loss_scale 1); then
    process_mtp_loss normalises the micro-batch's MTP loss by its own token count. DDP averages the gradients
    over DP x CP (the runs' grad_reduce avg)."""
    device = logits.device
    config = types.SimpleNamespace(mtp_num_layers=1, calculate_per_token_loss=False, grad_scale_func=None,
                                   timers=None)

    def main_loss(output):  # the main loss of pretrain_gpt's loss_func: (sum, count, report); not judged here
        return output, torch.ones((), dtype=torch.int, device=device), {}

    _schedule().forward_step_calc_loss(None, torch.zeros((), device=device), main_loss, config, None, False,
                                       ctx.ga, [], cp_group_size=ctx.cp_size, is_last_stage=True)
    scale = float(_load().MTPLossAutoScaler.main_loss_backward_scale)
    out, normalised = _process_mtp_loss(logits, ctx, per_token=False)
    value = normalised.detach().sum() * scale
    return Reduced(out.sum() * 0.0 + value)
