"""Liger-Kernel's fused LM-head losses on lossverify's LM-head cases (`head-*`), imported from a checkout's src/ as its
users import them:

- the fused linear cross entropy, `liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`
  (`LigerFusedLinearCrossEntropyFunction`, src/liger_kernel/ops/fused_linear_cross_entropy.py; Triton, GPU only):
  it splits a micro-batch's rows into chunks, takes each chunk's logits `h_c @ W^T (+ b)` in the inputs' dtype, runs
  the Triton cross-entropy kernel on them (the loss, and the logits' gradient written over the logits in place), and
  forms dh, dW and db in the forward (reduction mean/sum; grad_output is multiplied in by its backward) or, under
  reduction "none", in its backward with the per-token upstream gradient folded in. Its chunk count is not an
  option: `inc_factor = ceil(V / H)`, `chunk_size = next_power_of_2(ceil(BT / inc_factor))`, `ceil(BT / chunk_size)`
  chunks of the BT rows handed to it. dW is accumulated over the chunks in W's dtype unless `accum_dtype` is given.
  Its options map onto the cases' settings: bias, ignore_index, label_smoothing (the pytorch convention),
  lse_square_scale (the z-loss weight), softcap, reduction. It has no vocabulary-parallel form: tp 1 only.
- the chunked distillation loss `liger_kernel.chunked_loss.LigerFusedLinearJSDLoss` (jsd_loss.py on
  fused_linear_distillation.py, pure PyTorch, torch.func.grad_and_value per chunk of `chunk_size` rows) on the KD head
  case: at `beta=0` its generalised JSD is `F.kl_div(log Q, log P, log_target=True)` summed over the vocabulary,
  KL(P || Q) with both softmaxes at temperature T, the case's forward KL; it has no T^2 factor (the case's
  t2_scaling is turned off, or `weight_soft_loss = T^2` given instead), and the hard (cross-entropy) term is weighted
  0. It takes the teacher as hidden states and a weight (`teacher_input @ teacher_weight^T`): the case's teacher
  logits are handed in as the teacher's input with an identity teacher weight (exact: one nonzero product per
  logit). At 0 < beta < 1 it is a generalised JSD and at beta = 1 KL(Q || P): neither is the case's KD.
- the chunked policy loss `liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss` (grpo_loss.py on fused_linear_ppo.py,
  pure PyTorch: per chunk of `chunk_size` sequences, the selected tokens' log-probabilities from a custom autograd
  function over vocabulary chunks, the loss's gradient by torch.autograd.grad) on the policy head case: the clip
  (`epsilon_low`, `epsilon_high`), the k3 KL to the reference (`beta`), the temperature, and the dual clip c as its
  `delta` (coef_1 clamped at delta: for A < 0 that is min(l_pg, -c A), for A > 0 no change since delta > 1 +
  epsilon_high; the same value and gradient as the case's dual clip). loss_type "dapo" with `num_items_in_batch` =
  the step's valid tokens N is its token-mean (TRL's path: the normaliser N / world_size, DDP's mean over the
  world's ranks making it 1/N). It has no entropy bonus: the case's entropy_coef is turned off.

What is written out here, as a trainer does it: the model's output weight in the model's dtype (`W.to(ctx.dtype)`,
bf16 parameters, as Liger's users train with a bf16 model), or the float32 master weight under
`torch.autocast(dtype=ctx.dtype)` (`flce_*_amp`); the micro-batch's rows as one batch (`[rows, H]`, or for the policy
loss `[sequences, longest]` with each packed sequence's rows padded and masked); and a trainer's normalisation of a
micro-batch's token mean: `loss * n_micro_batch / ctx.num_valid_tokens / ctx.framework_factor` (the step's
all-reduced count, as torchtune's recipe and HF's `num_items_in_batch` do), or for reduction "sum" `loss /
ctx.num_valid_tokens / ctx.framework_factor`; reduction "none" returns the per-token losses for the harness's
upstream weights. The loss modules are loaded unmodified. Stubbed, none of their math: under torch < 2,
`torch._dynamo` (`maybe_mark_dynamic`, a compile hint, made a no-op; torch.compile is off: `compiled=False`) and
`torch.func` (torch 1.13's `functorch`, whose `grad_and_value` became `torch.func.grad_and_value` in torch 2.0).
"""
import importlib
import os
import sys

import torch

from lossverify.torch import Reduced
from lv_frameworks import Run, adapt, checkout, cross_entropy_cases, git_commit, stub_module

