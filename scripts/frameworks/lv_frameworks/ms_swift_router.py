"""ms-swift's Megatron trainers (Megatron-SWIFT) around Megatron-LM's MoE router losses: what ms-swift decides for them,
driven around the real `TopKRouter` of the Megatron-LM checkout that LV_MEGATRON_CHECKOUT names (the megatron_router
adapter's machinery: its stubs, routers, the schedule's `forward_step_calc_loss` setting MoEAuxLossAutoScaler's
scale, and the logged values read back).

ms-swift trains through Megatron's own schedule (`BaseMegatronTrainer.train_step`: `forward_backward_func`, and
Megatron's `finalize_model_grads`) on the GPTModel of mcore-bridge, whose TopKRouter subclass only adds a
vision-language expert bias (off unless moe_router_enable_vl_bias) and leaves the losses to Megatron's. It touches
neither MoEAuxLossAutoScaler nor the router's losses. What it decides:
- calculate_per_token_loss (swift/megatron/arguments/megatron_args.py): on by default for causal-LM training
  (pretraining, SFT), off for RLHF (rlhf_args.py: GRPO, DPO, ...);
- the router settings: moe_aux_loss_coeff 0 by default (its docs' examples set 1e-3 or 1e-6), the load-balancing
  type read from the model's config.json (mcore-bridge: aux_loss by default, seq_aux_loss for the DeepSeek family),
  moe_z_loss_coeff None; the runs use each case's;
- the router's input: padding_free (the default) packs a micro-batch's samples into one thd stream, each padded to a
  multiple of 2 CP at CP > 1 (template `_handle_megatron_cp`, labels -100) and split into its zigzag chunks
  (`get_batch_on_this_cp_rank`), the stream padded to a multiple of TP under SP (times CP at CP > 1;
  `get_padding_to`); forward_step passes the model no padding_mask. So the router sees one column holding every
  token of the rank, padding included, and counts them all (megatron_router.packed_input). Lossverify pads each
  sequence to a multiple of 2 CP at CP 1 too; ms-swift does not, and at TP 1 adds no stream padding either: there
  those rows are left out of the stream;
- in per-token mode, the count finalize_model_grads divides every gradient by: the second item
  `MegatronTrainer.loss_func` (swift/megatron/trainers/trainer.py) returns, the rank's labels != -100 (the labels
  rolled one position left by `get_batch_on_this_pp_rank`, then split over CP), summed over the step's
  micro-batches and DP x CP. It is taken here from ms-swift's own loss_func on the CP rank's labels (zero per-token
  losses; only the count is used), and the gradient reaching the router's logits is multiplied by N / that count,
  N being the harness's divisor.

How a case becomes ms-swift's labels (_labels): the labels are rolled one position left over the micro-batch's
stream, so position p is labelled when the next token is a target: in SFT a valid token of the same sample past its
prompt (one token here), in pretraining (`megatron pt`) any valid token. A masked token is no target. Every row of
the stream is routed (masked rows and padding included), as ms-swift routes its padding.

Stubbed for loss_func: `swift.megatron.trainers.base` (BaseMegatronTrainer as a plain class: base.py imports
mcore_bridge, Megatron's DDP, optimizer and the training loop), `swift.utils` (its logger), the swift package
__init__ files, and megatron.core.mpu (the run's DP x CP group). ms-swift supports megatron-core >= 0.16, < 0.20
(docs: 0.18.0 recommended).
"""
import logging
import os
import sys
import types

import torch
import torch.distributed as dist

from lv_frameworks import checkout, git_commit, stub_module
from lv_frameworks import megatron_router
from lv_frameworks.single_gpu import package_shell

NAME = "ms-swift"
# Megatron's router entries, the per-token scale first: at TP 1, CP 2 it and moe-aux-cp-missing both halve the
# gradient, and per-token mode's 1/(TP CP) is the mechanism there.
EXPLANATIONS = ["moe-aux-per-token-tp-cp"] + [b for b in megatron_router.EXPLANATIONS if b != "moe-aux-per-token-tp-cp"]
MEGATRON = os.path.abspath(os.environ.get("LV_MEGATRON_CHECKOUT", ""))  # checked where it is first needed
_loaded = {}
_groups = {"dp_cp": None, "dp": None}


def _load():
    """The Megatron-LM router ms-swift trains with, then ms-swift's trainer module (its loss_func)."""
    if not _loaded:
        if not os.path.isdir(os.path.join(MEGATRON, "megatron", "core")):
            raise RuntimeError("ms-swift trains through Megatron-LM's router: set LV_MEGATRON_CHECKOUT to a "
                               "Megatron-LM checkout")
        megatron_router._load(MEGATRON)
        mpu = stub_module("megatron.core.mpu", get_data_parallel_group=lambda with_context_parallel=False:
                          _groups["dp_cp"] if with_context_parallel else _groups["dp"])
        sys.modules["megatron.core"].mpu = mpu
        root = os.path.join(checkout(), "swift")
        package_shell("swift", root)
        package_shell("swift.megatron", os.path.join(root, "megatron"))
        package_shell("swift.megatron.trainers", os.path.join(root, "megatron", "trainers"))
        stub_module("swift.utils", get_logger=lambda *a, **k: logging.getLogger("swift"))
        stub_module("swift.megatron.trainers.base", BaseMegatronTrainer=type("BaseMegatronTrainer", (), {}))
        from swift.megatron.trainers import trainer
        _loaded["trainer"] = trainer
    return _loaded


