"""verl's RL loss code, imported from a checkout (volcengine/verl, now verl-project/verl): the vocabulary-parallel
log-prob and entropy helpers of
`verl/utils/megatron/tensor_parallel.py` (the log-prob one calls Megatron-LM's own
`tensor_parallel.vocab_parallel_cross_entropy`, loaded from the Megatron-LM checkout that
LV_MEGATRON_CHECKOUT names), its torch helpers `logprobs_from_logits` / `entropy_from_logits`
(`verl/utils/torch_functional.py`, the FSDP actor's), and `verl/trainer/ppo/core_algos.py` (`agg_loss`,
`compute_policy_loss_vanilla`, `compute_policy_loss_gspo`, `kl_penalty`) driven with the arithmetic of its
actors around them:

- the legacy Megatron actor (`verl/workers/actor/megatron_actor.py`, the default worker at this commit):
  logits in float32 (Megatron's Float16Module hands the last stage's output back in float32), `div_(T)`,
  entropy on the tempered logits, log-probs on a clone; per micro-batch `policy_loss_fn(...)` with an empty
  `global_batch_info` (local normalisation), minus `entropy_coeff * agg_loss(entropy)`, plus
  `kl_loss_coef * agg_loss(kl_penalty(...))`; Megatron's schedule divides each micro-batch's loss by the
  micro-batch count and DDP averages gradients over DP (framework ga_reduce mean, grad_reduce avg);
- the legacy FSDP actor (`verl/workers/actor/dp_actor.py`): the same per micro-batch, the logits in the
  case's dtype (what the HF model emits), `div_(T)`, the torch helpers; `loss = policy_loss *
  loss_scale_factor` (use_dynamic_bsz: the micro-batch's sequences / the rank's mini-batch sequences, 1/GA
  for equal micro-batches), FSDP averages over DP (ga_reduce sum, grad_reduce avg);
- the new engine worker (`use_legacy_worker_impl=disable`, `verl/workers/utils/losses.py:ppo_loss` with the
  FSDP or Megatron engine): the same calls with `global_batch_info = {dp_size, batch_num_tokens (valid
  tokens over DP), global_batch_size (the mini-batch's sequences, all DP ranks), loss_scale_factor (config,
  set to H_max)}`; each micro-batch's loss back-propagated as it is (FSDP; Megatron's engine multiplies by
  the micro-batch count what the schedule divides), DP-averaged (ga_reduce sum, grad_reduce avg).

Checkouts after verl #6067 (2026-04, "deprecate workers, migrate to engines") have no legacy actors
(`verl/workers/actor/` is deleted): only the engine worker's runs are listed there (LEGACY_ACTORS), and the FSDP
log-prob pass follows the FSDP engine (`verl/workers/engine/fsdp/transformer_impl.py` prepare_model_outputs:
`logits / temperature.to(logits.dtype)`, out of place, the divisor rounded to the logits' dtype) instead of the legacy
actor's `div_(T)`.

lossverify's rows become verl's [sequences, response_length] matrices (one row per sequence of the
micro-batch, right-padded; width H_max under seq-mean-token-sum-norm, as verl's response length), the
per-token values scattered in with index_put (differentiable) and gathered back.

Stubbed, none of the math: the package __init__ files of verl and megatron, `megatron.core.parallel_state`
(the run's TP group) and `megatron.core.utils` (group rank/size), config classes (ActorConfig, AlgoConfig,
omegaconf.DictConfig), `tensordict`/`transformers` where absent (type imports), verl.utils' advantage
helpers, and, on torch < 2 only, `torch.compile` as the identity (the entropy's `mul_reduce` helper).
"""
import os

import torch

from lossverify.torch import LogProbs, Reduced
from lv_frameworks import Run, checkout, git_commit, stub_megatron_core_utils, stub_module as _stub
from lv_frameworks.single_gpu import package_shell

NAME = "verl"
EXPLANATIONS = ["rl-token-mean-sample-weighted", "rl-microbatch-self-normalized", "rl-drgrpo-batch-sum",
                "rl-temperature-one-side", "rl-logprob-untracked-allreduce", "rl-entropy-untracked-allreduce",
                "rl-fused-vocab-pad", "dp-local-mean", "microbatch-local-mean", "rl-logprob-16bit",
                "rl-drgrpo-rank-batch-sum", "rl-seq-mean-counts-empty", "rl-temperature-16bit"]