NAME = "Liger-Kernel head"
EXPLANATIONS = ["head-dw-16bit-accumulate", "head-grad-output-first", "head-bias-repeated", "head-smoothing-dropped",
                "head-softcap-dropped", "head-target-rounded-early", "grad-rounded-early", "kd-no-t2",
                "rl-logprob-16bit", "rl-microbatch-self-normalized"]
KD_CHUNKS = (1024, 8)  # LigerFusedLinearJSDLoss's default chunk_size (one chunk here), and 8 rows a chunk
POLICY_CHUNKS = (1, 4)  # LigerFusedLinearGRPOLoss's default chunk_size (sequences a chunk), and 4
_loaded = {}


def _src():
    path = os.path.join(checkout(), "src")
    if path not in sys.path:
        sys.path.insert(0, path)


def _torch_before_2():
    return int(torch.__version__.split(".")[0]) < 2


def _flce():
    if "flce" not in _loaded:
        _src()
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        _loaded["flce"] = liger_fused_linear_cross_entropy
    return _loaded["flce"]


def _chunked_loss():
    """liger_kernel.chunked_loss as its users import it (its __init__ imports every chunked loss)."""
    if "chunked" not in _loaded:
        _src()
        if _torch_before_2():
            if "torch._dynamo" not in sys.modules:
                dynamo = stub_module("torch._dynamo", maybe_mark_dynamic=lambda tensor, dim: None)
                dynamo.config = stub_module("torch._dynamo.config")
                torch._dynamo = dynamo
            if not hasattr(torch, "func"):
                torch.func = importlib.import_module("functorch")
        _loaded["chunked"] = importlib.import_module("liger_kernel.chunked_loss")
    return _loaded["chunked"]


def _valid(labels, ctx):
    return (labels != ctx.loss.ignore_index).sum()


# The fused linear cross entropy (Triton).

def _flce_call(h, weight, bias, labels, ctx, reduction, accum_dtype=None):
    return _flce()(h, weight, labels, bias=bias, ignore_index=ctx.loss.ignore_index,
                   lse_square_scale=ctx.loss.z_loss_weight, label_smoothing=ctx.loss.label_smoothing,
                   reduction=reduction, softcap=ctx.loss.softcap or None, accum_dtype=accum_dtype)


def _model_weights(W, b, ctx):
    """The output layer's parameters in the model's dtype (the dtype's values: exact)."""
    return W.to(ctx.dtype), (b.to(ctx.dtype) if b is not None else None)


def _scaled(value, labels, ctx, reduction):
    """A trainer's normalisation of the micro-batch's loss: the step's token mean over DP x CP x GA."""
    if reduction == "mean":
        value = value * _valid(labels, ctx)
    return Reduced(value / ctx.num_valid_tokens / ctx.framework_factor)


def _flce_reduced(h, W, b, labels, ctx, reduction, accum_dtype=None):
    weight, bias = _model_weights(W, b, ctx)
    return _scaled(_flce_call(h, weight, bias, labels, ctx, reduction, accum_dtype), labels, ctx, reduction)


def flce_mean(h, W, b, labels, ctx):
    """reduction "mean" (the micro-batch's token mean), dW accumulated in W's dtype (accum_dtype None)."""
    return _flce_reduced(h, W, b, labels, ctx, "mean")


def flce_mean_fp32acc(h, W, b, labels, ctx):
    """reduction "mean", accum_dtype=torch.float32 (dW and db accumulated over the chunks in fp32)."""
    return _flce_reduced(h, W, b, labels, ctx, "mean", torch.float32)


def flce_sum(h, W, b, labels, ctx):
    """reduction "sum", divided by the step's token count."""
    return _flce_reduced(h, W, b, labels, ctx, "sum")


def flce_mean_amp(h, W, b, labels, ctx):
    """reduction "mean" on the float32 master weight under torch.autocast(dtype=ctx.dtype) (mixed precision)."""
    with torch.autocast(device_type=h.device.type, dtype=ctx.dtype):
        value = _flce_call(h, W, b, labels, ctx, "mean")
    return _scaled(value, labels, ctx, "mean")


def flce_none(h, W, b, labels, ctx):
    """reduction "none": per-token losses, the harness's upstream weights folded in by Liger's backward."""
    weight, bias = _model_weights(W, b, ctx)
    return _flce_call(h, weight, bias, labels, ctx, "none")


def flce_none_fp32acc(h, W, b, labels, ctx):
    """reduction "none", accum_dtype=torch.float32."""
    weight, bias = _model_weights(W, b, ctx)
    return _flce_call(h, weight, bias, labels, ctx, "none", torch.float32)


