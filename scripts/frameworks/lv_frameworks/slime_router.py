"""slime's Megatron backend around Megatron-LM's MoE router losses: what slime decides for them, driven around the
real `TopKRouter` of the Megatron-LM checkout that LV_MEGATRON_CHECKOUT names (the megatron_router adapter's
machinery: its stubs, routers, the schedule's `forward_step_calc_loss` setting MoEAuxLossAutoScaler's scale, and the
logged values read back).

slime trains through Megatron's own schedule (`forward_backward_func`, `finalize_model_grads`) and its own
TransformerConfig flags; it touches neither MoEAuxLossAutoScaler nor the router. What it decides:
- the router's input: `get_batch` (backends/megatron_utils/data.py) packs the micro-batch's samples into one thd
  stream, each sample padded to a multiple of 2 CP by `slice_with_cp` and split into its zigzag chunks, the stream
  padded to a multiple of TP x data_pad_size_multiplier; `model.py`'s forward_step passes GPTModel input_ids,
  packed_seq_params and loss_mask, no padding_mask. So the router sees one column holding every token of the rank,
  padding included, and counts them all (megatron_router.packed_input);
- calculate_per_token_loss (Megatron's flag, slime's `--calculate-per-token-loss`; off by default, on in its SFT
  scripts), which selects the scaler's scale in the schedule and the router's own per-token scaling;
- in per-token mode, the count finalize_model_grads divides every gradient by: the second item `loss_function`
  (backends/megatron_utils/loss.py) returns, num_tokens = sum over the micro-batch's samples of
  max(loss_mask.sum(), 1) with each sample's whole (not CP-split) loss mask, summed over the step's micro-batches
  and DP x CP. It is taken here from slime's own loss_function (the `custom_loss` path with a main loss of 0:
  `main_loss_placeholder`; only the count is used), and the gradient reaching the router's logits is multiplied
  by N / that count, N being the harness's divisor;
- the router settings come from Megatron's arguments: slime sets none of them (its shipped model scripts pass
  `--moe-aux-loss-coeff 0`, most with `--moe-router-load-balancing-type seq_aux_loss`); the runs use each case's.

How a case becomes slime's samples: each sequence of the micro-batch with a row on some rank of its sequence
partition is one sample of L tokens (its positions with a token), prompt length 1, response length L - 1, response
token j being the token at position j + 1 and its loss mask the case's mask there (a masked token is no target).
Every row the rank holds is a token of the stream, routed and counted: the case's masked rows, and its padding rows,
which stand for slime's padding (each sample's to 2 CP at CP > 1, as lossverify's; at CP 1 the stream's to a multiple
of TP x 128, of which a case holds only its few rows of odd-length sequences).

The stubs are the megatron_router adapter's (Megatron) and the slime adapter's (slime's loss module: its
megatron.core.mpu answering the run's groups, package shells, unrelated imports). The Megatron-LM checkout slime
ships with is its Dockerfile's MEGATRON_COMMIT (1dcf0daf) with docker/patch/latest/megatron.patch applied (the
patch's router and moe_utils hunks only register slime's routing replay, inactive unless ENABLE_ROUTING_REPLAY).
"""
import os
from argparse import Namespace

import torch
import torch.distributed as dist

from lv_frameworks import git_commit
from lv_frameworks import megatron_router, slime

NAME = "slime"
# Megatron's router entries, the per-token scale first: at TP 1, CP 2 it and moe-aux-cp-missing both halve the
# gradient, and per-token mode's 1/(TP CP) is the mechanism there.
EXPLANATIONS = ["moe-aux-per-token-tp-cp"] + [b for b in megatron_router.EXPLANATIONS if b != "moe-aux-per-token-tp-cp"]
MEGATRON = os.path.abspath(os.environ.get("LV_MEGATRON_CHECKOUT", ""))  # checked where it is first needed
_loaded = {}


