"""slime's Megatron policy loss, imported from a checkout: `slime/backends/megatron_utils/loss.py`
(`loss_function` -> `policy_loss_function`: `get_log_probs_and_entropy` over the vocabulary-parallel
`calculate_log_probs_and_entropy` of `slime/utils/ppo_utils.py`, `compute_policy_loss` with dual clip,
`compute_gspo_kl` on the log-probs all-gathered over CP for GSPO, `compute_approx_kl`, the per-sample
reducer `cp_utils.get_sum_of_sample_mean`, and the loss rescaling for Megatron), with advantage whitening
by `slime/utils/distributed_utils.distributed_masked_whiten` over the DP x CP group as
`compute_advantages_and_returns` calls it, and Megatron's arithmetic around the returned 3-tuple:

  per-sample mean (default, calculate_per_token_loss off): slime returns
      loss x num_microbatches / step_global_batch_size x (DP x CP), normaliser 1;
      Megatron's schedule divides by max(normaliser, 1) and by num_microbatches; DDP averages the gradients
      over DP x CP (framework grad_reduce avg, ga_reduce sum): seq-mean-token-mean with each sample its own
      rollout (rollout_mask_sums = the sample's valid-token count);
  per-token (calculate_per_token_loss on): slime returns the token sum x CP and num_tokens (the sum over the
      micro-batch's samples of max(n_s, 1)); Megatron sums the gradients over DP x CP and finalize_model_grads
      divides them by num_tokens summed over the step and DP x CP (grad_reduce sum): token-mean.

The megatron.core.mpu stub is the one slime's own CPU tests install (tests/_cp_dist_helpers.py: a module
whose get_context_parallel_* answer the run's layout), extended with the TP, CP and DP x CP groups of the
run. Also stubbed, none of the math: the package __init__ files, `packaging.version` (where it is not installed) and
`slime.utils.http_utils` (unrelated imports of distributed_utils and misc), and, under torch 1.13 only,
the private c10d names distributed_utils imports for its gloo-group helpers (None where torch 1.13 lacks
them; the whitening uses none of them) and `torch.compile` (the identity: compute_policy_loss runs
eagerly). The logits are converted to float32 as
Megatron's Float16Module does on the last stage. lossverify's rows become slime's packed micro-batch: per
sample the zigzag chunks [r c, (r+1) c) and [(2 CP - r - 1) c, (2 CP - r) c) of c = ceil(L / 2 CP) rows
(lossverify's own CP split, checked row by row), each sample one prompt token and L - 1 response tokens,
the loss mask of response token j being the mask of row j.
"""
import os
import sys
import types
from argparse import Namespace

import torch
import torch.distributed as dist

from lossverify.torch import LogProbs, Reduced
from lv_frameworks import Run, checkout, git_commit, stub_module as _stub
from lv_frameworks.single_gpu import package_shell

NAME = "slime"
EXPLANATIONS = ["rl-adv-whiten-dp-only", "rl-schedule-double-divide", "rl-temperature-one-side",
                "rl-gspo-cp-local-ratio", "cp-roll-after-split", "rl-cp-extra-scale", "dp-local-mean",
                "rl-token-mean-sample-weighted"]
_modules = {}
_state = {"ctx": None}


def _mpu():
    """megatron.core.mpu as slime's CPU tests stub it, answering the current run's layout and groups."""
    c = lambda: _state["ctx"]
    return _stub(
        "megatron.core.mpu",
        get_context_parallel_world_size=lambda: c().cp_size,
        get_context_parallel_rank=lambda: c().cp_rank,
        get_context_parallel_group=lambda: c().cp_group,
        get_tensor_model_parallel_group=lambda: c().tp_group,
        get_tensor_model_parallel_rank=lambda: c().tp_rank,
        get_tensor_model_parallel_world_size=lambda: c().tp_size,
        get_data_parallel_world_size=lambda with_context_parallel=False: c().dp_size * (
            c().cp_size if with_context_parallel else 1),
        get_data_parallel_group=lambda with_context_parallel=False: c().dp_cp_group if with_context_parallel
        else c().dp_group)


