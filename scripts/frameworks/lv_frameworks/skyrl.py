"""SkyRL's policy losses (`skyrl/backends/skyrl_train/utils/ppo_utils.py`: `ppo_policy_loss` for regular and
dual clip, `gspo_policy_loss`, `compute_approx_kl`, `reduce_loss`, `apply_loss_reduction_to_advantages_minibatch`),
imported from a checkout, with the arithmetic of its FSDP policy worker around them
(`workers/worker.py`, `PolicyWorkerBase._forward_backward_micro`, RL path):

  trainer      advantages of the whole mini-batch (every DP rank's sequences, [B, L]) scaled by
               `apply_loss_reduction_to_advantages_minibatch` (token_mean: / N; sequence_mean: / (B n_s);
               seq_mean_token_sum_norm: / (B max_seq_len)), so that a plain sum gives the aggregation;
  model        logits.div_(temperature), then `torch_utils.logprobs_from_logits` (its torch path, flash-attn's
               kernel being absent here) and `chunked_entropy_from_logits(requires_grad=use_entropy_loss)`;
  loss         policy_loss = loss fn (reduce_loss: sum of loss x loss_mask);
               entropy = masked_mean(entropy, loss_mask) over the micro-batch;
               kl = masked_mean(compute_approx_kl(...), loss_mask, dim=-1).mean() (per sequence, then a mean);
               loss = policy_loss x dp_size + (kl_coef kl - entropy_coef entropy) x len(microbatch)/len(data);
  engine       FSDP averages the gradients over the DP group, micro-batch gradients summed.

Stubbed, none of the math: the package __init__ files, ray (the loss registry's actor sync: not initialised),
jaxtyping's annotations, loguru's logger, omegaconf's DictConfig type and `skyrl.train.config` (the loss reads
its config by attribute: a namespace with the case's values). The logits are cloned once before the in-place
division, standing in for the model output that SkyRL divides in place (a non-leaf; lossverify's input is a
leaf). Under whiten_advantages the loss gets lossverify's whitened advantages (SkyRL whitens in its trainer,
`_normalize_advantages` step 1, with an unmasked mean: SkyRL #1305, not judged here). FSDP path only: its sequence parallelism (Ulysses) is not lossverify's CP layout, and its Megatron
path (vocab-parallel log-probs, CP) is not driven here (see the report).
"""
import os
import sys
import types

import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lv_frameworks import Run, checkout, git_commit, stub_module as _stub
from lv_frameworks.single_gpu import package_shell

NAME = "SkyRL"
EXPLANATIONS = ["rl-token-mean-sample-weighted", "rl-kl-no-grad", "rl-cp-extra-scale", "rl-temperature-one-side",
                "rl-microbatch-self-normalized", "dp-local-mean", "rl-logprob-16bit", "rl-aux-sample-weighted",
                "rl-aux-microbatch-mean"]
ROOT = "skyrl/backends/skyrl_train"
_modules = {}
# lossverify's aggregation -> SkyRL's loss_reduction
REDUCTIONS = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean",
              "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}


class _Annotation:
    def __class_getitem__(cls, item):
        return cls


def _load():
    if not _modules:
        import logging
        _stub("ray", remote=lambda cls=None, **k: cls if cls is not None else (lambda c: c),
              is_initialized=lambda: False)
        _stub("jaxtyping", Float=_Annotation, Integer=_Annotation)
        _stub("loguru", logger=logging.getLogger("skyrl"))
        _stub("omegaconf", DictConfig=dict, OmegaConf=None)
        root = os.path.join(checkout(), "skyrl")
        package_shell("skyrl", root)
        package_shell("skyrl.train", os.path.join(root, "train"))
        _stub("skyrl.train.config", AlgorithmConfig=object)
        package_shell("skyrl.backends", os.path.join(root, "backends"))
        package_shell("skyrl.backends.skyrl_train", os.path.join(root, "backends", "skyrl_train"))
        package_shell("skyrl.backends.skyrl_train.utils", os.path.join(root, "backends", "skyrl_train", "utils"))
        from skyrl.backends.skyrl_train.utils import ppo_utils, torch_utils
        _modules["ppo"], _modules["torch"] = ppo_utils, torch_utils
    return _modules["ppo"], _modules["torch"]


