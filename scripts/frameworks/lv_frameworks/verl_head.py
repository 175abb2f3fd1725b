"""verl's fused LM heads on lossverify's policy LM-head case (`head-policy-*`), with real hidden states and weights,
imported from a checkout:

- `FusedLinearForPPOFunction` (verl/utils/experimental/torch_functional.py: pure PyTorch, chunked over the tokens;
  what the FSDP engine's `use_fused_kernels` with `impl_backend: torch` calls from
  verl/models/transformers/dense_common.py `forward_with_torch_backend`: `FusedLinearForPPO().forward(hidden_states,
  self.lm_head.weight, rolled_labels, temperature)`, chunk_size 512), at tp 1 (it takes the whole weight), at chunk
  sizes 4, 16 and 512;
- `linear_cross_entropy` (verl/utils/kernel/linear_cross_entropy.py with kernels.py: Triton, CUDA only), as the
  Megatron engine's fused forward calls it (verl/models/mcore/model_forward_fused.py: `linear_cross_entropy(hidden,
  output_weight, labels, temperature, "none", tp_group)` after `gather_from_sequence_parallel_region` when
  sequence_parallel is on, which verl's config converter turns on at TP > 1), at tp 1, 2 and 4. Its runs are listed
  only with LV_VERL_FUSED=1 (`judge.py --device cuda --backend gloo`).

The loss side is verl's engine worker's `ppo_loss` (verl/workers/utils/losses.py) as lv_frameworks/verl.py writes it
(its `_policy_loss`, imported: `core_algos.get_policy_loss_fn` / `agg_loss` / `kl_penalty` from the checkout, with the
step's `global_batch_info`), on the log-probs and entropies the head returns; each micro-batch's loss back-propagated
as it is, DP-averaged (framework ga_reduce sum, grad_reduce avg). The `*_logprobs` functions return the head's
`LogProbs` instead, so that the harness builds the case's objective on them (judging the head alone, at the case's
own layout with CP).

The model side is written out: the weight in the model's dtype (`W.to(ctx.dtype)`: FSDP's bf16 compute parameters,
Megatron's bf16 parameters; their gradient rounded to the dtype once per micro-batch and accumulated in float32, as
FSDP's fp32 reduce and Megatron's main_grad do); labels of masked rows set to token 0 (verl's rolled input ids are
always real ids). For the Triton kernel, which asserts hidden_size % 128 == 0, h and W are padded with zero columns
to the next multiple of 128 (the products of the padding are exact zeros; its gradient columns are dropped).
Megatron's sequence-parallel region (all-gather of the token shards in the hidden dtype, reduce-scatter of dh in the
hidden dtype) is stood in for by `_SequenceParallelGather` below: process-group plumbing, the partial dh summed in
float32 in rank order and rounded once (NCCL's bf16 sum of two ranks; at tp 4 a ring may round between hops).

The modules are loaded unmodified. Stubbed, none of their math: the package __init__ files of verl, verl.utils,
verl.trainer, verl.workers; config classes (ActorConfig, AlgoConfig, omegaconf.DictConfig), `tensordict` and
`transformers` where absent (type imports), verl.utils' advantage helpers, and on torch < 2 `torch.compile` as the
identity. Megatron-LM is not needed (the head replaces its log-prob pass).
"""
import os

import torch
import torch.distributed as dist

from lossverify.torch import LogProbs, Reduced
from lv_frameworks import Run, git_commit
from lv_frameworks import verl as _verl

NAME = "verl"
EXPLANATIONS = ["head-dh-shard-partial", "head-dh-double-reduce", "head-dw-16bit-accumulate",
                "rl-logprob-16bit", "rl-temperature-16bit", "rl-token-mean-sample-weighted",
                "rl-temperature-one-side", "rl-fused-vocab-pad"]
CASE = "head-policy-bf16-tp2-cp2-ga2"
TORCH_CHUNKS = (4, 16, 512)  # 512: FusedLinearForPPO's default
_mods = {}


def _load():
    """core_algos and the torch fused head, imported from the checkout; lv_frameworks.verl's _policy_loss reads
    core_algos through its own module cache, filled here (it needs no Megatron-LM for that)."""
    if not _mods:
        _verl.stub_verl_packages(("utils.kernel", "utils.experimental", "trainer", "trainer.ppo", "workers"))
        from verl.trainer.ppo import core_algos
        from verl.utils.experimental import torch_functional as experimental
        _mods.update(core=core_algos, experimental=experimental)
        _verl._mods.setdefault("core", core_algos)
    return _mods