def _load():
    """slime's loss module (the slime adapter's stubs), then the Megatron-LM router slime trains with."""
    if not _loaded:
        if not os.path.isdir(os.path.join(MEGATRON, "megatron", "core")):
            raise RuntimeError("slime trains through Megatron-LM's router: set LV_MEGATRON_CHECKOUT to a Megatron-LM "
                               "checkout")
        _loaded.update(slime._load())
        megatron_router._load(MEGATRON)
    return _loaded


def main_loss_placeholder(args, batch, logits, sum_of_sample_mean):
    """The main loss loss_function dispatches to (its custom_loss path): 0, depending on the logits. Only the count
    loss_function returns beside it is used."""
    return logits.sum() * 0.0, {}


def _samples(rows):
    """slime's batch fields for one micro-batch (module docstring): per sample its total and response lengths, its
    whole response loss mask and its mask sum."""
    length, valid = {}, {}
    for _, _, s, p, t, m in rows:
        if s < 0:
            continue
        length.setdefault(s, 0)
        if t >= 0:
            length[s] = max(length[s], p + 1)
            valid[(s, p)] = m
    batch = {"total_lengths": [], "response_lengths": [], "loss_masks": [], "rollout_mask_sums": []}
    for s in sorted(length):
        total = length[s]
        response = max(total - 1, 0)
        loss_mask = torch.tensor([float(valid.get((s, j + 1), 0)) for j in range(response)])
        batch["total_lengths"].append(total)
        batch["response_lengths"].append(response)
        batch["loss_masks"].append(loss_mask)
        batch["rollout_mask_sums"].append(loss_mask.sum())
    return batch


def _finalize_count(ctx):
    """What finalize_model_grads divides by in per-token mode: the num_tokens slime's loss_function returns for each
    of the rank's micro-batches, summed, all-reduced over DP x CP. Computed at the step's first call."""
    if "slime_num_tokens" not in ctx.state:
        modules = _load()
        slime._state["ctx"] = ctx
        args = Namespace(loss_type="custom_loss", custom_loss_function_path=f"{__name__}.main_loss_placeholder",
                         calculate_per_token_loss=True, recompute_loss_function=False, allgather_cp=False)
        total = 0.0
        for rows in megatron_router.step_rows(ctx):
            batch = _samples(rows)
            placeholder_logits = torch.zeros(1, 1, 1, requires_grad=True)
            _, num_tokens, _ = modules["loss"].loss_function(args, batch, ctx.ga, len(batch["total_lengths"]),
                                                             placeholder_logits)
            total += float(num_tokens)
        count = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(count, group=ctx.dp_cp_group)
        ctx.state["slime_num_tokens"] = float(count)
    return ctx.state["slime_num_tokens"]


def _step(logits, ctx, keep):
    _load()
    config, routers = megatron_router._routers(ctx)
    factor = 1.0
    if ctx.loss.scaling == "per_token":
        factor = float(ctx.num_valid_tokens) / max(_finalize_count(ctx), 1.0)
    return megatron_router.route(logits, ctx, config, routers, megatron_router.packed_input(keep), grad_factor=factor)


def router_step(logits, labels, ctx):
    """One micro-batch as slime's Megatron backend routes it: every row of the rank a token of the packed stream
    (the case's padding rows standing for slime's padding: per sample to 2 CP at CP > 1, the stream to a multiple
    of TP x 128, which slime adds at CP 1 too), through the checkout's TopKRouter.routing per layer
    (megatron_router.route) with the schedule's scale for slime's mode; in per-token mode finalize divides by
    slime's num_tokens."""
    return _step(logits, ctx, None)


def megatron_commit():
    """The Megatron-LM commit judged: LV_MEGATRON_COMMIT where the checkout is an exported (or patched) copy."""
    return os.environ.get("LV_MEGATRON_COMMIT") or git_commit(MEGATRON)


def describe(path):
    return {"commit": git_commit(path),
            "source": f"slime/backends/megatron_utils/loss.py (loss_function), data.py, cp_utils.py; Megatron-LM "
                      f"{megatron_commit()} router.py (TopKRouter), moe_utils.py, schedules.py"}


def runs(cases):
    return megatron_router.framework_runs(__name__, cases)