def _load():
    if not _modules:
        mpu = _mpu()
        core = _stub("megatron.core", mpu=mpu)
        _stub("megatron", core=core)
        try:  # distributed_utils imports packaging.version (unrelated to the loss); stubbed only where absent
            import packaging.version  # noqa: F401
        except ImportError:
            _stub("packaging")
            _stub("packaging.version", parse=lambda v: v)
        import torch.distributed.distributed_c10d as c10d
        import torch.distributed.nn  # noqa: F401  (cp_utils calls dist.nn.all_reduce; Megatron imports it)
        for missing in ("_world", "_new_process_group_helper", "PrefixStore", "Store", "rendezvous", "Backend",
                        "default_pg_timeout"):
            if not hasattr(c10d, missing):  # torch 1.13: names distributed_utils imports for its gloo helpers
                setattr(c10d, missing, None)
        if not hasattr(torch, "compile"):
            torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
        root = os.path.join(checkout(), "slime")
        package_shell("slime", root)
        package_shell("slime.utils", os.path.join(root, "utils"))
        _stub("slime.utils.http_utils", is_port_available=lambda *a, **k: True)
        package_shell("slime.backends", os.path.join(root, "backends"))
        package_shell("slime.backends.megatron_utils", os.path.join(root, "backends", "megatron_utils"))
        from slime.backends.megatron_utils import cp_utils, loss
        from slime.utils import distributed_utils
        _modules.update(loss=loss, cp=cp_utils, dist=distributed_utils)
    return _modules


def _step_layout(ctx):
    """Over the CP group: each sequence's length L (its non-padding rows) and full loss mask by position."""
    mine = []
    for mb in ctx.micro_batches:
        for s, p, t, m in zip(mb.sequences.tolist(), mb.positions.tolist(), mb.tokens.tolist(), mb.loss_mask.tolist()):
            if s >= 0 and t >= 0:
                mine.append((s, p, bool(m)))
    everything = [None] * ctx.cp_size
    dist.all_gather_object(everything, mine, group=ctx.cp_group)
    length, mask = {}, {}
    for part in everything:
        for s, p, m in part:
            length[s] = max(length.get(s, 0), p + 1)
            mask[(s, p)] = m
    return length, mask


def _whitened(ctx, modules):
    """compute_advantages_and_returns' whitening: distributed_masked_whiten of this rank's response tokens of
    the step over the DP x CP group; {(micro-batch, row): advantage}."""
    values, masks, keys = [], [], []
    for k, mb in enumerate(ctx.micro_batches):
        for row, (s, t) in enumerate(zip(mb.sequences.tolist(), mb.tokens.tolist())):
            if s >= 0 and t >= 0:
                keys.append((k, row))
                values.append(float(mb.advantages[row]))
                masks.append(float(mb.loss_mask[row]))
    white = modules["dist"].distributed_masked_whiten(torch.tensor(values, dtype=torch.float32),
                                                      torch.tensor(masks, dtype=torch.float32),
                                                      process_group=ctx.dp_cp_group, shift_mean=True)
    return dict(zip(keys, white.tolist()))