def _config(ctx, loss_type):
    loss = ctx.loss
    return types.SimpleNamespace(
        policy_loss_type=loss_type, eps_clip_low=loss.clip_low, eps_clip_high=loss.clip_high,
        clip_ratio_c=loss.dual_clip if loss.dual_clip > 0 else 3.0, loss_reduction=REDUCTIONS[loss.aggregation],
        off_policy_correction=None, temperature=loss.temperature, use_kl_loss=loss.kl_penalty not in ("none", None),
        kl_estimator_type=loss.kl_penalty if loss.kl_penalty not in ("none", None) else "k3", kl_loss_coef=loss.kl_coef,
        use_entropy_loss=loss.entropy_coef != 0, entropy_loss_coef=loss.entropy_coef,
        max_seq_len=loss.norm_constant)


def _given_advantages(ctx, mb):
    """A micro-batch's advantages as the loss receives them: the case's, or under whiten_advantages
    lossverify's whitened ones (SkyRL whitens in its trainer, `_normalize_advantages` step 1, over the padded
    [B, L] batch: not judged here)."""
    if not ctx.loss.whiten_advantages:
        return mb.advantages.float()
    mean, std = ctx.advantage_mean, ctx.advantage_std
    scale = 1.0 / (torch.tensor(std, dtype=torch.float32) + torch.tensor(ctx.loss.whiten_epsilon, dtype=torch.float32))
    white = (mb.advantages.float() - torch.tensor(mean, dtype=torch.float32)) * scale
    return torch.where(mb.loss_mask, white, torch.zeros_like(white))


def _mini_batch_advantages(ctx, cfg):
    """The trainer's `_normalize_advantages` step 2 on the whole mini-batch: every rank's valid rows gathered
    (sequence, position, advantage) into SkyRL's [B, L] tensors (right-padded, loss_mask 0 on padding),
    normalised by apply_loss_reduction_to_advantages_minibatch; returns {(sequence, position): advantage}."""
    ppo, _ = _load()
    mine = []
    for mb in ctx.micro_batches:
        for s, p, a, m in zip(mb.sequences.tolist(), mb.positions.tolist(), _given_advantages(ctx, mb).tolist(),
                              mb.loss_mask.tolist()):
            if s >= 0:
                mine.append((s, p, a, bool(m)))
    everything = [None] * dist.get_world_size(ctx.dp_cp_group)
    dist.all_gather_object(everything, mine, group=ctx.dp_cp_group)
    rows = sorted({r for part in everything for r in part})
    sequences = sorted({r[0] for r in rows})
    length = max(r[1] for r in rows) + 1
    index = {s: i for i, s in enumerate(sequences)}
    advantages = torch.zeros(len(sequences), length, dtype=torch.float32)
    mask = torch.zeros(len(sequences), length, dtype=torch.float32)
    for s, p, a, m in rows:
        if m:
            advantages[index[s], p] = a
            mask[index[s], p] = 1.0
    micro = max(1, len(sequences) // (ctx.dp_size * ctx.ga))
    normalized = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=advantages, loss_mask=mask, loss_reduction=cfg.loss_reduction, micro_batch_size=micro,
        max_seq_len=int(cfg.max_seq_len))
    return {(s, p): float(normalized[index[s], p]) for s, p, _, m in rows if m}


def _padded(ctx):
    """The micro-batch's rows as SkyRL's [b, L] response tensors: (row index of each [b, L] slot or -1)."""
    sequences = ctx.sequences.tolist()
    positions = ctx.positions.tolist()
    local = sorted({s for s in sequences if s >= 0})
    index = {s: i for i, s in enumerate(local)}
    length = max(p for s, p in zip(sequences, positions) if s >= 0) + 1
    slots = torch.full((len(local), length), -1, dtype=torch.long)
    for row, (s, p) in enumerate(zip(sequences, positions)):
        if s >= 0:
            slots[index[s], p] = row
    return slots


def _scatter(values, slots, fill=0.0):
    """values [rows] into [b, L] by slots (differentiable)."""
    flat = slots.reshape(-1)
    padded = torch.cat([values, values.new_full((1,), fill)])
    return padded[torch.where(flat >= 0, flat, torch.full_like(flat, values.shape[0]))].reshape(slots.shape)