MEGATRON = os.path.abspath(os.environ.get("LV_MEGATRON_CHECKOUT", ""))  # checked where it is first needed
_mods = {}
_tp = {"group": None}
LEGACY_ACTORS = os.path.join("verl", "workers", "actor", "megatron_actor.py")


def has_legacy_actors(root=None):
    """Whether the checkout still has the legacy actors (megatron_actor.py, dp_actor.py): deleted by verl #6067."""
    return os.path.exists(os.path.join(root or checkout(), LEGACY_ACTORS))  # what the stubbed parallel_state answers; set per call


class ActorConfig(dict):
    """Stand-in for verl.workers.config.ActorConfig: the fields the policy-loss functions read."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key)


class AlgoConfig:
    pass


def stub_verl_packages(packages=("utils.megatron", "utils.kernel", "trainer", "trainer.ppo", "workers")):
    """What importing verl's loss and kernel modules needs, none of their math: torch.compile where torch has none
    (torch 1.13: the entropy's helper runs eagerly), verl's unrelated third-party imports where they are missing,
    verl's package shells (its __init__ files not run) for `packages`, and its two config classes."""
    if not hasattr(torch, "compile"):
        torch.compile = lambda fn=None, **kwargs: (fn if fn is not None else (lambda f: f))
    for name, attrs in (("omegaconf", {"DictConfig": dict}), ("tensordict", {"TensorDict": dict}),
                        ("transformers", {"PreTrainedTokenizer": object})):
        try:
            __import__(name)
        except ImportError:
            _stub(name, **attrs)
    root = checkout()
    package_shell("verl", os.path.join(root, "verl"))
    utils = package_shell("verl.utils", os.path.join(root, "verl", "utils"))
    utils.as_torch_index = utils.group_mean_std = None  # advantage estimators only
    for package in packages:
        package_shell("verl." + package, os.path.join(root, "verl", *package.split(".")))
    _stub("verl.trainer.config", AlgoConfig=AlgoConfig)
    _stub("verl.workers.config", ActorConfig=ActorConfig)


def _stub_imports():
    stub_verl_packages()
    # Megatron-LM: package shells, the TP group of the run, group rank/size
    if not os.path.isdir(os.path.join(MEGATRON, "megatron", "core")):
        raise RuntimeError("verl's vocab-parallel log-prob calls Megatron-LM's: set LV_MEGATRON_CHECKOUT to a Megatron-LM "
                           "checkout")
    core = os.path.join(MEGATRON, "megatron", "core")
    megatron = package_shell("megatron", os.path.join(MEGATRON, "megatron"))
    mcore = package_shell("megatron.core", core)
    megatron.core = mcore
    state = _stub("megatron.core.parallel_state", get_tensor_model_parallel_group=lambda *a, **k: _tp["group"])
    mcore.parallel_state = state
    stub_megatron_core_utils(lambda: _tp["group"])
    tp = package_shell("megatron.core.tensor_parallel", os.path.join(core, "tensor_parallel"))
    mcore.tensor_parallel = tp
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    tp.vocab_parallel_cross_entropy = vocab_parallel_cross_entropy  # what its __init__ exports


def _load():
    if not _mods:
        _stub_imports()
        from verl.trainer.ppo import core_algos
        from verl.utils import torch_functional
        from verl.utils.megatron import tensor_parallel
        _mods.update(core=core_algos, F=torch_functional, tp=tensor_parallel)
    return _mods


# ---------------------------------------------------------------- log-prob passes

def _labels(ctx):
    """Labels with masked rows set to token 0 (verl's rows all carry a real token id)."""
    return torch.where(ctx.loss_mask, ctx.labels, torch.zeros_like(ctx.labels))


def _megatron_pass(logits, ctx):
    """The Megatron actor's logits_processor (megatron_actor.py): logits.div_(T); entropy =
    vocab_parallel_entropy(logits) on them; log_probs = vocab_parallel_log_probs_from_logits(clone, label),
    masked_fill(~label_mask, 0). The logits arrive in float32 (Float16Module)."""
    m = _load()
    _tp["group"] = ctx.tp_group
    x = logits.float().clone()  # the model's output tensor (not the harness's leaf)
    x.div_(ctx.loss.temperature)
    entropy = None
    if ctx.loss.entropy_coef:
        x_bak = x.clone()
        entropy = m["tp"].vocab_parallel_entropy(x)
    else:
        x_bak = x
    logprob = m["tp"].vocab_parallel_log_probs_from_logits(x_bak, _labels(ctx))
    logprob = logprob.masked_fill(~ctx.loss_mask, 0.0)
    if entropy is not None:
        entropy = entropy.masked_fill(~ctx.loss_mask, 0.0)
    return logprob, entropy


def _fsdp_pass(logits, ctx):
    """The FSDP actor's (dp_actor.py _forward_micro_batch, no fused kernels): logits.div_(T) in the model's
    dtype; after verl #6067 the FSDP engine's (prepare_model_outputs): logits / temperature.to(logits.dtype), the
    temperature a float32 tensor. Then log_probs = logprobs_from_logits(logits, labels) (flash-attn's kernel where
    installed, else logprobs_from_logits_v2), entropy = entropy_from_logits(logits)."""
    m = _load()
    if has_legacy_actors():
        x = logits.clone()
        x.div_(ctx.loss.temperature)
    else:
        temperature = torch.tensor([ctx.loss.temperature], dtype=torch.float32, device=logits.device)
        x = logits / temperature.clamp(min=1e-8).to(logits.dtype)
    logprob = m["F"].logprobs_from_logits(x, _labels(ctx), inplace_backward=not ctx.loss.entropy_coef)
    entropy = m["F"].entropy_from_logits(x) if ctx.loss.entropy_coef else None
    logprob = torch.where(ctx.loss_mask, logprob, torch.zeros_like(logprob))
    if entropy is not None:
        entropy = torch.where(ctx.loss_mask, entropy, torch.zeros_like(entropy))
    return logprob, entropy


def fsdp_logprobs_fp32(logits, labels, ctx):
    """Diagnostic, not a shipped path: the FSDP actor's helpers on the logits upcast to float32 first (what
    they compute were the model's logits float32), to tell their math from their 16-bit arithmetic."""
    return LogProbs(*_fsdp_pass(logits.float(), ctx))


def megatron_logprobs(logits, labels, ctx):
    """vocab_parallel_log_probs_from_logits and vocab_parallel_entropy, as the Megatron actor calls them."""
    return LogProbs(*_megatron_pass(logits, ctx))


def fsdp_logprobs(logits, labels, ctx):
    """logprobs_from_logits and entropy_from_logits, as the FSDP actor calls them (tp 1)."""
    return LogProbs(*_fsdp_pass(logits, ctx))


def fused_logprobs(logits, labels, ctx):
    """verl's fused linear-cross-entropy kernel (verl/utils/kernel/linear_cross_entropy.py, Triton; CUDA only),
    as use_fused_kernels=True calls it (model_forward_fused.py: linear_cross_entropy(hidden, output_weight,
    labels, T, "none", tp_group)). It takes hidden states and the output weight, not logits: the adapter
    passes hidden = [logits | 0] (width rounded up to the kernel's multiple of 128) and weight = the identity
    [V/TP, width], so that hidden @ weight^T is the logits exactly (one product by 1 per entry; exact for
    bf16 inputs, which the runs use: fp32 inputs would go through TF32) and d hidden[:, :V/TP] is d logits.
    Its runs are listed only with LV_VERL_FUSED=1 in the environment."""
    _load()
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    rows, width = logits.shape
    size = -(-width // 128) * 128
    hidden = torch.cat([logits, logits.new_zeros(rows, size - width)], dim=-1).contiguous()
    weight = torch.eye(width, size, dtype=logits.dtype, device=logits.device)
    group = ctx.tp_group if ctx.tp_size > 1 else None
    logprob, entropy = linear_cross_entropy(hidden, weight, _labels(ctx).contiguous(), float(ctx.loss.temperature),
                                            "none", group)
    zero = torch.zeros_like(logprob)
    return LogProbs(torch.where(ctx.loss_mask, logprob, zero), torch.where(ctx.loss_mask, entropy, zero))


# ---------------------------------------------------------------- the actor's loss

def _matrix_index(ctx, width=None):
    """(row, column) of every valid-sequence row of the micro-batch in verl's [sequences, response_length]
    layout, the number of sequences and the width."""
    seqs = ctx.sequences
    real = seqs >= 0
    order = torch.unique(seqs[real])  # sorted; one matrix row per sequence present
    row = torch.searchsorted(order, seqs.clamp(min=0))
    col = torch.zeros_like(seqs)
    for s in order.tolist():
        where = (seqs == s).nonzero().flatten()
        col[where] = torch.arange(where.numel(), device=seqs.device)
    longest = int(col[real].max()) + 1 if bool(real.any()) else 1
    width = width or longest
    if width < longest:
        raise ValueError(f"a sequence has {longest} rows, more than the response length {width}")
    return row, col, real, int(order.numel()), width


def _to_matrix(values, index, fill=0.0):
    row, col, real, b, width = index
    out = torch.full((b, width), fill, dtype=values.dtype, device=values.device)
    return out.index_put((row[real], col[real]), values[real])


def _config(ctx, global_batch_info):
    loss = ctx.loss
    return ActorConfig(clip_ratio=loss.clip_low, clip_ratio_low=loss.clip_low, clip_ratio_high=loss.clip_high,
                       clip_ratio_c=loss.dual_clip if loss.dual_clip > 0 else 3.0,
                       global_batch_info=global_batch_info, loss_agg_mode=loss.aggregation,
                       policy_loss={"loss_mode": "gspo" if loss.ratio == "sequence" else "vanilla"})


KL_TYPES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}  # verl's names for the same estimators


def _policy_loss(logprob, entropy, ctx, global_batch_info):
    """The loss_func of verl's actors on one micro-batch (megatron_actor.py loss_func / dp_actor.py
    update_policy / losses.py ppo_loss): the policy-loss function, minus entropy_coeff x agg_loss(entropy),
    plus kl_loss_coef x agg_loss(kl_penalty)."""
    core = _load()["core"]
    loss = ctx.loss
    width = int(loss.norm_constant) if loss.aggregation == "seq-mean-token-sum-norm" else None
    index = _matrix_index(ctx, width)
    mask = _to_matrix(ctx.loss_mask, index, False)
    lp = _to_matrix(logprob, index)
    old = _to_matrix(ctx.old_logprob.float(), index)
    adv = _to_matrix(ctx.whitened_advantages().float(), index)
    config = _config(ctx, global_batch_info)
    policy_loss_fn = core.get_policy_loss_fn(config.policy_loss["loss_mode"])
    pg_loss, _ = policy_loss_fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                                loss_agg_mode=loss.aggregation, config=config, rollout_is_weights=None)
    policy_loss = pg_loss
    if entropy is not None and loss.entropy_coef:
        ent = _to_matrix(entropy, index)
        entropy_agg = core.agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=loss.aggregation, **global_batch_info)
        policy_loss = policy_loss - entropy_agg * loss.entropy_coef
    if loss.kl_penalty != "none" and loss.kl_coef:
        ref = _to_matrix(ctx.ref_logprob.float(), index)
        kld = core.kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=KL_TYPES[loss.kl_penalty])
        kl_loss = core.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=loss.aggregation, **global_batch_info)
        policy_loss = policy_loss + kl_loss * loss.kl_coef
    return policy_loss, index[3]