def _batch(logits, labels, ctx, modules):
    """slime's packed micro-batch: logits [1, T, V_local] float32 and the RolloutBatch dict."""
    cp = modules["cp"]
    if "slime_layout" not in ctx.state:
        ctx.state["slime_layout"] = _step_layout(ctx)
        if ctx.loss.whiten_advantages:
            ctx.state["slime_whitened"] = _whitened(ctx, modules)
    length, full_mask = ctx.state["slime_layout"]
    rows = {(s, p): i for i, (s, p) in enumerate(zip(ctx.sequences.tolist(), ctx.positions.tolist())) if s >= 0}
    order = []
    for s in ctx.sequences.tolist():
        if s >= 0 and s not in order:
            order.append(s)
    white = ctx.state.get("slime_whitened")
    zeros = torch.zeros(ctx.current.rows, dtype=torch.float32)
    old = ctx.old_logprob.float() if ctx.old_logprob is not None else zeros  # None: objective logprob
    ref = ctx.ref_logprob.float() if ctx.ref_logprob is not None else zeros
    advantages = (ctx.advantages.float() if ctx.advantages is not None else zeros) if white is None else torch.tensor(
        [white.get((ctx.micro_batch, i), 0.0) for i in range(ctx.current.rows)], dtype=torch.float32)
    pad = logits.shape[0]  # index of a zero row
    index, batch = [], {k: [] for k in ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks",
                                        "advantages", "log_probs", "ref_log_probs", "rollout_mask_sums")}
    n_s = ctx.sequence_valid_tokens
    for s in order:
        total = length[s]
        response = total - 1
        if ctx.cp_size == 1:
            positions = list(range(total))
            local = list(range(total - 1))  # logit rows of the response tokens, in slime's order
        else:
            chunk, chunks, logits_offset, _ = cp.get_logits_and_tokens_offset_with_cp(total, response)
            positions = list(range(*chunks[0])) + list(range(*chunks[1]))
            local = list(range(*logits_offset[0])) + list(range(*logits_offset[1]))
        for p in positions:
            if p < total and (s, p) not in rows:
                raise RuntimeError(f"layout: sequence {s} position {p} is not on CP rank {ctx.cp_rank}")
            index.append(rows.get((s, p), pad) if p < total else pad)
        tokens = torch.zeros(total, dtype=torch.long)
        for p in local:
            if ctx.loss_mask[rows[(s, p)]]:
                tokens[p + 1] = labels[rows[(s, p)]]
        pick = torch.tensor([rows[(s, p)] for p in local], dtype=torch.long)
        batch["unconcat_tokens"].append(tokens)
        batch["total_lengths"].append(total)
        batch["response_lengths"].append(response)
        batch["loss_masks"].append(torch.tensor([float(full_mask.get((s, p), False)) for p in range(response)]))
        batch["advantages"].append(advantages[pick])
        batch["log_probs"].append(old[pick])
        batch["ref_log_probs"].append(ref[pick])
        batch["rollout_mask_sums"].append(torch.tensor(float(n_s[s])))
        batch.setdefault("_rows", []).append(pick)
    padded = torch.cat([logits.float(), logits.new_zeros((1, logits.shape[1]), dtype=torch.float32)])
    packed = padded[torch.tensor(index, dtype=torch.long)][None]
    return packed, batch


def _args(ctx, per_token, estimator):
    loss = ctx.loss
    kl = loss.kl_penalty not in ("none", None) and loss.kl_coef > 0
    return Namespace(
        loss_type="policy_loss", calculate_per_token_loss=per_token, recompute_loss_function=False,
        allgather_cp=False, rollout_temperature=loss.temperature, rollout_top_p=1.0, log_probs_chunk_size=-1,
        advantage_estimator=estimator, use_rollout_logprobs=False, use_opsm=False, eps_clip=loss.clip_low,
        eps_clip_high=loss.clip_high, eps_clip_c=loss.dual_clip if loss.dual_clip > 0 else None,
        get_mismatch_metrics=False, use_tis=False, custom_pg_loss_reducer_function_path=None,
        entropy_coef=loss.entropy_coef, use_kl_loss=kl, kl_loss_type=loss.kl_penalty if kl else "k3",
        kl_loss_coef=loss.kl_coef if kl else 0.0, use_unbiased_kl=False)


def _step(logits, labels, ctx, estimator):
    modules = _load()
    _state["ctx"] = ctx
    per_token = ctx.loss.aggregation == "token-mean"
    packed, batch = _batch(logits, labels, ctx, modules)
    args = _args(ctx, per_token, estimator)
    batch.pop("_rows")
    loss, normalizer, _ = modules["loss"].loss_function(args, batch, ctx.ga, ctx.num_sequences, packed)
    if per_token:  # finalize_model_grads: / (num_tokens of the step, summed over DP x CP)
        if "slime_tokens" not in ctx.state:
            total = torch.zeros((), dtype=torch.float64)
            for mb in ctx.micro_batches:
                seqs = [s for s in dict.fromkeys(mb.sequences.tolist()) if s >= 0]
                total += float(sum(max(int(ctx.sequence_valid_tokens[s]), 1) for s in seqs))
            dist.all_reduce(total, group=ctx.dp_cp_group)
            ctx.state["slime_tokens"] = float(total)
        out = loss / ctx.state["slime_tokens"]
    else:  # the schedule: / max(normaliser, 1) / num_microbatches
        out = loss / torch.clamp(normalizer, min=1) / ctx.ga
    return Reduced(out)


