"""OpenRLHF's policy loss (`openrlhf/models/loss.py`: `PolicyLoss`, ppo with optional dual clip, or gspo, and
`aggregate_loss`) with its helpers (`openrlhf/models/utils.py`: `log_probs_from_logits`, `compute_entropy`,
`compute_approx_kl`), imported from a checkout, with the arithmetic of its Ray PPO actor around them
(`trainer/ray/ppo_actor.py` `training_step`, `utils/loss_utils.py` `iter_grad_accum_global_norm`):

  normalisers  batch_num_tokens = (valid tokens of the optimizer step, summed over DP) / gas and
               global_batch_size = (non-empty sequences of the step over DP) / gas, with dp_size;
  model        (Actor.forward) logits.to(float32); entropy = compute_entropy(logits) when entropy_coef is
               set; then log_probs_from_logits(logits, labels, temperature), which divides the logits by the
               temperature in place (flash-attn's kernel absent here: its torch path);
  loss         actor_loss = PolicyLoss(...)(log_probs, old, advantages, action_mask, **loss_batch_info)
               (token mode: sum / batch_num_tokens x dp_size; gspo: per-sample mode, sum of sequence means /
               global_batch_size x dp_size);
               + kl_coef aggregate_loss(compute_approx_kl(log_probs, ref), mask, **loss_batch_info) (token mode)
               - entropy_coef aggregate_loss(entropy, mask, **loss_batch_info) (token mode);
  engine       DeepSpeed: the loss x 1/gas, gradients averaged over DP (framework ga_reduce mean, grad avg).

Stubbed, none of the math: the package __init__ files (they import the actor and transformers) and deepspeed
(imported by models/utils.py for an unrelated ZeRO-3 helper); under torch 1.13, which has no torch.compile,
`@torch.compile` on compute_entropy becomes the identity (eager: the same math; torch >= 2 compiles it). The logits are converted by `.to(float32)` as
Actor.forward does (a copy for 16-bit logits; for float32 logits the same tensor, which is then a non-leaf
stand-in: lossverify's leaf is cloned once so that the in-place division is allowed, as on a model output).
The rows are laid out as OpenRLHF's unpacked [batch, length] tensors (what gather_and_pad_tensor gives back
with sample packing). tp 1 (DeepSpeed), no ring attention (its CP is not lossverify's layout).
"""
import os
import sys
import types

import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lv_frameworks import Run, checkout, git_commit
from lv_frameworks.single_gpu import package_shell
from lv_frameworks.skyrl import _padded, _scatter

NAME = "OpenRLHF"
EXPLANATIONS = ["rl-token-mean-sample-weighted", "rl-temperature-one-side", "dp-local-mean",
                "rl-microbatch-self-normalized", "rl-schedule-double-divide", "rl-aux-token-mean"]
_modules = {}


def _load():
    if not _modules:
        sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
        if not hasattr(torch, "compile"):  # torch 1.13: compute_entropy's @torch.compile runs it eagerly
            torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
        root = os.path.join(checkout(), "openrlhf")
        package_shell("openrlhf", root)
        package_shell("openrlhf.models", os.path.join(root, "models"))
        from openrlhf.models import loss, utils
        _modules["loss"], _modules["utils"] = loss, utils
    return _modules["loss"], _modules["utils"]


def _loss_batch_info(ctx):
    """iter_grad_accum_global_norm's normalisers: the step's tokens and non-empty samples over DP, / gas."""
    tokens = sum(float(mb.loss_mask.sum()) for mb in ctx.micro_batches)
    samples = 0.0
    for mb in ctx.micro_batches:
        seqs = mb.sequences[mb.loss_mask]
        samples += float(torch.unique(seqs).numel())
    totals = torch.tensor([tokens, samples], dtype=torch.float32)
    dist.all_reduce(totals, group=ctx.dp_group)
    return {"dp_size": ctx.dp_size, "batch_num_tokens": totals[0] / ctx.ga, "global_batch_size": totals[1] / ctx.ga}