def flce_none_amp(h, W, b, labels, ctx):
    """reduction "none" on the float32 master weight under torch.autocast(dtype=ctx.dtype)."""
    with torch.autocast(device_type=h.device.type, dtype=ctx.dtype):
        return _flce_call(h, W, b, labels, ctx, "none")


# The chunked distillation loss (pure PyTorch).

def _kd(h, W, b, labels, ctx, chunk_size, weight_soft_loss):
    loss = _chunked_loss().LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=weight_soft_loss, beta=0.0,
                                                   ignore_index=-100, temperature=ctx.loss.temperature,
                                                   compiled=False, chunk_size=chunk_size)
    mask = ctx.loss_mask.bool()
    # the KD kind has no labels: the masked-out rows are the ignored ones (the hard loss, weighted 0, reads the rest)
    target = torch.where(mask, torch.zeros_like(labels), torch.full_like(labels, -100))
    teacher = ctx.teacher_logits.detach()
    identity = torch.eye(teacher.shape[1], device=teacher.device).to(teacher.dtype)
    weight, bias = _model_weights(W, b, ctx)
    value = loss(h, weight, teacher, identity, target, bias)
    return Reduced(value * mask.sum() / ctx.num_valid_tokens / ctx.framework_factor)


def kd_forward_kl(h, W, b, labels, ctx):
    """LigerFusedLinearJSDLoss(beta=0): KL(P || Q) at T, no T^2 (run with the case's t2_scaling off); 1024 rows a
    chunk (its default)."""
    return _kd(h, W, b, labels, ctx, KD_CHUNKS[0], 1.0)


def kd_forward_kl_chunk8(h, W, b, labels, ctx):
    """The same, 8 rows a chunk."""
    return _kd(h, W, b, labels, ctx, KD_CHUNKS[1], 1.0)


def kd_forward_kl_t2(h, W, b, labels, ctx):
    """LigerFusedLinearJSDLoss(beta=0, weight_soft_loss=T^2): the case's T^2 scaling as the loss's weight."""
    return _kd(h, W, b, labels, ctx, KD_CHUNKS[0], ctx.loss.temperature ** 2)


# The chunked policy loss (pure PyTorch).

def _batched(ctx, rows):
    """The micro-batch's rows as [sequences, longest]: (index into the rows, or -1 on padding) per slot."""
    order = {}
    for row, sequence in enumerate(ctx.sequences.tolist()):
        order.setdefault(sequence, []).append(row)
    longest = max(len(r) for r in order.values())
    index = torch.full((len(order), longest), -1, dtype=torch.int64)
    for i, members in enumerate(order.values()):
        index[i, :len(members)] = torch.tensor(members, dtype=torch.int64)
    return index.to(rows.device)


def _padded(values, index, fill=0):
    out = values[index.clamp(min=0)]
    held = (index >= 0).view(*index.shape, *([1] * (values.dim() - 1)))
    return torch.where(held, out, torch.full_like(out, fill))


def _policy(h, W, b, labels, ctx, chunk_size, model_dtype_weight):
    loss_config = ctx.loss
    index = _batched(ctx, h)
    mask = _padded(ctx.loss_mask.to(torch.float32), index)
    hidden = _padded(h, index)  # [B, T, H]: autograd carries dh back to the rows
    tokens = _padded(torch.where(labels >= 0, labels, torch.zeros_like(labels)), index)
    advantages = ctx.whitened_advantages() if loss_config.whiten_advantages else ctx.advantages
    first = index[:, 0]
    weight, bias = (_model_weights(W, b, ctx) if model_dtype_weight else (W, b))
    loss = _chunked_loss().LigerFusedLinearGRPOLoss(
        beta=loss_config.kl_coef, compiled=False, use_ref_model=loss_config.kl_coef != 0.0, chunk_size=chunk_size,
        epsilon_low=loss_config.clip_low, epsilon_high=loss_config.clip_high, loss_type="dapo",
        importance_sampling_level=loss_config.ratio, temperature=loss_config.temperature,
        delta=loss_config.dual_clip or None)
    value, _metrics = loss(hidden, weight, tokens, mask, advantages[first].to(torch.float32), bias,
                           ref_per_token_logps=_padded(ctx.ref_logprob, index),
                           old_per_token_logps=_padded(ctx.old_logprob, index),
                           num_items_in_batch=ctx.num_valid_tokens)
    return Reduced(value)