def _step(logits, labels, ctx, loss_type):
    ppo, tu = _load()
    cfg = _config(ctx, loss_type)
    if "skyrl_advantages" not in ctx.state:
        ctx.state["skyrl_advantages"] = _mini_batch_advantages(ctx, cfg)
    scaled = ctx.state["skyrl_advantages"]
    valid = ctx.loss_mask
    # model: logits.div_(temperature) in place, then the log-prob and entropy helpers on [1, rows, V]
    logits_bsv = logits.clone()[None]
    logits_bsv.div_(cfg.temperature)
    targets = torch.where(valid, labels, torch.zeros_like(labels))[None]
    logprob = tu.logprobs_from_logits(logits_bsv, targets, inplace_backward=True)[0]
    entropy = tu.chunked_entropy_from_logits(logits_bsv, requires_grad=cfg.use_entropy_loss, attention_mask=None)[0]
    slots = _padded(ctx)
    mask = _scatter(valid.float(), slots)
    rows_adv = torch.tensor([scaled.get((s, p), 0.0) for s, p in zip(ctx.sequences.tolist(), ctx.positions.tolist())],
                            dtype=torch.float32, device=logits.device)
    log_probs = _scatter(logprob, slots)
    old = _scatter(ctx.old_logprob.float(), slots)
    base = _scatter(ctx.ref_logprob.float(), slots)
    advantages = _scatter(rows_adv, slots)
    policy_loss, _ = ppo.PolicyLossRegistry.get(loss_type)(log_probs, old, advantages, config=cfg, loss_mask=mask,
                                                           rollout_logprobs=None)
    # worker.py _forward_backward_micro, RL path
    with torch.set_grad_enabled(cfg.use_entropy_loss):
        entropy_mb = tu.masked_mean(_scatter(entropy, slots), mask)
    entropy_term = entropy_mb * cfg.entropy_loss_coef if cfg.use_entropy_loss else torch.tensor(0.0)
    if cfg.use_kl_loss:
        kl = ppo.compute_approx_kl(log_probs, base, loss_mask=mask, kl_estimator_type=cfg.kl_estimator_type)
        kl = tu.masked_mean(kl, mask, dim=-1).mean()
    else:
        kl = torch.tensor(0.0)
    kl_term = kl * cfg.kl_loss_coef
    rank_sequences = len({int(s) for mb in ctx.micro_batches for s in mb.sequences.tolist() if s >= 0})
    microbatch_weight = slots.shape[0] / rank_sequences
    dp_size = ctx.dp_size
    loss = policy_loss * dp_size + (kl_term - entropy_term) * microbatch_weight
    unscaled = loss / dp_size  # SkyRL's final_loss, summed over micro-batches and DP ranks
    zero = torch.zeros_like(logprob)
    return Reduced(loss, logged=unscaled.detach().double(), logprob=torch.where(valid, logprob, zero),
                   entropy=torch.where(valid, entropy.float(), zero))


def ppo_policy_loss(logits, labels, ctx):
    """`ppo_policy_loss` (regular, or dual_clip when the case has a dual clip) in the FSDP worker's step."""
    return _step(logits, labels, ctx, "dual_clip" if ctx.loss.dual_clip > 0 else "regular")


def gspo_policy_loss(logits, labels, ctx):
    """`gspo_policy_loss` (GSPO-token: sg[rho_s] pi/sg[pi]) in the FSDP worker's step."""
    return _step(logits, labels, ctx, "gspo")


_megatron = {}


def _load_megatron():
    """skyrl_train/distributed/megatron/model_utils.py under a megatron.core.parallel_state stub answering the
    run's TP group (its vocab-parallel entropy asks mpu for it)."""
    if not _megatron:
        _load()
        if not hasattr(torch, "compile"):  # torch 1.13: model_utils' @torch.compile helpers run eagerly
            torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
        mpu = _stub("megatron.core.parallel_state",
                    get_tensor_model_parallel_group=lambda: _megatron["ctx"].tp_group,
                    get_tensor_model_parallel_rank=lambda: _megatron["ctx"].tp_rank,
                    get_tensor_model_parallel_world_size=lambda: _megatron["ctx"].tp_size,
                    get_context_parallel_group=lambda: _megatron["ctx"].cp_group,
                    get_context_parallel_world_size=lambda: _megatron["ctx"].cp_size)
        core = sys.modules.get("megatron.core") or _stub("megatron.core")
        core.parallel_state = mpu
        megatron = sys.modules.get("megatron") or _stub("megatron")
        megatron.core = core
        root = os.path.join(checkout(), "skyrl", "backends", "skyrl_train", "distributed")
        package_shell("skyrl.backends.skyrl_train.distributed", root)
        package_shell("skyrl.backends.skyrl_train.distributed.megatron", os.path.join(root, "megatron"))
        from skyrl.backends.skyrl_train.distributed.megatron import model_utils
        _megatron["model_utils"] = model_utils
    return _megatron["model_utils"]