def _engine_loss(logprob, entropy, ctx):
    """verl's engine ppo_loss on the head's log-probs and entropies (lv_frameworks.verl's engine_loss after its
    log-prob pass): agg_loss with the step's dp_size, batch_num_tokens and global_batch_size."""
    _load()
    zero = torch.zeros_like(logprob)
    logprob = torch.where(ctx.loss_mask, logprob, zero)
    entropy = torch.where(ctx.loss_mask, entropy, torch.zeros_like(entropy))
    info = {"dp_size": ctx.dp_size, "batch_num_tokens": ctx.num_valid_tokens,
            "global_batch_size": int(len(ctx.sequence_valid_tokens)),
            "loss_scale_factor": ctx.loss.norm_constant or None}
    value, _ = _verl._policy_loss(logprob, entropy, ctx, info)
    return Reduced(value, logprob=logprob, entropy=entropy.float())


# ---------------------------------------------------------------- FusedLinearForPPO (pure PyTorch, tp 1)

def _torch_head(chunk, h, W, ctx):
    """FusedLinearForPPOFunction.apply(hidden_states, vocab_weights, input_ids, temperature, chunk_size), as
    FusedLinearForPPO.forward calls it (input_ids int64), the weight in the model's dtype."""
    if ctx.tp_size != 1:
        raise ValueError("FusedLinearForPPO takes the whole output weight (tp 1)")
    fn = _load()["experimental"].FusedLinearForPPOFunction
    return fn.apply(h, W.to(ctx.dtype), _verl._labels(ctx).to(torch.int64), float(ctx.loss.temperature), chunk)


def _torch_loss(chunk, h, W, b, labels, ctx):
    logprob, entropy = _torch_head(chunk, h, W, ctx)
    return _engine_loss(logprob, entropy, ctx)


def _torch_logprobs(chunk, h, W, b, labels, ctx):
    logprob, entropy = _torch_head(chunk, h, W, ctx)
    zero = torch.zeros_like(logprob)
    return LogProbs(torch.where(ctx.loss_mask, logprob, zero),
                    torch.where(ctx.loss_mask, entropy.float(), zero))


def torch_loss_4(h, W, b, labels, ctx):
    """FusedLinearForPPO at chunk_size 4, verl's engine ppo_loss."""
    return _torch_loss(4, h, W, b, labels, ctx)


def torch_loss_16(h, W, b, labels, ctx):
    """FusedLinearForPPO at chunk_size 16, verl's engine ppo_loss."""
    return _torch_loss(16, h, W, b, labels, ctx)


def torch_loss_512(h, W, b, labels, ctx):
    """FusedLinearForPPO at its default chunk_size 512, verl's engine ppo_loss."""
    return _torch_loss(512, h, W, b, labels, ctx)


def torch_logprobs_4(h, W, b, labels, ctx):
    """FusedLinearForPPO at chunk_size 4: its log-probs and entropies (LogProbs)."""
    return _torch_logprobs(4, h, W, b, labels, ctx)


def torch_logprobs_512(h, W, b, labels, ctx):
    """FusedLinearForPPO at chunk_size 512: its log-probs and entropies (LogProbs)."""
    return _torch_logprobs(512, h, W, b, labels, ctx)


# ---------------------------------------------------------------- linear_cross_entropy (Triton, CUDA)

def _bytes_all_gather(x, group):
    """All-gather of equal shards as bytes (gloo gathers no 16-bit floats)."""
    raw = x.detach().contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, raw, group=group)
    return [p.view(x.dtype).view(x.shape) for p in parts]