def megatron_actor_loss(logits, labels, ctx):
    """The legacy Megatron actor: local agg_loss per micro-batch (global_batch_info empty); Megatron divides
    by the micro-batch count and averages over DP (the runs set ga_reduce mean, grad_reduce avg)."""
    logprob, entropy = _megatron_pass(logits, ctx)
    value, _ = _policy_loss(logprob, entropy, ctx, {})
    return Reduced(value, logprob=logprob, entropy=entropy)


def _rank_sequences(ctx):
    return sum(int(torch.unique(mb.sequences[mb.sequences >= 0]).numel()) for mb in ctx.micro_batches)


def dp_actor_loss(logits, labels, ctx):
    """The legacy FSDP actor (tp 1): local agg_loss per micro-batch, x loss_scale_factor (use_dynamic_bsz:
    the micro-batch's sequences / the rank's mini-batch; 1/GA for equal micro-batches), backward; FSDP
    averages over DP (ga_reduce sum, grad_reduce avg)."""
    logprob, entropy = _fsdp_pass(logits, ctx)
    value, sequences = _policy_loss(logprob, entropy, ctx, {})
    loss_scale_factor = sequences / _rank_sequences(ctx)
    return Reduced(value * loss_scale_factor, logprob=logprob, entropy=entropy)