def policy_loss(logits, labels, ctx):
    """loss_function with advantage_estimator grpo (per-token ratio; dual clip where the case has one)."""
    return _step(logits, labels, ctx, "grpo")


def gspo_loss(logits, labels, ctx):
    """loss_function with advantage_estimator gspo (sequence ratio over the CP-gathered log-probs)."""
    return _step(logits, labels, ctx, "gspo")


def logprob_entropy(logits, labels, ctx):
    """The trainer's log-prob pass: `get_log_probs_and_entropy(logits, with_entropy=True)` (temperature,
    vocabulary-parallel `calculate_log_probs_and_entropy`, per-sample extraction), its per-sample response
    log-probabilities and entropies put back on lossverify's rows (LogProbs)."""
    modules = _load()
    _state["ctx"] = ctx
    packed, batch = _batch(logits, labels, ctx, modules)
    args = _args(ctx, False, "grpo")
    _, out = modules["loss"].get_log_probs_and_entropy(
        packed, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=True)
    rows = torch.cat(batch["_rows"])
    logprob = logits.new_zeros(ctx.current.rows, dtype=torch.float32).index_add(0, rows, torch.cat(out["log_probs"]))
    entropy = logits.new_zeros(ctx.current.rows, dtype=torch.float32).index_add(0, rows, torch.cat(out["entropy"]))
    valid = ctx.loss_mask
    return LogProbs(torch.where(valid, logprob, torch.zeros_like(logprob)),
                    torch.where(valid, entropy, torch.zeros_like(entropy)))


def describe(path):
    return {"commit": git_commit(path),
            "source": "slime/backends/megatron_utils/loss.py, slime/utils/ppo_utils.py, cp_utils.py"}


def _labels(layouts):
    return [f"tp{l['tp']}-cp{l['cp']}-dp{l['dp']}-ga{l['ga']}" for l in layouts]


def runs(cases):
    """The policy_loss cases at tp 1, 2, 4 (V divisible: slime derives a rank's columns from the shard width)
    and cp 1, 2 with the case's dp and ga, in slime's two modes (seq-mean-token-mean: the per-sample mean;
    token-mean: the per-token loss), with Megatron's framework model for each, and a sweep per case and mode
    over the case's own sweep layouts; and the log-prob pass (`logprob_entropy`) on every policy case at its own
    cp, dp, ga and tp 1, 2, 4 where V divides, the harness building the case's objective on it. slime has no Dr. GRPO mode, and lossverify's --set cannot remove the
    Dr. GRPO case's norm_constant: that case is left out (the report runs it through derived case files)."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy":
            continue
        layout = case.get("layout", {})
        vocab = case["shape"]["vocab"]
        lp_rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):  # the log-prob pass on every policy case (LogProbs: the case's objective on it)
            if vocab % tp == 0 and not loss.get("norm_constant"):
                out.append(Run(f"{__name__}:logprob_entropy", name, {"tp": tp, **lp_rest}, {}, "log-prob pass"))
        if loss.get("objective", "policy_loss") != "policy_loss":
            continue
        if loss.get("norm_constant"):
            continue
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}
        function = f"{__name__}:{'gspo_loss' if loss.get('ratio', 'token') == 'sequence' else 'policy_loss'}"
        vocab = case["shape"]["vocab"]
        for aggregation in ("seq-mean-token-mean", "token-mean"):
            over = {"loss.aggregation": aggregation,
                    "framework.grad_reduce": "avg" if aggregation != "token-mean" else "sum",
                    "framework.ga_reduce": "sum"}
            for tp in (1, 2, 4):
                if vocab % tp:
                    continue
                for cp in (1, 2):
                    out.append(Run(function, name, {"tp": tp, "cp": cp, **rest}, over, aggregation))
            sweep = case.get("sweep", {})
            own = {k: layout.get(k, 1) for k in ("tp", "cp", "dp", "ga")}
            layouts = [{"tp": tp, "cp": cp, "dp": dp, "ga": ga}
                       for tp in sweep.get("tp", [own["tp"]]) for cp in sweep.get("cp", [own["cp"]])
                       for dp in sweep.get("dp", [own["dp"]]) for ga in sweep.get("ga", [own["ga"]]) if vocab % tp == 0]
            out.append(Run(function, name, None, over, aggregation, sweep=_labels(layouts)))
    return out
