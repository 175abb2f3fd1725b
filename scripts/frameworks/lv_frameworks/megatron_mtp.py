"""Megatron-LM's multi-token-prediction loss (`transformer.multi_token_prediction.process_mtp_loss`) in its
per-token mode (`calculate_per_token_loss`), the second item of Megatron-LM issue #7452.

process_mtp_loss is loaded from the checkout unmodified. Its module imports most of Megatron Core (layers,
checkpointing, inference) for the MTP layer classes it also defines; those imports resolve to inert
placeholders, since the function uses none of them. The cross entropy it computes is Megatron's own
`vocab_parallel_cross_entropy` (the megatron adapter's import), called as
`LanguageModule.compute_language_model_loss` calls it.

How a case maps onto an MTP layer: the case's rows and labels are the MTP layer's. process_mtp_loss gets the
main loss's labels and mask and rolls them one position left, so each sequence is handed over with one
position more in front (a valid main-loss token) and the MTP logits with one row more at the end (the
position the roll leaves without a label). A sequence then has one main-loss token more than MTP tokens, as
in training. The step's gradients are summed over DP (per-token mode) and finalize_model_grads divides them
by the step's main-loss token count; the adapter applies that division through the loss scale of
MTPLossAutoScaler, which Megatron's schedule sets to 1 in this mode.
"""
import importlib.abc
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
    """Every megatron module but the MTP module is a placeholder (the adapter has loaded the real
    cross-entropy and utils modules before)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("megatron.") and name != TARGET and name not in sys.modules:
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
        sys.modules["megatron.core.utils"].make_viewless_tensor = _Placeholder
        sys.modules["megatron.core.utils"].make_tp_sharded_tensor_for_checkpoint = _Placeholder
        transformer = os.path.join(checkout(), "megatron", "core", "transformer")
        megatron._package("megatron.core.transformer", transformer)
        sys.meta_path.insert(0, _Placeholders())
        try:
            import megatron.core.transformer.multi_token_prediction as mtp
        finally:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Placeholders)]
        _module = mtp
    return _module


def _main_loss_tokens(ctx):
    """The step's main-loss token count (finalize_model_grads' num_tokens): every micro-batch's main-loss
    mask, summed over DP x CP. Computed at this rank's first call; the runs give every rank rows."""
    if "mtp_main_tokens" not in ctx.state:
        local = sum(int(_extended(mb, mb.labels)[1].sum()) for mb in ctx.micro_batches)
        count = torch.tensor([local], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(count, group=ctx.dp_cp_group)
        ctx.state["mtp_main_tokens"] = count.item()
    return ctx.state["mtp_main_tokens"]


def _sequences(micro_batch):
    """[(begin, end)] of each packed sequence's rows in a micro-batch."""
    ids = micro_batch.sequences.tolist()
    spans, begin = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[begin]:
            spans.append((begin, i))
            begin = i
    return spans


def _extended(micro_batch, labels, logits=None):
    """The main loss's labels and mask (one position more in front of each sequence) and, given the logits,
    the MTP logits (one row more at the end of each sequence), with the packed sequences' offsets."""
    spans = _sequences(micro_batch)
    mask = micro_batch.loss_mask.float()
    one = torch.ones(1, dtype=mask.dtype, device=mask.device)
    zero_label = torch.zeros(1, dtype=labels.dtype, device=labels.device)
    main_labels = torch.cat([torch.cat([zero_label, labels[a:b]]) for a, b in spans])
    main_mask = torch.cat([torch.cat([one, mask[a:b]]) for a, b in spans])
    offsets = [0]
    for a, b in spans:
        offsets.append(offsets[-1] + b - a + 1)
    mtp_logits = None
    if logits is not None:
        pad = torch.zeros(1, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        mtp_logits = torch.cat([torch.cat([logits[a:b], pad]) for a, b in spans])
    return main_labels, main_mask, offsets, mtp_logits


def mtp_per_token_loss(logits, labels, ctx):
    """One MTP layer in per-token mode: process_mtp_loss(hidden, main labels, main mask, ...) with
    config.calculate_per_token_loss, its gradient back-propagated through MTPLossAutoScaler."""
    mtp = _load()
    ignore = ctx.loss.ignore_index
    main_tokens = _main_loss_tokens(ctx)
    main_labels, main_mask, offsets, mtp_logits = _extended(ctx.current, torch.where(labels == ignore, 0, labels),
                                                            logits)
    rows = main_labels.shape[0]

    def output_layer(hidden, weight=None, runtime_gather_output=None):
        return mtp_logits.unsqueeze(1), None  # [s, b, v_local]

    def compute_language_model_loss(layer_labels, layer_logits):  # LanguageModule's: labels [b, s]
        loss = megatron._load()(layer_logits.float(), layer_labels.transpose(0, 1).contiguous(), 0.0,
                                tp_group=ctx.tp_group)
        return loss.transpose(0, 1).contiguous()

    config = types.SimpleNamespace(mtp_num_layers=1, mtp_loss_scaling_factor=1.0, calculate_per_token_loss=True,
                                   mtp_detach_heads=False)
    packed = types.SimpleNamespace(cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32))
    hidden = torch.zeros(2 * rows, 1, 1, device=logits.device, requires_grad=True)
    mtp.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / main_tokens, device=logits.device))
    out = mtp.process_mtp_loss(hidden, main_labels.unsqueeze(0), main_mask.unsqueeze(0), output_layer, None, None,
                               False, compute_language_model_loss, config, tp_group=ctx.tp_group,
                               packed_seq_params=packed)
    # What the gradient differentiates: the normalised MTP loss process_mtp_loss hands MTPLossAutoScaler (its
    # saved tensor), times the loss scale. The returned loss carries that value; its gradient is the scaler's.
    normalised = out.grad_fn.saved_tensors[0]
    value = normalised.detach().sum() / main_tokens
    return Reduced(out.sum() * 0.0 + value)
