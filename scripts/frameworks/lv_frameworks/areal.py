"""AReaL's vocabulary-parallel log-prob and entropy pass (`areal.utils.functional.gather_logprobs_entropy`,
i.e. `_VocabParallelLogProbsEntropy` at tp > 1 and the chunked `log_softmax` path at tp 1) and its PPO actor
loss (`areal.utils.functional.ppo_actor_loss_fn`) with the arithmetic its engines apply around it, imported
from a checkout.

The two modules of `areal/utils/functional/` are loaded unmodified. Stubbed around them, none of their math:
the package __init__ files, `areal.infra.platforms` (`is_npu_available`: True only where torch has no
`torch.compile`, i.e. on torch 1.13, so that the tp-1 path runs eagerly there; on torch >= 2 it is False and
the tp-1 path is the shipped `torch.compile`d one), `areal.api.cli_args.RejectionSamplingConfig` (a config
class; rejection sampling is off) and `areal.utils.data.KLEstimator` (used by rejection sampling only).

What the adapter does around the functions (the engines' plumbing, as shipped at this commit):
- labels: AReaL's labels are `torch.roll(input_ids, -1)`, always a token id; lossverify gives ignore_index on
  masked rows, so masked rows get label 0 (their values are masked out by loss_mask, as AReaL masks them);
- temperature: the engine passes `temperature=self.config.temperature` to gather_logprobs_entropy (the case's);
- the PPO loss: `grpo_loss_fn` (areal/trainer/ppo/actor.py) calls ppo_actor_loss_fn with the rollout's
  log-probabilities as proximal and old (use_decoupled_loss off), eps_clip = clip_low, eps_clip_higher =
  clip_high, c_clip = dual_clip, importance_sampling_level token or sequence (GSPO, with the micro-batch's
  packed cu_seqlens); its entropy is detached and there is no KL or entropy term in the loss (AReaL puts the
  KL into the rewards), so the runs set kl_coef = entropy_coef = 0 and aggregation token-mean (the only one
  ppo_actor_loss_fn has: a micro-batch token-mean that the engine re-weights);
- the engine (`FSDPEngine._compute_logprobs_and_loss`): loss x local_weight / total_loss_weight x dp_size,
  local_weight = the micro-batch's loss_mask.count_nonzero() (actor.py's loss_weight_fn), total_loss_weight
  its sum over every micro-batch and the DP group (`compute_total_loss_weight`); FSDP then averages the
  gradients over DP (grad_reduce avg) and accumulates micro-batches (ga_reduce sum): the case's defaults;
- `megatron_ppo_actor_loss`: MegatronEngine.train_batch's loss_multiplier dp_size x len(mb_list) (the #1273
  fix), then Megatron Core's schedule's `output_tensor *= cp_group_size; output_tensor /= num_microbatches`
  (emulated: what `megatron.core.pipeline_parallel.schedules.forward_step` does in the 2-tuple branch AReaL's
  `_process_output` takes); DDP averages over DP x CP.
- logged values: AReaL's stats_tracker sums numerators and denominators over the DP group: the loss logged is
  the token mean of ppo_actor_loss_fn's per-token `stat["loss"]`, the clip and dual-clip ratios the token means
  of its `clip_mask` and `dual_clip_mask`, the entropy the token mean of the entropy pass.
"""
import os
import sys
import types

import torch

from lossverify.torch import LogProbs, Reduced
from lv_frameworks import Run, checkout, git_commit, stub_module as _stub
from lv_frameworks.single_gpu import package_shell

NAME = "AReaL"
EXPLANATIONS = ["rl-schedule-double-divide", "rl-temperature-one-side", "rl-logprob-untracked-allreduce",
                "rl-entropy-untracked-allreduce", "rl-token-mean-sample-weighted", "dp-local-mean",
                "cp-stats-dp-only", "cp-loss-stat-dp-only", "cp-roll-after-split", "cp-duplicated-loss"]
_modules = {}