def grpo_dapo(h, W, b, labels, ctx):
    """LigerFusedLinearGRPOLoss(loss_type="dapo", num_items_in_batch=N) on the float32 master weight, one sequence a
    chunk (its default)."""
    return _policy(h, W, b, labels, ctx, POLICY_CHUNKS[0], False)


def grpo_dapo_chunk4(h, W, b, labels, ctx):
    """The same, 4 sequences a chunk."""
    return _policy(h, W, b, labels, ctx, POLICY_CHUNKS[1], False)


def grpo_dapo_model_dtype(h, W, b, labels, ctx):
    """The same on the model's 16-bit weight (dW accumulated over the chunks in its dtype), one sequence a chunk."""
    return _policy(h, W, b, labels, ctx, POLICY_CHUNKS[0], True)


def describe(path):
    return {"commit": git_commit(path),
            "source": "src/liger_kernel/ops/fused_linear_cross_entropy.py, src/liger_kernel/chunked_loss/"
                      "jsd_loss.py, fused_linear_distillation.py, grpo_loss.py, fused_linear_ppo.py"}


def _flat_layout(case):
    layout = case.get("layout", {})
    return {"tp": 1, "cp": layout.get("cp", 1), "dp": layout.get("dp", 1), "ga": layout.get("ga", 1)}


def _dtypes(case):
    """The case's dtype first, then the other of fp32 and bf16."""
    first = case.get("inputs", {}).get("dtype", "fp32")
    return [first, "bf16" if first == "fp32" else "fp32"]


def runs(cases):
    """The LM-head cases at tp 1 with the case's cp, dp and ga (no sequence parallelism), in the case's dtype and in
    the other of fp32 and bf16. Cross entropy: reduction mean (accum_dtype default and fp32, and under autocast on
    the fp32 master weight) and sum, or, on the upstream-weights case, reduction none; smoothing in the pytorch
    convention. KD: beta 0 with t2_scaling off, at 1024 and 8 rows a chunk, and with weight_soft_loss = T^2 on the
    case as it is. Policy: loss_type dapo with num_items_in_batch, the entropy bonus off, on the float32 master weight
    at 1 and 4 sequences a chunk and on the model's weight."""
    out = []
    for name, case, loss in cross_entropy_cases(cases):
        if case.get("stage", {}).get("kind") != "lm_head":
            continue
        overrides, notes = adapt(loss, convention="pytorch")
        if case.get("layout", {}).get("sp"):
            overrides["layout.sp"] = False
            notes.append("no sequence parallelism")
        upstream = "upstream_weights" in loss
        for dtype in _dtypes(case):
            these, said = dict(overrides), list(notes)
            if dtype != _dtypes(case)[0]:
                these["inputs.dtype"] = dtype
                said.append(dtype)
            if upstream:
                functions = ["flce_none"] + (["flce_none_fp32acc", "flce_none_amp"] if dtype != "fp32" else [])
            else:
                functions = ["flce_mean", "flce_sum"] + (["flce_mean_fp32acc", "flce_mean_amp"]
                                                         if dtype != "fp32" else [])
            for function in functions:
                out.append(Run(f"{__name__}:{function}", name, _flat_layout(case), these, ", ".join(said)))
    for name, case in sorted(cases.items()):
        if case.get("stage", {}).get("kind") != "lm_head":
            continue
        kind = case.get("loss", {}).get("kind")
        for dtype in _dtypes(case) if kind in ("kd", "policy") else []:
            base = {} if dtype == _dtypes(case)[0] else {"inputs.dtype": dtype}
            said = [] if not base else [dtype]
            if kind == "kd":
                off = {**base, "loss.t2_scaling": False}
                for function in ("kd_forward_kl", "kd_forward_kl_chunk8"):
                    out.append(Run(f"{__name__}:{function}", name, _flat_layout(case), off,
                                   ", ".join(["no T^2"] + said)))
                out.append(Run(f"{__name__}:kd_forward_kl_t2", name, _flat_layout(case), base, ", ".join(said)))
            else:
                off = dict(base)
                if case["loss"].get("entropy_coef", 0):
                    off["loss.entropy_coef"] = 0
                notes = ", ".join(["no entropy bonus"] + said)
                functions = ["grpo_dapo", "grpo_dapo_chunk4"] + (["grpo_dapo_model_dtype"] if dtype != "fp32" else [])
                for function in functions:
                    out.append(Run(f"{__name__}:{function}", name, _flat_layout(case), off, notes))
    return out