def engine_loss(logits, labels, ctx):
    """The new engine worker's ppo_loss (use_legacy_worker_impl=disable), log-probs from the Megatron
    helpers: agg_loss with the step's dp_size, batch_num_tokens and global_batch_size, loss_scale_factor
    H_max; the micro-batch's loss back-propagated as it is, DP-averaged (ga_reduce sum, grad_reduce avg)."""
    logprob, entropy = _megatron_pass(logits, ctx)
    info = {"dp_size": ctx.dp_size, "batch_num_tokens": ctx.num_valid_tokens,
            "global_batch_size": int(len(ctx.sequence_valid_tokens)),
            "loss_scale_factor": ctx.loss.norm_constant or None}
    value, _ = _policy_loss(logprob, entropy, ctx, info)
    return Reduced(value, logprob=logprob, entropy=entropy)


def describe(path):
    legacy = has_legacy_actors(path)
    return {"commit": git_commit(path),
            "source": "verl/utils/megatron/tensor_parallel.py, verl/utils/torch_functional.py, "
                      "verl/trainer/ppo/core_algos.py" + ("" if legacy else
                                                          " (engine workers only: no legacy actors)")}


# ---------------------------------------------------------------- runs

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _policy_cases(cases):
    """The four RL cases (rl-*), the rows the page's verl tables have held since b178a3cd."""
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") == "policy" and name.startswith("rl-"):
            yield name, case, loss