def _cp_rows(ctx):
    """Over the CP group, every non-padding row of the step: {(sequence, position): (mask, old, ref)} and each
    sequence's length (what each CP rank of SkyRL's Megatron worker holds whole: its batch is not CP-split)."""
    mine = []
    for mb in ctx.micro_batches:
        for i, (s, p, t) in enumerate(zip(mb.sequences.tolist(), mb.positions.tolist(), mb.tokens.tolist())):
            if s >= 0 and t >= 0:
                mine.append((s, p, bool(mb.loss_mask[i]), float(mb.old_logprob[i]), float(mb.ref_logprob[i])))
    everything = [None] * ctx.cp_size
    dist.all_gather_object(everything, mine, group=ctx.cp_group)
    rows, length = {}, {}
    for part in everything:
        for s, p, m, o, r in part:
            rows[(s, p)] = (m, o, r)
            length[s] = max(length.get(s, 0), p + 1)
    return rows, length


def _megatron_step(logits, labels, ctx, loss_type):
    """The Megatron worker's loss_func (megatron_model_wrapper.py, packed sequences, no fused LM head) on
    SkyRL's packed THD micro-batch, then Megatron's schedule for a 2-output loss function (x CP / K) and DDP's
    average over DP x CP."""
    ppo, tu = _load()
    mu = _load_megatron()
    _megatron["ctx"] = ctx
    cfg = _config(ctx, loss_type)
    if "skyrl_advantages" not in ctx.state:
        ctx.state["skyrl_advantages"] = _mini_batch_advantages(ctx, cfg)
        ctx.state["skyrl_cp_rows"] = _cp_rows(ctx)
    scaled = ctx.state["skyrl_advantages"]
    full, length = ctx.state["skyrl_cp_rows"]
    cp, r = ctx.cp_size, ctx.cp_rank
    here = {(s, p): i for i, (s, p) in enumerate(zip(ctx.sequences.tolist(), ctx.positions.tolist())) if s >= 0}
    order = list(dict.fromkeys(s for s in ctx.sequences.tolist() if s >= 0))
    pad = logits.shape[0]
    index, padded, targets = [], [], []
    for s in order:
        total = length[s]
        size = total if cp == 1 else 2 * cp * (-(-total // (2 * cp)))  # lossverify's (and THD CP's) padding
        padded.append(size)
        chunk = size // (2 * cp)
        positions = list(range(size)) if cp == 1 else (list(range(r * chunk, (r + 1) * chunk)) +
                                                       list(range((2 * cp - r - 1) * chunk, (2 * cp - r) * chunk)))
        for p in positions:
            if p < total and (s, p) not in here:
                raise RuntimeError(f"layout: sequence {s} position {p} is not on CP rank {r}")
            index.append(here.get((s, p), pad) if p < total else pad)
        tokens = torch.zeros(size, dtype=torch.long)
        for p in range(total - 1):
            if (s, p) in here and ctx.loss_mask[here[(s, p)]]:
                tokens[p + 1] = labels[here[(s, p)]]
        targets.append(tokens)
    rows = torch.cat([logits.float(), logits.new_zeros((1, logits.shape[1]), dtype=torch.float32)])
    local = rows[torch.tensor(index, dtype=torch.long)][None]  # [1, T/CP, V/TP], Float16Module's float32
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(padded), 0).tolist()), dtype=torch.long)
    width = max(length[s] for s in order)
    num_actions = width - 1
    attention = torch.zeros(len(order), width, dtype=torch.long)
    mask = torch.zeros(len(order), num_actions)
    old = torch.zeros(len(order), num_actions)
    ref = torch.zeros(len(order), num_actions)
    adv = torch.zeros(len(order), num_actions)
    for b, s in enumerate(order):
        attention[b, :length[s]] = 1
        for p in range(length[s] - 1):
            m, o, f = full[(s, p)]
            mask[b, p], old[b, p], ref[b, p] = float(m), o, f
            adv[b, p] = scaled.get((s, p), 0.0)
    # loss_func: the in-place temperature, then the packed log-prob and entropy helpers
    if cfg.temperature != 1.0:
        local.div_(cfg.temperature)
    token_logprobs = mu.from_parallel_logits_to_logprobs_packed_sequences(
        local, torch.cat(targets)[None], cu, width, vocab_start_index=ctx.tp_rank * logits.shape[-1],
        vocab_end_index=(ctx.tp_rank + 1) * logits.shape[-1], group=ctx.tp_group, inference_only=False,
        cp_group=ctx.cp_group, chunk_size=None, attention_mask=attention)
    action_log_probs = token_logprobs[:, -num_actions:]
    policy_loss, _ = ppo.PolicyLossRegistry.get(loss_type)(action_log_probs, old, adv, config=cfg, loss_mask=mask,
                                                           rollout_logprobs=None)
    with torch.set_grad_enabled(cfg.use_entropy_loss):
        entropy, entropy_for_loss = mu.vocab_parallel_entropy_packed_sequences(
            local, cu, width, num_actions, attention, mask, ctx.cp_group, chunk_size=None)
    entropy_term = entropy_for_loss * cfg.entropy_loss_coef if cfg.use_entropy_loss else torch.tensor(0.0)
    if cfg.use_kl_loss:
        kl = ppo.compute_approx_kl(action_log_probs, ref, loss_mask=mask, kl_estimator_type=cfg.kl_estimator_type)
        kl = tu.masked_mean(kl, mask, dim=-1).mean()
    else:
        kl = torch.tensor(0.0)
    grad_sum_correction_factor = ctx.ga * ctx.dp_size
    loss = policy_loss * grad_sum_correction_factor + (kl * cfg.kl_loss_coef - entropy_term) * 1.0
    # the value logged (SkyRL's final_loss, loss / grad_sum_correction_factor summed over micro-batches and
    # DP): the policy and KL parts are the same on every CP rank (whole-sequence log-probs) and count once
    # (1/CP on each), the entropy part is each CP rank's own share
    replicated = (policy_loss * grad_sum_correction_factor + kl * cfg.kl_loss_coef).detach().double()
    logged = (replicated / cp - entropy_term.detach().double()) / grad_sum_correction_factor
    # Megatron's schedule, two-output loss function: x cp_group_size / num_microbatches
    return Reduced(loss * cp / ctx.ga, logged=logged)