def _load():
    if not _modules:
        root = os.path.join(checkout(), "areal")
        package_shell("areal", root)
        for package in ("utils", "infra", "api", "utils.functional"):
            package_shell(f"areal.{package}", os.path.join(root, *package.split(".")))
        _stub("areal.infra.platforms", is_npu_available=not hasattr(torch, "compile"))

        class RejectionSamplingConfig:  # a config class; rejection sampling stays off
            pass

        class KLEstimator:  # used by apply_rejection_sampling only
            pass

        _stub("areal.api.cli_args", RejectionSamplingConfig=RejectionSamplingConfig)
        _stub("areal.utils.data", KLEstimator=KLEstimator)
        from areal.utils.functional import functional, vocab_parallel
        _modules["functional"] = functional
        _modules["vocab_parallel"] = vocab_parallel
    return _modules


def _labels(labels, ctx):
    return torch.where(ctx.loss_mask, labels, torch.zeros_like(labels))


def _logprobs_entropy(logits, labels, ctx):
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    return _load()["vocab_parallel"].gather_logprobs_entropy(logits, _labels(labels, ctx),
                                                             temperature=ctx.loss.temperature, tp_group=tp_group)


def logprobs_entropy(logits, labels, ctx):
    """The engine's log-prob pass: gather_logprobs_entropy(logits, labels, temperature, tp_group)."""
    logprob, entropy = _logprobs_entropy(logits, labels, ctx)
    return LogProbs(logprob, entropy)


def _cu_seqlens(ctx):
    """The micro-batch's packed cu_seqlens (its rows hold each sequence contiguously at cp 1)."""
    seqs = ctx.sequences.tolist()
    bounds = [0] + [i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1]] + [len(seqs)]
    assert len(set(seqs)) == len(bounds) - 1, "sequences are not contiguous in the micro-batch"
    return torch.tensor(bounds, dtype=torch.int32, device=ctx.device)


def _actor_loss(logits, labels, ctx):
    """grpo_loss_fn's call of ppo_actor_loss_fn on the engine's log-probs: (loss, stat, logprob, entropy)."""
    logprob, entropy = _logprobs_entropy(logits, labels, ctx)
    loss_cfg = ctx.loss
    mask = ctx.loss_mask.bool()
    old = ctx.old_logprob.float()
    level = "sequence" if loss_cfg.ratio == "sequence" else "token"
    loss, stat = _load()["functional"].ppo_actor_loss_fn(
        logprobs=logprob, proximal_logprobs=old, old_logprobs=old, advantages=ctx.advantages.float(),
        eps_clip=loss_cfg.clip_low, eps_clip_higher=loss_cfg.clip_high, loss_mask=mask,
        c_clip=loss_cfg.dual_clip if loss_cfg.dual_clip > 0 else None, rejection_sampling=None,
        importance_sampling_level=level, cu_seqlens=_cu_seqlens(ctx) if level == "sequence" else None)
    return loss, stat, logprob, entropy.detach()


def _total_loss_weight(ctx):
    """compute_total_loss_weight: the micro-batches' loss_mask counts summed, all-reduced over DP."""
    def compute():
        total = torch.tensor(float(sum(int(mb.loss_mask.count_nonzero()) for mb in ctx.micro_batches)),
                             dtype=torch.float32, device=ctx.device)
        torch.distributed.all_reduce(total, group=ctx.dp_group)
        return total
    if "areal_total_weight" not in ctx.state:
        ctx.state["areal_total_weight"] = compute()
    return ctx.state["areal_total_weight"]


def _reduced(scaled, stat, logprob, entropy, ctx):
    n = float(max(ctx.num_valid_tokens, 1))
    mask = ctx.loss_mask
    zero = torch.zeros_like(logprob)
    logged = torch.where(mask, stat["loss"].float(), zero).double().sum() / n
    stats = {"clip_fraction": stat["clip_mask"].double().sum() / n,
             "dual_clip_fraction": stat["dual_clip_mask"].double().sum() / n,
             "entropy": torch.where(mask, entropy.float(), zero).double().sum() / n}
    return Reduced(scaled, num_tokens=int(_total_loss_weight(ctx).item()), logged=logged,
                   logprob=torch.where(mask, logprob, zero), entropy=torch.where(mask, entropy, zero), stats=stats)