def _sweep_layouts(case, max_ranks=8):
    """The case's "sweep" product where V splits evenly over tp (Megatron's shards), up to 8 processes."""
    import itertools
    layout, sweep = case.get("layout", {}), case.get("sweep", {})
    axes = {k: sweep.get(k, [layout.get(k, 1)]) for k in ("tp", "cp", "dp", "ga")}
    return [f"tp{tp}-cp{cp}-dp{dp}-ga{ga}" for tp, cp, dp, ga in itertools.product(*axes.values())
            if case["shape"]["vocab"] % tp == 0 and tp * cp * dp <= max_ranks]


def runs(cases):
    out = []
    fn = lambda f: f"{__name__}:{f}"  # noqa: E731
    legacy_actors = has_legacy_actors()  # the legacy actors' runs only where the checkout has them (verl #6067)
    for name, case, loss in _policy_cases(cases):
        layout = case.get("layout", {})
        vocab = case["shape"]["vocab"]
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):  # the log-prob pass, per token, at the case's own cp / dp / ga
            if vocab % tp == 0:
                out.append(Run(fn("megatron_logprobs"), name, {"tp": tp, **rest}))
        out.append(Run(fn("fsdp_logprobs"), name, {"tp": 1, **rest}))
        if case.get("inputs", {}).get("dtype", "fp32") != "fp32":
            out.append(Run(fn("fsdp_logprobs_fp32"), name, {"tp": 1, **rest}, {}, "diagnostic: logits upcast first"))
        sweep = _sweep_layouts(case)
        if len(sweep) > 1:
            out.append(Run(fn("megatron_logprobs"), name, {}, {}, "", sweep=sweep))
        if loss.get("objective", "policy_loss") != "policy_loss":
            continue
        # the actor's loss: no CP (verl gathers CP chunks to whole sequences before its loss_func)
        base = {"cp": 1, **{k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}}
        sets = {}
        notes = []
        if loss.get("ratio", "token") == "token" and not loss.get("dual_clip", 0):
            sets["loss.dual_clip"] = 3.0  # verl's vanilla loss always applies clip_ratio_c (default 3)
            notes.append("dual clip 3 (verl's default)")
        if loss.get("ratio", "token") == "sequence" and loss.get("dual_clip", 0):
            sets["loss.dual_clip"] = 0  # compute_policy_loss_gspo clips the ratio to [1 - low, 1 + high] only
            notes.append("no dual clip (verl's GSPO has none)")
        if loss.get("aggregation") == "seq-mean-token-sum-norm" and not loss.get("norm_constant"):
            sets["loss.norm_constant"] = 64
        legacy = {**sets, "framework.grad_reduce": "avg", "framework.ga_reduce": "mean"}
        fsdp = {**sets, "framework.grad_reduce": "avg", "framework.ga_reduce": "sum"}
        note = ", ".join(notes)
        for tp in (1, 2, 4):
            if vocab % tp == 0:
                if legacy_actors:
                    out.append(Run(fn("megatron_actor_loss"), name, {"tp": tp, **base}, legacy, note))
                out.append(Run(fn("engine_loss"), name, {"tp": tp, **base}, fsdp, note))
        if not legacy_actors:
            continue
        out.append(Run(fn("dp_actor_loss"), name, {"tp": 1, **base}, fsdp, note))
        if case.get("inputs", {}).get("dtype", "fp32") != "fp32":  # the normalisation alone, without the
            # 16-bit log-prob and entropy of the FSDP actor's torch helpers (fsdp_logprobs' runs)
            out.append(Run(fn("dp_actor_loss"), name, {"tp": 1, **base}, {**fsdp, "inputs.dtype": "fp32"},
                           ", ".join(notes + ["fp32 logits"])))
    if os.environ.get("LV_VERL_FUSED"):  # the fused Triton kernel (CUDA: judge.py --device cuda --backend gloo):
        # bf16 logits (an exact identity GEMM), tp 1/2/4
        for name, case, loss in _policy_cases(cases):
            layout = case.get("layout", {})
            rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
            for tp in (1, 2, 4):
                if case["shape"]["vocab"] % tp == 0:
                    out.append(Run(fn("fused_logprobs"), name, {"tp": tp, **rest}, {"inputs.dtype": "bf16"},
                                   "bf16 logits"))
    # every aggregation mode on the GRPO case (token ratio): legacy Megatron actor, engine, legacy FSDP actor;
    # its layout gives each rank micro-batches of 2 and 1 sequences (round-robin placement), dp 1 x ga 2 two
    # micro-batches of 3, and ga 1 one micro-batch per rank
    grpo = "rl-grpo-tp2-dp2-ga2"
    if grpo in cases:
        legacy = {"framework.grad_reduce": "avg", "framework.ga_reduce": "mean"}
        fsdp = {"framework.grad_reduce": "avg", "framework.ga_reduce": "sum"}
        for mode in AGGREGATIONS:
            sets = {"loss.aggregation": mode}
            if mode == "seq-mean-token-sum-norm":
                sets["loss.norm_constant"] = 64
            if mode != cases[grpo]["loss"].get("aggregation"):
                if legacy_actors:
                    out.append(Run(fn("megatron_actor_loss"), grpo, {"tp": 2, "dp": 2, "ga": 2}, {**sets, **legacy},
                                   mode))
                out.append(Run(fn("engine_loss"), grpo, {"tp": 2, "dp": 2, "ga": 2}, {**sets, **fsdp}, mode))
                if legacy_actors:
                    out.append(Run(fn("dp_actor_loss"), grpo, {"tp": 1, "dp": 2, "ga": 2}, {**sets, **fsdp}, mode))
            if legacy_actors:
                out.append(Run(fn("megatron_actor_loss"), grpo, {"tp": 2, "dp": 1, "ga": 2}, {**sets, **legacy},
                               mode + ", equal micro-batches"))
                out.append(Run(fn("megatron_actor_loss"), grpo, {"tp": 2, "dp": 2, "ga": 1}, {**sets, **legacy},
                               mode + ", ga 1"))
            out.append(Run(fn("engine_loss"), grpo, {"tp": 2, "dp": 2, "ga": 1}, {**sets, **fsdp}, mode + ", ga 1"))
        # sweeps: the engine (correct normalisation) over tp x dp x ga, the invariance between layouts
        out.append(Run(fn("engine_loss"), grpo, {}, fsdp, "", sweep=[
            f"tp{tp}-cp1-dp{dp}-ga{ga}" for tp in (1, 2, 4) for dp in (1, 2) for ga in (1, 2)]))
    return out