def _step(logits, labels, ctx, loss_type):
    loss_mod, utils = _load()
    cfg = ctx.loss
    if "openrlhf_info" not in ctx.state:
        ctx.state["openrlhf_info"] = _loss_batch_info(ctx)
    info = ctx.state["openrlhf_info"]
    valid = ctx.loss_mask
    slots = _padded(ctx)
    mask = _scatter(valid.float(), slots)
    # Actor.forward: logits.to(float32), entropy (when entropy_coef is set), then the in-place temperature
    logits_f = logits.to(torch.float32)
    if logits_f is logits:
        logits_f = logits.clone()
    entropy_rows = utils.compute_entropy(logits_f) if cfg.entropy_coef else None
    targets = torch.where(valid, labels, torch.zeros_like(labels))
    logprob = utils.log_probs_from_logits(logits_f, targets, temperature=cfg.temperature)
    log_probs = _scatter(logprob, slots) * mask  # action_log_probs = log_probs * action_mask
    policy = loss_mod.PolicyLoss(clip_eps_low=cfg.clip_low, clip_eps_high=cfg.clip_high,
                                 dual_clip=cfg.dual_clip if cfg.dual_clip > 0 else None, policy_loss_type=loss_type)
    actor_loss, clip_ratio, _, _ = policy(log_probs, _scatter(ctx.old_logprob.float(), slots),
                                          _scatter(ctx.whitened_advantages().float(), slots), action_mask=mask,
                                          rollout_log_probs=None, **info)
    loss = actor_loss
    if cfg.kl_penalty not in ("none", None) and cfg.kl_coef > 0:
        kl = utils.compute_approx_kl(log_probs, _scatter(ctx.ref_logprob.float(), slots), kl_estimator=cfg.kl_penalty)
        loss = actor_loss + loss_mod.aggregate_loss(kl, mask, **info) * cfg.kl_coef
    entropy = None
    if entropy_rows is not None:
        loss = loss - loss_mod.aggregate_loss(_scatter(entropy_rows, slots), mask, **info) * cfg.entropy_coef
        entropy = torch.where(valid, entropy_rows, torch.zeros_like(entropy_rows))
    return Reduced(loss, logprob=torch.where(valid, logprob, torch.zeros_like(logprob)), entropy=entropy)


def policy_loss(logits, labels, ctx):
    """PolicyLoss(policy_loss_type="ppo") (dual clip where the case has one) in the actor's training step."""
    return _step(logits, labels, ctx, "ppo")


def gspo_loss(logits, labels, ctx):
    """PolicyLoss(policy_loss_type="gspo") (per-sample aggregation) in the actor's training step."""
    return _step(logits, labels, ctx, "gspo")


def describe(path):
    return {"commit": git_commit(path), "source": "openrlhf/models/loss.py, openrlhf/models/utils.py"}


def runs(cases):
    """The policy_loss cases at tp 1, cp 1 with their dp and ga and DeepSpeed's framework model (the loss / gas,
    gradients averaged over DP): ppo in token mode (OpenRLHF's only mode for ppo), gspo in its per-sample mode
    (seq-mean-token-mean); each with the policy term alone, with KL, with entropy, and as the case. Advantage
    whitening (done by OpenRLHF's experience maker, outside the loss) is off; plus a sweep of the policy term over
    dp and ga. The Dr. GRPO case is left out (OpenRLHF has no such mode)."""
    out = []
    engine = {"framework.grad_reduce": "avg", "framework.ga_reduce": "mean"}
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy" or loss.get("objective", "policy_loss") != "policy_loss":
            continue
        if loss.get("norm_constant"):  # no Dr. GRPO mode, and --set cannot remove the key
            continue
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}
        lay = {"tp": 1, "cp": 1, **rest}
        base = dict(engine)
        if loss.get("whiten_advantages"):
            base["loss.whiten_advantages"] = False
        if loss.get("ratio", "token") == "sequence":
            function, aggregation = f"{__name__}:gspo_loss", "seq-mean-token-mean"
        else:
            function, aggregation = f"{__name__}:policy_loss", "token-mean"
        base["loss.aggregation"] = aggregation
        out.append(Run(function, name, lay, {**base, "loss.kl_coef": 0, "loss.entropy_coef": 0}, "policy term"))
        if loss.get("kl_coef"):
            out.append(Run(function, name, lay, {**base, "loss.entropy_coef": 0}, "with KL"))
        if loss.get("entropy_coef"):
            out.append(Run(function, name, lay, {**base, "loss.kl_coef": 0}, "with entropy"))
            if loss.get("temperature", 1.0) != 1.0:
                out.append(Run(function, name, lay, {**base, "loss.kl_coef": 0, "loss.temperature": 1.0},
                               "with entropy, T = 1"))
        out.append(Run(function, name, lay, base, "as the case"))
        sweep = [f"tp1-cp1-dp{dp}-ga{ga}" for dp in (1, 2) for ga in (1, 2)]
        out.append(Run(function, name, None, {**base, "loss.kl_coef": 0, "loss.entropy_coef": 0}, "policy term",
                       sweep=sweep))
    return out