def _labels(rows, ctx, pretraining):
    """The CP rank's labels for one micro-batch as ms-swift's loss_func gets them (module docstring): 0 where a
    position carries a label, -100 elsewhere, over the rank's CP-local stream (every TP part, in order). The labels
    are rolled one position left over the micro-batch's whole stream (get_batch_on_this_pp_rank, before the CP
    split): position p is labelled when the stream's next token is a target, which in SFT (`pretraining` False) is
    a valid token of the same sample past its one-token prompt, and in pretraining (megatron pt, labels =
    input_ids) any valid token, the roll wrapping the first sample's first token to the stream's end."""
    stream = [r for r in rows if _in_stream(ctx, r)]
    order = sorted({(r[2], r[3]) for r in stream})  # the micro-batch's stream before the CP split: by sequence
    valid = {(r[2], r[3]): bool(r[5]) and r[4] >= 0 for r in stream}
    labelled = {}
    for i, (s, p) in enumerate(order):
        s_next, p_next = order[(i + 1) % len(order)]
        labelled[(s, p)] = valid[(s_next, p_next)] and (pretraining or (s_next == s and p_next >= 1))
    labels = [0 if labelled[(r[2], r[3])] else -100 for r in stream if r[1] == ctx.cp_rank]
    return torch.tensor([labels], dtype=torch.long)


def _in_stream(ctx, row):
    """Whether a case row is a token of ms-swift's stream: every row, except at CP 1 without SP lossverify's padding
    rows of odd-length sequences (ms-swift pads neither samples nor the stream there)."""
    return ctx.cp_size > 1 or ctx.sp or row[4] >= 0


def _finalize_count(ctx, pretraining):
    """What finalize_model_grads divides by in per-token mode: the local_num_tokens ms-swift's loss_func returns for
    each of the rank's micro-batches, summed, all-reduced over DP x CP. Computed at the step's first call."""
    if "swift_num_tokens" not in ctx.state:
        trainer = _load()["trainer"]
        _groups.update(dp_cp=ctx.dp_cp_group, dp=ctx.dp_group)
        owner = types.SimpleNamespace(args=types.SimpleNamespace(enable_dft_loss=False, enable_channel_loss=False))
        total = 0.0
        for rows in megatron_router.step_rows(ctx):
            labels = _labels(rows, ctx, pretraining)
            losses = torch.zeros(labels.shape, dtype=torch.float32)
            _, num_tokens, _ = trainer.MegatronTrainer.loss_func(owner, losses, labels=labels)
            total += float(num_tokens)
        count = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(count, group=ctx.dp_cp_group)
        ctx.state["swift_num_tokens"] = float(count)
    return ctx.state["swift_num_tokens"]


def _step(logits, ctx, pretraining):
    _load()
    config, routers = megatron_router._routers(ctx)
    factor = 1.0
    if ctx.loss.scaling == "per_token":
        factor = float(ctx.num_valid_tokens) / max(_finalize_count(ctx, pretraining), 1.0)
    keep = None if (ctx.cp_size > 1 or ctx.sp) else ctx.tokens >= 0
    return megatron_router.route(logits, ctx, config, routers, megatron_router.packed_input(keep), grad_factor=factor)


def router_step(logits, labels, ctx):
    """One micro-batch as Megatron-SWIFT (padding_free) routes it in SFT (`megatron sft`): the rank's packed stream
    (at CP 1 without SP the case's padding rows left out: ms-swift pads there neither samples nor the stream)
    through the checkout's TopKRouter.routing per layer (megatron_router.route), with the schedule's scale for the
    mode; in per-token mode finalize divides by ms-swift's label count, SFT's."""
    return _step(logits, ctx, pretraining=False)


def router_step_pt(logits, labels, ctx):
    """The same in pretraining (`megatron pt`: every token a target), where the label count is the valid tokens'."""
    return _step(logits, ctx, pretraining=True)


def megatron_commit():
    """The Megatron-LM commit judged: LV_MEGATRON_COMMIT where the checkout is an exported (or patched) copy."""
    return os.environ.get("LV_MEGATRON_COMMIT") or git_commit(MEGATRON)


def describe(path):
    return {"commit": git_commit(path),
            "source": f"swift/megatron/trainers/trainer.py (loss_func), arguments/megatron_args.py, template packing; "
                      f"Megatron-LM {megatron_commit()} router.py (TopKRouter), moe_utils.py, "
                      f"schedules.py"}


def runs(cases):
    """megatron_router.framework_runs, per-token mode in pretraining (every valid token labelled: the router's count
    and the label count agree), and the SFT label count at the layouts without padding."""
    return megatron_router.framework_runs(__name__, cases, per_token="router_step_pt", labels="router_step")