def ppo_actor_loss(logits, labels, ctx):
    """FSDPEngine.train_batch: grpo_loss_fn's ppo_actor_loss_fn x local_weight / total_loss_weight x dp_size."""
    loss, stat, logprob, entropy = _actor_loss(logits, labels, ctx)
    local_weight = ctx.loss_mask.count_nonzero()
    if local_weight == 0:
        return Reduced(logits.float().mean() * 0.0)
    scaled = loss * (local_weight / _total_loss_weight(ctx) * ctx.dp_size)
    return _reduced(scaled, stat, logprob, entropy, ctx)


def megatron_ppo_actor_loss(logits, labels, ctx):
    """MegatronEngine.train_batch: x local_weight / total_loss_weight x (dp_size x len(mb_list)), then Megatron
    Core's schedule multiplies the returned loss by cp_size and divides it by num_microbatches (emulated here)."""
    loss, stat, logprob, entropy = _actor_loss(logits, labels, ctx)
    local_weight = ctx.loss_mask.count_nonzero()
    if local_weight == 0:
        return Reduced(logits.float().mean() * 0.0)
    scaled = loss * (local_weight / _total_loss_weight(ctx) * (ctx.dp_size * ctx.ga))
    # megatron.core.pipeline_parallel.schedules.forward_step, the 2-tuple branch (what AReaL's _process_output
    # returns): output_tensor *= cp_group_size; output_tensor /= num_microbatches
    scaled = scaled * ctx.cp_size / ctx.ga
    return _reduced(scaled, stat, logprob, entropy, ctx)


def describe(path):
    return {"commit": git_commit(path), "source": "areal/utils/functional/{vocab_parallel,functional}.py"}


def _rl_cases(cases):
    for name, case in sorted(cases.items()):
        if case.get("loss", {}).get("kind") == "policy":
            yield name, case, case["loss"]


def _pcp_source():
    path = os.path.join(checkout(), "areal", "engine", "megatron_utils", "packed_context_parallel.py")
    return open(path).read() if os.path.exists(path) else ""


def runs(cases):
    """At a checkout whose packed_context_parallel.py has split_packed_seqs_for_context_parallel but no
    reassemble_cp_packed_logprobs (PR #1223's head): the CP-local SFT loss only (sft_runs). Otherwise (main):
    the RL runs below, and main's CP path of the SFT loss."""
    source = _pcp_source()
    if "split_packed_seqs_for_context_parallel" in source and "reassemble_cp_packed_logprobs" not in source:
        return sft_runs(cases, ("sft_cp_local_loss",))
    extra = []
    if "reassemble_cp_packed_logprobs" in source:
        extra = cp_rl_runs(cases) + sft_runs(cases, ("sft_cp_gathered_loss",))
    return rl_runs(cases) + extra


def cp_rl_runs(cases):
    """main's Megatron CP path of the PPO loss (megatron_cp_ppo_actor_loss) at cp 2: the GRPO case at tp 1, 2,
    4 with dp 2, ga 2, the GSPO case at its own layout and tp 1, 4; and both at tp1-cp2-dp1 (the layouts whose CP
    group is the whole world: torch 1.13's all_gather backward on gloo runs only there). Overrides as the PPO
    runs (no KL, no entropy bonus, token-mean)."""
    out = []
    function = f"{__name__}:megatron_cp_ppo_actor_loss"
    for name, layouts in (("rl-grpo-tp2-dp2-ga2", [{"tp": 1, "cp": 2, "dp": 1, "ga": 2}, {"tp": 1, "cp": 2, "dp": 2, "ga": 2},
                                                   {"tp": 2, "cp": 2, "dp": 2, "ga": 2}, {"tp": 4, "cp": 2, "dp": 2, "ga": 2}]),
                          ("rl-gspo-cp2-tp2", [{"tp": 1, "cp": 2, "dp": 1, "ga": 1}, {"tp": 1, "cp": 2, "dp": 2, "ga": 1},
                                               {"tp": 2, "cp": 2, "dp": 2, "ga": 1}, {"tp": 4, "cp": 2, "dp": 2, "ga": 1}])):
        if name not in cases:
            continue
        loss = cases[name]["loss"]
        overrides = {"loss.kl_coef": 0, "loss.entropy_coef": 0, "framework.grad_reduce": "avg",
                     "framework.ga_reduce": "sum"}
        notes = ["no KL, no entropy bonus"]
        if loss.get("aggregation", "token-mean") != "token-mean":
            overrides["loss.aggregation"] = "token-mean"
            notes.append("token-mean")
        for layout in layouts:
            out.append(Run(function, name, layout, overrides, ", ".join(notes)))
    return out