def megatron_policy_loss(logits, labels, ctx):
    """The Megatron worker's RL loss (regular / dual_clip) on packed, vocabulary- and context-parallel logits."""
    return _megatron_step(logits, labels, ctx, "dual_clip" if ctx.loss.dual_clip > 0 else "regular")


def megatron_gspo_loss(logits, labels, ctx):
    """The Megatron worker's RL loss with gspo_policy_loss."""
    return _megatron_step(logits, labels, ctx, "gspo")


def describe(path):
    return {"commit": git_commit(path), "source": f"{ROOT}/utils/ppo_utils.py, {ROOT}/workers/worker.py"}


def _labels(layouts):
    return [f"tp{l['tp']}-cp{l['cp']}-dp{l['dp']}-ga{l['ga']}" for l in layouts]


def runs(cases):
    """The policy_loss cases at tp 1, cp 1 with their dp and ga (the FSDP path: no vocabulary or context
    parallelism here), FSDP's framework model (gradients averaged over DP, micro-batches summed). Per case: the
    policy term alone (KL and entropy off) in each of SkyRL's loss reductions the case can take (lossverify's
    --set cannot remove the Dr. GRPO case's norm_constant, so that case keeps its own); for 16-bit cases the
    same with float32 logits (inputs.dtype fp32); the KL term under sequence_mean (the aggregation SkyRL gives
    it); the case as it is; and a sweep over dp/ga of the policy term."""
    out = []
    fn = {"token": f"{__name__}:ppo_policy_loss", "sequence": f"{__name__}:gspo_policy_loss"}
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy" or loss.get("objective", "policy_loss") != "policy_loss":
            continue
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}
        lay = {"tp": 1, "cp": 1, **rest}
        function = fn[loss.get("ratio", "token")]
        off = {"loss.kl_coef": 0, "loss.entropy_coef": 0}
        if loss.get("norm_constant"):
            modes = [loss["aggregation"]]
        else:
            modes = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
        sixteen = case.get("inputs", {}).get("dtype", "fp32") in ("bf16", "fp16")
        for aggregation in modes:
            over = {"loss.aggregation": aggregation, **off}
            if aggregation == "seq-mean-token-sum-norm" and not loss.get("norm_constant"):
                over["loss.norm_constant"] = 64
            out.append(Run(function, name, lay, over, "policy term"))
            if sixteen:
                out.append(Run(function, name, lay, {**over, "inputs.dtype": "fp32"}, "policy term, fp32 logits"))
        if loss.get("kl_coef") and not loss.get("norm_constant"):
            out.append(Run(function, name, lay, {"loss.aggregation": "seq-mean-token-mean", "loss.entropy_coef": 0,
                                                 **({"inputs.dtype": "fp32"} if sixteen else {})},
                           "KL term under sequence_mean"))
        out.append(Run(function, name, lay, {}, "as the case"))
        if sixteen:
            out.append(Run(function, name, lay, {"inputs.dtype": "fp32"}, "as the case, fp32 logits"))
        sweep = _labels([{"tp": 1, "cp": 1, "dp": dp, "ga": ga} for dp in (1, 2) for ga in (1, 2)])
        over = {**off, **({"inputs.dtype": "fp32"} if sixteen else {})}
        out.append(Run(function, name, None, over, "policy term", sweep=sweep))
        out += _megatron_runs(name, case, loss, modes, off)
    return out