class _SequenceParallelGather(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region (tensor_parallel_output_grad=True), plumbing only: the TP
    ranks' token shards [p, H] all-gathered in their dtype; backward reduce-scatters dh in the same dtype (summed
    in float32 in rank order, rounded once)."""

    @staticmethod
    def forward(fctx, shard, group):
        fctx.group, fctx.part = group, shard.shape[0]
        return torch.cat(_bytes_all_gather(shard, group))

    @staticmethod
    def backward(fctx, grad):
        parts = _bytes_all_gather(grad.contiguous(), fctx.group)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        mine = dist.get_rank(fctx.group)
        return total[mine * fctx.part:(mine + 1) * fctx.part].to(grad.dtype).contiguous(), None


def _triton_head(h, W, ctx, sequence_parallel):
    """linear_cross_entropy(hidden, weight, labels, T, "none", tp_group) on the rank's vocabulary shard, as
    model_forward_fused.py calls it; hidden gathered from the sequence-parallel region first where it is on.
    Returns the log-probs and entropies of the micro-batch's rows."""
    _load()
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    group = ctx.tp_group if ctx.tp_size > 1 else None
    rows = ctx.current.rows
    hidden = _SequenceParallelGather.apply(h, ctx.tp_group) if sequence_parallel else h
    labels = _verl._labels(ctx)
    if hidden.shape[0] > rows:  # the sequence-parallel padding rows: label 0, dropped below
        labels = torch.cat([labels, labels.new_zeros(hidden.shape[0] - rows)])
    width = hidden.shape[1]
    size = -(-width // 128) * 128  # the kernel asserts hidden_size % 128 == 0
    weight = W.to(ctx.dtype)
    if size != width:
        hidden = torch.cat([hidden, hidden.new_zeros(hidden.shape[0], size - width)], dim=1)
        weight = torch.cat([weight, weight.new_zeros(weight.shape[0], size - width)], dim=1)
    logprob, entropy = linear_cross_entropy(hidden.contiguous(), weight.contiguous(), labels.contiguous(),
                                            float(ctx.loss.temperature), "none", group)
    return logprob[:rows], entropy[:rows]


def _sequence_parallel(ctx):
    return bool(ctx.sp) and ctx.tp_size > 1


def triton_loss(h, W, b, labels, ctx):
    """linear_cross_entropy as the Megatron engine's fused forward calls it (sequence parallelism as the layout
    has it), verl's engine ppo_loss."""
    logprob, entropy = _triton_head(h, W, ctx, _sequence_parallel(ctx))
    return _engine_loss(logprob, entropy, ctx)


def triton_logprobs(h, W, b, labels, ctx):
    """linear_cross_entropy's log-probs and entropies (LogProbs), the harness's objective on them."""
    logprob, entropy = _triton_head(h, W, ctx, _sequence_parallel(ctx))
    zero = torch.zeros_like(logprob)
    return LogProbs(torch.where(ctx.loss_mask, logprob, zero), torch.where(ctx.loss_mask, entropy, zero))


def describe(path):
    return {"commit": git_commit(path),
            "source": "verl/utils/experimental/torch_functional.py (FusedLinearForPPO), "
                      "verl/utils/kernel/linear_cross_entropy.py, verl/trainer/ppo/core_algos.py"}


def runs(cases):
    """The policy LM-head case: FusedLinearForPPO at tp 1 (cp 1 for the engine's loss, which verl computes on
    whole sequences; the case's cp 2 for its LogProbs), bf16 and fp32, at chunk sizes 4, 16 and 512; with
    LV_VERL_FUSED=1 the Triton kernel at tp 1, 2 and 4 (sequence parallelism at tp > 1, as verl's config has it,
    and once at tp 2 without it), bf16 and fp32."""
    out = []
    if CASE not in cases:
        return out
    case = cases[CASE]
    layout = case.get("layout", {})
    rest = {k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}
    fsdp = {"framework.grad_reduce": "avg", "framework.ga_reduce": "sum"}
    fn = lambda f: f"{__name__}:{f}"  # noqa: E731
    for dtype in ("bf16", "fp32"):
        sets = dict(fsdp) if dtype == "bf16" else {**fsdp, "inputs.dtype": "fp32"}
        note = "" if dtype == "bf16" else "fp32"
        for chunk in TORCH_CHUNKS:
            out.append(Run(fn(f"torch_loss_{chunk}"), CASE, {"tp": 1, "cp": 1, **rest}, sets, note))
        for chunk in (4, 512):
            out.append(Run(fn(f"torch_logprobs_{chunk}"), CASE, {"tp": 1, "cp": layout.get("cp", 1), **rest},
                           {} if dtype == "bf16" else {"inputs.dtype": "fp32"}, note))
    if os.environ.get("LV_VERL_FUSED"):
        for dtype in ("bf16", "fp32"):
            extra = {} if dtype == "bf16" else {"inputs.dtype": "fp32"}
            said = [] if dtype == "bf16" else ["fp32"]
            for tp in (1, 2, 4):
                sp = {"layout.sp": True} if tp > 1 else {}
                words = ", ".join(said + (["sequence parallel"] if tp > 1 else []))
                out.append(Run(fn("triton_loss"), CASE, {"tp": tp, "cp": 1, **rest}, {**fsdp, **extra, **sp}, words))
                if dtype == "bf16":
                    out.append(Run(fn("triton_logprobs"), CASE, {"tp": tp, "cp": layout.get("cp", 1), **rest},
                                   {**extra, **sp}, words))
            out.append(Run(fn("triton_loss"), CASE, {"tp": 2, "cp": 1, **rest}, {**fsdp, **extra},
                           ", ".join(said + ["sequence_parallel off"])))
    return out