def rl_runs(cases):
    """LogProbs: every RL case at tp 1, 2, 4 where V splits evenly (AReaL's vocab_start = tp_rank x shard
    width), with the case's cp, dp, ga, and the case's own sweep. The PPO loss (both engines' arithmetic): the
    policy_loss cases with no KL or entropy term, token-mean, no whitening (AReaL whitens in
    compute_advantages, before the loss), cp 1 (the engines' CP paths gather log-probs over the sequence; not
    modelled for the PPO loss), at tp 1, 2, 4 with the case's dp and ga and a dp/ga grid on the GRPO case. The
    Dr. GRPO case is left out of the PPO runs: its norm_constant cannot be removed by --set, and lossverify
    refuses it under token-mean."""
    out = []
    for name, case, loss in _rl_cases(cases):
        layout = case.get("layout", {})
        vocab = case["shape"]["vocab"]
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):
            if vocab % tp == 0:
                out.append(Run(f"{__name__}:logprobs_entropy", name, {"tp": tp, **rest}))
        sweep = [label for label in _sweep_labels(case) if int(label.split("-")[0][2:]) and
                 vocab % int(label.split("-")[0][2:]) == 0]
        if len(sweep) > 1:
            out.append(Run(f"{__name__}:logprobs_entropy", name, {}, sweep=sweep))
        if loss.get("objective", "policy_loss") != "policy_loss":
            continue
        overrides = {"loss.kl_coef": 0, "loss.entropy_coef": 0}
        notes = ["no KL, no entropy bonus"]
        if loss.get("norm_constant"):
            continue  # --set cannot remove norm_constant, which lossverify refuses outside its aggregation
        if loss.get("aggregation", "token-mean") != "token-mean":
            overrides["loss.aggregation"] = "token-mean"
            notes.append("token-mean")
        if loss.get("whiten_advantages"):
            overrides["loss.whiten_advantages"] = False
            notes.append("no whitening")
        rest = {k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}
        layouts = [{"tp": tp, "cp": 1, **rest} for tp in (1, 2, 4) if vocab % tp == 0]
        if name == "rl-grpo-tp2-dp2-ga2":
            layouts += [{"tp": 1, "cp": 1, "dp": 1, "ga": 1}, {"tp": 1, "cp": 1, "dp": 4, "ga": 1},
                        {"tp": 1, "cp": 1, "dp": 1, "ga": 4}, {"tp": 2, "cp": 1, "dp": 2, "ga": 3}]
        for fn in ("ppo_actor_loss", "megatron_ppo_actor_loss"):
            for lay in layouts:
                out.append(Run(f"{__name__}:{fn}", name, lay, overrides, ", ".join(notes)))
    return out


def _sweep_labels(case, max_ranks=8):
    import itertools
    layout, sweep = case.get("layout", {}), case.get("sweep", {})
    axes = {k: sweep.get(k, [layout.get(k, 1)]) for k in ("tp", "cp", "dp", "ga")}
    return [f"tp{tp}-cp{cp}-dp{dp}-ga{ga}" for tp, cp, dp, ga in
            itertools.product(axes["tp"], axes["cp"], axes["dp"], axes["ga"]) if tp * cp * dp <= max_ranks]


# ---------------------------------------------------------------------------------------------------------------
# The CP-local SFT loss of PR #1223 (refs/pull/1223/head, 430a1f9c) and main's CP path, on the cross-entropy
# cases with cp > 1. Loaded from the checkout, unmodified: areal/engine/megatron_utils/packed_context_parallel.py
# (split_packed_seqs_for_context_parallel; at main also reassemble_cp_packed_logprobs) and
# areal/trainer/sft/lm_engine.py (compute_packed_sft_loss). Stubbed: megatron.core.parallel_state (the CP
# group, rank and size of the run), megatron.core.packed_seq_params (a type), and lm_engine's unrelated imports
# (controllers, RPC serialisation, perf tracer; stats_tracker's calls are no-ops: they only log).
# ---------------------------------------------------------------------------------------------------------------
_cp = {"group": None, "size": 1, "rank": 0}