def _megatron_runs(name, case, loss, modes, off):
    """The Megatron worker's loss at tp 2 (and 4) x cp 2 with the case's dp and ga, Megatron's float32 logits:
    the policy term in each reduction, the KL term (sequence_mean) and the entropy term alone at ga 1 and cp 1
    and 2 (equal margins at both cp: no CP factor), the case as it is, and a sweep of the policy term."""
    function = f"{__name__}:{'megatron_gspo_loss' if loss.get('ratio', 'token') == 'sequence' else 'megatron_policy_loss'}"
    layout = case.get("layout", {})
    vocab = case["shape"]["vocab"]
    dp, ga = layout.get("dp", 1), layout.get("ga", 1)
    out = []
    for aggregation in modes:
        over = {"loss.aggregation": aggregation, **off}
        if aggregation == "seq-mean-token-sum-norm" and not loss.get("norm_constant"):
            over["loss.norm_constant"] = 64
        out.append(Run(function, name, {"tp": 2, "cp": 2, "dp": dp, "ga": ga}, over, "Megatron, policy term"))
    if vocab % 4 == 0:
        out.append(Run(function, name, {"tp": 4, "cp": 2, "dp": dp, "ga": ga}, dict(off), "Megatron, policy term"))
    for cp in (1, 2):
        if loss.get("kl_coef") and not loss.get("norm_constant"):
            out.append(Run(function, name, {"tp": 2, "cp": cp, "dp": dp, "ga": 1},
                           {"loss.aggregation": "seq-mean-token-mean", "loss.entropy_coef": 0}, "Megatron, KL term"))
        if loss.get("entropy_coef"):
            over = {"loss.kl_coef": 0} if loss.get("kl_coef") else {}
            out.append(Run(function, name, {"tp": 2, "cp": cp, "dp": dp, "ga": 1}, over, "Megatron, entropy term"))
    out.append(Run(function, name, {"tp": 2, "cp": 2, "dp": dp, "ga": ga}, {}, "Megatron, as the case"))
    sweep = _labels([{"tp": tp, "cp": cp, "dp": dp, "ga": g} for tp in (1, 2) for cp in (1, 2) for g in (1, 2)])
    out.append(Run(function, name, None, dict(off), "Megatron, policy term", sweep=sweep))
    return out