def _identity_decorator(*args, **kwargs):
    return lambda f: f


def _load_sft():
    mods = _load()
    if "lm_engine" not in mods:
        root = os.path.join(checkout(), "areal")
        for package in ("engine", "engine.megatron_utils", "trainer", "trainer.sft", "experimental",
                        "experimental.training_service", "experimental.training_service.controller",
                        "infra.rpc"):
            package_shell(f"areal.{package}", os.path.join(root, *package.split(".")))
        if "megatron" not in sys.modules:
            package_shell("megatron", "/nonexistent")
        core = sys.modules.get("megatron.core") or package_shell("megatron.core", "/nonexistent")
        state = _stub("megatron.core.parallel_state",
                      get_context_parallel_world_size=lambda: _cp["size"],
                      get_context_parallel_rank=lambda: _cp["rank"],
                      get_context_parallel_group=lambda: _cp["group"])
        core.parallel_state = state

        class PackedSeqParams:
            pass

        _stub("megatron.core.packed_seq_params", PackedSeqParams=PackedSeqParams)
        data = sys.modules["areal.utils.data"]
        data.is_multi_modal_key = lambda key: False
        data.batched_call = lambda *a, **k: None
        _stub("areal.api", TrainEngine=object)
        _stub("areal.experimental.training_service.controller.controller", GatewayTrainController=object)
        _stub("areal.infra", TrainController=object)
        _stub("areal.infra.rpc.serialization", serialize_value=lambda v: v)
        _stub("areal.utils.perf_tracer", trace_perf=_identity_decorator)
        tracker = _stub("areal.utils.stats_tracker", scope_func_wrapper=_identity_decorator,
                        denominator=lambda **k: None, stat=lambda **k: None, scalar=lambda **k: None)
        sys.modules["areal.utils"].stats_tracker = tracker
        from areal.engine.megatron_utils import packed_context_parallel
        from areal.trainer.sft import lm_engine
        mods["packed_context_parallel"] = packed_context_parallel
        mods["lm_engine"] = lm_engine
    return mods


def _packed_micro_batch(ctx):
    """The micro-batch as the engine holds it before the CP split (every CP rank holds all of it): the padded
    packed input_ids, the per-position loss mask (lm_engine's loss_mask, already rolled to the label
    positions), the positions and sequences, and the padded cu_seqlens; rebuilt from the CP group's rows
    (lossverify pads each sequence to a multiple of 2 CP, AReaL's split needs the same)."""
    rows = (ctx.sequences.tolist(), ctx.positions.tolist(), ctx.token_ids.tolist(), ctx.loss_mask.tolist())
    parts = [None] * ctx.cp_size
    torch.distributed.all_gather_object(parts, rows, group=ctx.cp_group)
    order, length, cells = [], {}, {}
    for seqs, poss, toks, masks in parts:
        for s, p, t, m in zip(seqs, poss, toks, masks):
            if s not in length:
                order.append(s)
                length[s] = 0
            length[s] = max(length[s], p + 1)
            cells[(s, p)] = (t, m)
    order.sort()
    ids, mask, pos, seq, cu = [], [], [], [], [0]
    for s in order:
        for p in range(length[s]):
            t, m = cells[(s, p)]
            ids.append(max(t, 0))
            mask.append(bool(m))
            pos.append(p)
            seq.append(s)
        cu.append(cu[-1] + length[s])
    device = ctx.device
    as_tensor = lambda v, dt: torch.tensor(v, dtype=dt, device=device)
    return (as_tensor(ids, torch.int64), as_tensor(mask, torch.bool), as_tensor(pos, torch.int64),
            as_tensor(seq, torch.int64), as_tensor(cu, torch.int32))


def _cp_local_inputs(ctx):
    """The engine's CP-local labels and loss mask (PR #1223's forward_backward_batch): torch.roll of the
    padded input_ids by -1, then split_packed_seqs_for_context_parallel; the loss mask split likewise. Checks
    that the split lands on this rank's rows (the adapter's layout is AReaL's)."""
    pcp = _load_sft()["packed_context_parallel"]
    _cp.update(group=ctx.cp_group, size=ctx.cp_size, rank=ctx.cp_rank)
    ids, mask, pos, seq, cu = _packed_micro_batch(ctx)
    rolled_ids = torch.roll(ids, shifts=-1, dims=-1)
    labels = pcp.split_packed_seqs_for_context_parallel(rolled_ids, cu)
    split = lambda t: pcp.split_packed_seqs_for_context_parallel(t, cu)
    if not (torch.equal(split(pos), ctx.positions) and torch.equal(split(seq), ctx.sequences)):
        raise RuntimeError("AReaL's CP split does not give this rank's rows")
    return labels, split(mask.to(torch.int64)).bool(), (ids, mask, cu)


def _sft_total_weight(ctx, group):
    """compute_total_loss_weight over the unsplit micro-batches (every CP rank holds them), all-reduced over
    `group`: N over DP, or N x CP over DP x CP."""
    key = ("areal_sft_total", id(group))
    if key not in ctx.state:
        local = float(sum(int(mb.loss_mask.sum()) for mb in ctx.micro_batches))  # this rank's rows
        total = torch.tensor(local, dtype=torch.float64, device=ctx.device)
        torch.distributed.all_reduce(total, group=ctx.cp_group)  # the whole sequences: what each CP rank holds
        total = total.float()
        torch.distributed.all_reduce(total, group=group)
        ctx.state[key] = total
    return ctx.state[key]


def sft_cp_local_loss(logits, labels, ctx):
    """PR #1223's MegatronEngine at cp > 1 on lm_engine's SFT loss: CP-local labels and loss mask (rolled,
    then split), gather_logprobs_entropy on the local shard, compute_packed_sft_loss on the local rows, x
    local_weight (the split mask's count) / total_loss_weight (unsplit counts over DP) x dp_size (its
    loss_multiplier, no len(mb_list)); Megatron Core's schedule then x cp / num_microbatches (emulated); DDP
    averages over DP x CP. Logged: stats_tracker's loss over n_valid_tokens, exported over the DP group only
    (what CP rank 0 reports), and that DP-only token count."""
    mods = _load_sft()
    cp_labels, cp_mask, (ids, mask, cu) = _cp_local_inputs(ctx)
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    logprobs, entropy = mods["vocab_parallel"].gather_logprobs_entropy(
        logits, cp_labels, temperature=1.0, tp_group=tp_group)
    inputs = {"loss_mask": cp_mask, "cu_seqlens": cu // ctx.cp_size}
    loss = mods["lm_engine"].compute_packed_sft_loss(logprobs, entropy, inputs)
    local_weight = cp_mask.count_nonzero()
    total = _sft_total_weight(ctx, ctx.dp_group)
    if local_weight == 0:
        scaled = logits.float().mean() * 0.0
    else:
        scaled = loss * (local_weight / total * ctx.dp_size)
    scaled = scaled * ctx.cp_size / ctx.ga  # Megatron Core's forward_step, 2-tuple branch
    # stats_tracker: loss = -logprobs over n_valid_tokens (the local split mask), summed over the DP group
    counts = torch.tensor(float(sum(int(mb.loss_mask.sum()) for mb in ctx.micro_batches)), dtype=torch.float64,
                          device=ctx.device)
    torch.distributed.all_reduce(counts, group=ctx.dp_group)
    token_loss = torch.where(cp_mask, -logprobs.detach(), torch.zeros_like(logprobs)).double()
    logged = token_loss.sum() / counts if ctx.cp_rank == 0 else token_loss.sum() * 0
    return Reduced(scaled, token_loss=torch.where(cp_mask, -logprobs, torch.zeros_like(logprobs)),
                   num_tokens=int(counts.item()), logged=logged)


def sft_cp_gathered_loss(logits, labels, ctx):
    """main's MegatronEngine at cp > 1 on the same SFT loss: CP-local labels (rolled, then split),
    gather_logprobs_entropy on the local shard, reassemble_cp_packed_logprobs (a differentiable all-gather over
    CP) back to the whole micro-batch, compute_packed_sft_loss on it with the unsplit loss mask, x
    local_weight (the unsplit count) / total_loss_weight (over DP x CP) x dp_size x len(mb_list); Megatron
    Core's schedule then x cp / num_microbatches (emulated); DDP averages over DP x CP. (unpad_logits is left
    out: the padding rows it drops have loss mask 0.) Logged: stats_tracker's loss and count over the
    reassembled micro-batch, exported over DP."""
    mods = _load_sft()
    cp_labels, cp_mask, (ids, mask, cu) = _cp_local_inputs(ctx)
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    logprobs, entropy = mods["vocab_parallel"].gather_logprobs_entropy(
        logits, cp_labels, temperature=1.0, tp_group=tp_group)
    pcp = mods["packed_context_parallel"]
    full_logprobs = pcp.reassemble_cp_packed_logprobs(logprobs, cu)
    full_entropy = pcp.reassemble_cp_packed_logprobs(entropy, cu)
    loss = mods["lm_engine"].compute_packed_sft_loss(full_logprobs, full_entropy,
                                                     {"loss_mask": mask, "cu_seqlens": cu})
    local_weight = mask.count_nonzero()
    total = _sft_total_weight(ctx, ctx.dp_cp_group)
    if local_weight == 0:
        scaled = logits.float().mean() * 0.0
    else:
        scaled = loss * (local_weight / total * (ctx.dp_size * ctx.ga))
    scaled = scaled * ctx.cp_size / ctx.ga  # Megatron Core's forward_step, 2-tuple branch
    # stats_tracker (main): loss = -logprobs over n_valid_tokens on the reassembled micro-batch, which every CP
    # rank holds whole, summed over DP: the global token mean and count. Each CP rank logs the same value, and
    # the harness sums the parts over DP x CP: this rank's part is its share / cp.
    counts = _sft_total_weight(ctx, ctx.dp_group).double()
    token_loss = torch.where(mask, -full_logprobs.detach(), torch.zeros_like(full_logprobs)).double()
    logged = token_loss.sum() / counts / ctx.cp_size
    return Reduced(scaled, num_tokens=int(counts.item()), logged=logged)


def sft_runs(cases, functions=("sft_cp_local_loss",)):
    """The cross-entropy cases with cp > 1 (mean reduction, V split evenly), at their layout and tp 1, 2, 4,
    and at ga 1 where the case has ga > 1; no label smoothing, z-loss or softcap (AReaL's SFT loss has none);
    Megatron's framework model (gradients averaged over DP x CP, summed over micro-batches)."""
    from lv_frameworks import cross_entropy_cases
    out = []
    for name, case, loss in cross_entropy_cases(cases):
        layout = case.get("layout", {})
        if layout.get("cp", 1) < 2 or loss.get("reduction", "mean") != "mean":
            continue
        # Megatron's DDP averages the gradients over DP x CP and accumulates micro-batches (summed)
        overrides, notes = {"framework.grad_reduce": "avg", "framework.ga_reduce": "sum"}, []
        if case.get("framework", {}).get("grad_reduce", "avg") != "avg" or \
                case.get("framework", {}).get("ga_reduce", "sum") != "sum":
            notes.append("Megatron DDP: grads averaged over DP x CP, summed over micro-batches")
        for key in ("label_smoothing", "z_loss_weight", "softcap"):
            if loss.get(key, 0):
                overrides[f"loss.{key}"] = 0
                notes.append(f"no {key}")
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for fn in functions:
            for tp in (1, 2, 4):
                if case["shape"]["vocab"] % tp == 0:
                    out.append(Run(f"{__name__}:{fn}", name, {"tp": tp, **rest}, overrides, ", ".join(notes)))
            if layout.get("ga", 1) > 1:
                out.append(Run(f"{__name__}:{fn}", name, {"tp": 1, **rest, "ga": 1}, overrides,
                               ", ".join(notes + ["ga 1"])))
    return out


def _packed_policy_inputs(ctx):
    """The rollout's per-position old log-probability and advantage of the micro-batch, in the same padded
    packed order as _packed_micro_batch (0 on padding and masked positions)."""
    rows = (ctx.sequences.tolist(), ctx.positions.tolist(), ctx.old_logprob.float().tolist(),
            ctx.advantages.float().tolist())
    parts = [None] * ctx.cp_size
    torch.distributed.all_gather_object(parts, rows, group=ctx.cp_group)
    cells, length = {}, {}
    for seqs, poss, olds, advs in parts:
        for s, p, o, a in zip(seqs, poss, olds, advs):
            cells[(s, p)] = (o, a)
            length[s] = max(length.get(s, 0), p + 1)
    old, adv = [], []
    for s in sorted(length):
        for p in range(length[s]):
            o, a = cells[(s, p)]
            old.append(o)
            adv.append(a)
    return (torch.tensor(old, dtype=torch.float32, device=ctx.device),
            torch.tensor(adv, dtype=torch.float32, device=ctx.device))


def megatron_cp_ppo_actor_loss(logits, labels, ctx):
    """main's MegatronEngine at cp > 1 on the PPO actor loss: CP-local labels (torch.roll of the padded packed
    input_ids, then split_packed_seqs_for_context_parallel), gather_logprobs_entropy on the local shard at the
    case's T, reassemble_cp_packed_logprobs (a differentiable all-gather over CP) of log-probs and entropies,
    grpo_loss_fn's ppo_actor_loss_fn on the whole micro-batch (the rollout's full-length old log-probs,
    advantages and loss mask; padded cu_seqlens for GSPO, whose padding rows are masked), x local_weight (the
    micro-batch's count) / total_loss_weight (over DP x CP: N x CP) x dp_size x len(mb_list), then Megatron
    Core's x cp / num_microbatches (emulated); DDP averages over DP x CP. Logged: the stats of the whole
    micro-batch, which every CP rank holds, over DP (each CP rank's part is its share / cp)."""
    mods = _load_sft()
    pcp = mods["packed_context_parallel"]
    cp_labels, cp_mask, (ids, mask, cu) = _cp_local_inputs(ctx)
    old, adv = _packed_policy_inputs(ctx)
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    local_logprob, local_entropy = mods["vocab_parallel"].gather_logprobs_entropy(
        logits, cp_labels, temperature=ctx.loss.temperature, tp_group=tp_group)
    logprob = pcp.reassemble_cp_packed_logprobs(local_logprob, cu)
    entropy = pcp.reassemble_cp_packed_logprobs(local_entropy, cu).detach()
    loss_cfg = ctx.loss
    level = "sequence" if loss_cfg.ratio == "sequence" else "token"
    loss, stat = mods["functional"].ppo_actor_loss_fn(
        logprobs=logprob, proximal_logprobs=old, old_logprobs=old, advantages=adv,
        eps_clip=loss_cfg.clip_low, eps_clip_higher=loss_cfg.clip_high, loss_mask=mask,
        c_clip=loss_cfg.dual_clip if loss_cfg.dual_clip > 0 else None, rejection_sampling=None,
        importance_sampling_level=level, cu_seqlens=cu if level == "sequence" else None)
    local_weight = mask.count_nonzero()
    total = _sft_total_weight(ctx, ctx.dp_cp_group)
    if local_weight == 0:
        scaled = logits.float().mean() * 0.0
    else:
        scaled = loss * (local_weight / total * (ctx.dp_size * ctx.ga))
    scaled = scaled * ctx.cp_size / ctx.ga  # Megatron Core's forward_step, 2-tuple branch
    n = _sft_total_weight(ctx, ctx.dp_group).double()  # stats_tracker's n_valid_tokens over DP
    zero = torch.zeros_like(logprob)
    logged = torch.where(mask, stat["loss"].float(), zero).double().sum() / n / ctx.cp_size
    stats = {"clip_fraction": stat["clip_mask"].double().sum() / n / ctx.cp_size,
             "dual_clip_fraction": stat["dual_clip_mask"].double().sum() / n / ctx.cp_size,
             "entropy": torch.where(mask, entropy.float(), zero).double().sum() / n / ctx.cp_size}
    own = ctx.loss_mask
    return Reduced(scaled, num_tokens=int(n.item()), logged=logged,
                   logprob=torch.where(own, local_logprob, torch.zeros_like(local_logprob)),
                   entropy=torch.where(own, local_entropy, torch.zeros_like(local_entropy)), stats=stats)
