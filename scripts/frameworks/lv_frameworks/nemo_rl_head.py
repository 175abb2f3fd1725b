"""NeMo-RL's linear-CE fusion (`use_fused_linear_logprobs`) on lossverify's policy LM-head case, with real hidden
states and weights, imported from a checkout: `nemo_rl.distributed.model_utils.from_parallel_hidden_states_to_logprobs`
-> `ChunkedDistributedHiddenStatesToLogprobs` (pure PyTorch: the sequence-parallel hidden states all-gathered over
TP, the logits of the rank's vocabulary shard computed chunk by chunk along the sequence, a vocab-parallel log-softmax,
the label's log-prob; backward recomputes each chunk, reduce-scatters dh and accumulates dW over the chunks), as
`_gpt_forward_with_linear_ce_fusion` calls it (the GPTModel.forward that `patch_gpt_model_forward_for_linear_ce_fusion`
installs), with `ClippedPGLossFn(cfg, use_fused_linear_logprobs=True)` for the loss, at tp 1, 2 and 4 on gloo, at chunk
sizes 4, 16 and 256 (256: NeMo-RL's example configs' `fused_linear_logprobs_chunk_size`).

What the adapter does around them, as NeMo-RL's Megatron worker does:
- the batch is NeMo-RL's unpacked [samples, positions] batch (GRPO asserts sequence packing off with the fusion): one
  sample per sequence of the micro-batch, h placed at (position, sample) of Megatron's [S, B, H] hidden states (zeros
  elsewhere), S padded to a multiple of TP (Megatron's sequence parallelism; at least one position past the last row,
  whose next-token log-prob the fused forward drops); input_ids [B, S] whose position p + 1 holds row p's label;
- Megatron's scatter-to-sequence-parallel region, plumbing only (`_ScatterToSequenceParallel` below: forward the
  rank's slice of S, backward all-gather): the fused function's reduce-scatter of dh then gives every TP rank the
  whole dh of its rows, as the decoder before the head receives it;
- the weight in the model's dtype (`W.to(ctx.dtype)`: Megatron's bf16 parameters, whose gradient DDP adds to an fp32
  main_grad once per micro-batch);
- vocab_start_index = tp_rank * V / TP (the patched forward's);
- the post-processing of nemo_rl/models/megatron/train.py: `forward_with_post_processing_fn` applies
  `apply_temperature_scaling(output_tensor, sampling_params)` (`output_tensor.div_(T)` when T != 1) to the model's
  output, which under the fusion is the log-probs; `prepare_loss_input` keeps them `[:, :S - 1]` in float32;
- ClippedPGLossFn(next_token_logprobs, data, global_valid_seqs = B, global_valid_toks = N of the whole step);
  the worker's `loss * num_microbatches / cp_size` undoes Megatron's schedule's division, and with
  calculate_per_token_loss DDP sums over DP (framework grad_reduce sum, ga_reduce sum): the loss back-propagated as
  it is.

The modules are loaded unmodified through lv_frameworks.nemo_rl's loader (the same stubs: package __init__ files,
tokenizer and logging helpers, pydantic/DTensor where absent). On gloo, `torch.distributed.all_gather` of 16-bit
tensors and `reduce_scatter`, which torch 1.13's gloo lacks, are wrapped (`_gloo_plumbing`: bytes, and an
all_reduce keeping the rank's part); the native calls are kept wherever they work. ClippedPGLossFn has no entropy bonus (entropy_coef 0)
and the fusion asserts no context parallelism (cp 1).
"""
import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lv_frameworks import Run, git_commit
from lv_frameworks import nemo_rl as _nemo

NAME = "NeMo-RL"
EXPLANATIONS = ["rl-kl-score-function", "rl-temperature-after-logprob", "head-dh-shard-partial", "head-dh-double-reduce",
                "head-dw-16bit-accumulate", "rl-temperature-one-side", "rl-temperature-16bit",
                "rl-logprob-untracked-allreduce"]
CASE = "head-policy-bf16-tp2-cp2-ga2"
CHUNKS = (4, 16, 256)


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Megatron's scatter_to_sequence_parallel_region on dim 0, plumbing only: forward the rank's slice, backward
    the slices all-gathered (as bytes: gloo gathers no 16-bit floats)."""

    @staticmethod
    def forward(fctx, x, group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        fctx.group = group
        part = x.shape[0] // size
        return x[rank * part:(rank + 1) * part].contiguous()

    @staticmethod
    def backward(fctx, grad):
        raw = grad.contiguous().view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(fctx.group))]
        dist.all_gather(parts, raw, group=fctx.group)
        return torch.cat([p.view(grad.dtype).view(grad.shape) for p in parts]), None


def _gloo_plumbing():
    """Where gloo lacks them (torch 1.13: no 16-bit all_gather, no reduce_scatter), the two collectives the fused
    function calls, as process-group plumbing: all_gather of 16-bit tensors as bytes, reduce_scatter as an
    all_reduce of the concatenated inputs (summed in their own dtype) keeping the rank's part. Native calls are
    kept wherever they work (NCCL, a gloo that has them)."""
    if getattr(dist, "_lv_head_plumbing", False):
        return
    native_gather, native_scatter = dist.all_gather, dist.reduce_scatter

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if dist.get_backend(group) == "gloo" and tensor.element_size() == 2 and tensor.is_floating_point():
            raw = [t.view(torch.uint8) for t in tensor_list]
            out = native_gather(raw, tensor.contiguous().view(torch.uint8), group=group, async_op=async_op)
            return out
        return native_gather(tensor_list, tensor, group=group, async_op=async_op)

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if dist.get_backend(group) != "gloo":
            return native_scatter(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(whole, op=op, group=group)
        rank = dist.get_rank(group)
        output.copy_(whole[rank * output.numel():(rank + 1) * output.numel()].view(output.shape))
        return None

    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter
    dist._lv_head_plumbing = True


def _batch(h, labels, ctx):
    """The micro-batch as NeMo-RL's [S, B, H] hidden states (S padded to a multiple of TP, at least one position
    past the last row), input_ids [B, S], a function placing per-row values at position p + 1 ([B, S]) and one taking
    [B, S - 1] next-token values back to the rows."""
    sequences = ctx.sequences
    present = sorted(set(int(s) for s in sequences.tolist() if s >= 0))
    slot = {s: i for i, s in enumerate(present)}
    valid_rows = (sequences >= 0).nonzero().squeeze(-1)
    sample = torch.tensor([slot[int(sequences[r])] for r in valid_rows.tolist()], dtype=torch.long, device=h.device)
    position = ctx.positions[valid_rows].long()
    width = int(position.max()) + 1 if len(valid_rows) else 1
    tp = ctx.tp_size
    length = -(-(width + 1) // tp) * tp
    grid = h.new_zeros((length, len(present), h.shape[-1]))
    grid = grid.index_put((position, sample), h[valid_rows])
    input_ids = torch.zeros((len(present), length), dtype=torch.long, device=h.device)
    input_ids[sample, position] = ctx.token_ids[valid_rows].clamp(min=0)
    input_ids[sample, position + 1] = torch.where(labels[valid_rows] >= 0, labels[valid_rows],
                                                  torch.zeros_like(labels[valid_rows]))

    def place(values, dtype=torch.float32):
        out = torch.zeros((len(present), length), dtype=dtype, device=h.device)
        out[sample, position + 1] = values[valid_rows].to(dtype)
        return out

    def rows(grid_values):
        out = grid_values.new_zeros(labels.shape)
        return out.index_put((valid_rows,), grid_values[sample, position])

    return grid, input_ids, place, rows, len(present)


def _fused_logprobs(chunk, h, W, labels, ctx):
    """The patched GPTModel.forward's call, then the worker's post-processing (temperature on its output,
    prepare_loss_input's slice and float32): next-token log-probs [B, S - 1], and the batch helpers."""
    _, model_utils = _nemo._load()
    _gloo_plumbing()
    grid, input_ids, place, rows, samples = _batch(h, labels, ctx)
    hidden = _ScatterToSequenceParallel.apply(grid, ctx.tp_group) if ctx.tp_size > 1 else grid
    vocab = ctx.vocab_size
    start = ctx.tp_rank * (vocab // ctx.tp_size)
    end = min((ctx.tp_rank + 1) * (vocab // ctx.tp_size), vocab)
    logprobs = model_utils.from_parallel_hidden_states_to_logprobs(
        hidden, W.to(ctx.dtype), False, input_ids, vocab_start_index=start, vocab_end_index=end,
        tp_group=ctx.tp_group, inference_only=False, cp_group=None, chunk_size=chunk)
    if ctx.loss.temperature != 1.0:  # train.py apply_temperature_scaling on the model's output tensor
        logprobs.div_(ctx.loss.temperature)
    logprobs = logprobs.to(torch.float32)[:, :input_ids.shape[1] - 1]  # prepare_loss_input
    return logprobs, input_ids, place, rows, samples


def _loss(chunk, h, W, b, labels, ctx):
    loss_module, _ = _nemo._load()
    next_token_logprobs, input_ids, place, rows, samples = _fused_logprobs(chunk, h, W, labels, ctx)
    value, stats = _nemo.clipped_pg(loss_module, next_token_logprobs, input_ids, place, samples, ctx,
                                    use_fused_linear_logprobs=True)
    logprob = rows(torch.cat([next_token_logprobs, next_token_logprobs.new_zeros(samples, 1)], dim=1))
    return Reduced(value, logprob=logprob, stats=stats, logged=value.detach().double())


def linear_ce_4(h, W, b, labels, ctx):
    """ChunkedDistributedHiddenStatesToLogprobs at chunk_size 4, ClippedPGLossFn."""
    return _loss(4, h, W, b, labels, ctx)


def linear_ce_16(h, W, b, labels, ctx):
    """ChunkedDistributedHiddenStatesToLogprobs at chunk_size 16, ClippedPGLossFn."""
    return _loss(16, h, W, b, labels, ctx)


def linear_ce_256(h, W, b, labels, ctx):
    """ChunkedDistributedHiddenStatesToLogprobs at chunk_size 256 (the example configs'), ClippedPGLossFn."""
    return _loss(256, h, W, b, labels, ctx)


def describe(path):
    return {"commit": git_commit(path),
            "source": "nemo_rl/distributed/model_utils.py (ChunkedDistributedHiddenStatesToLogprobs), "
                      "nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn)"}


def runs(cases):
    """The policy LM-head case at cp 1 (the fusion asserts no CP) with its ga, entropy bonus off (ClippedPGLossFn
    has none), tp 1, 2 and 4: as the case has it (T = 2, KL on), at T = 1, at T = 1 without KL (each chunk size; in
    fp32 too at chunks 4 and 256), and at T = 2 without KL."""
    out = []
    if CASE not in cases:
        return out
    layout = cases[CASE].get("layout", {})
    rest = {"cp": 1, **{k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}}
    base = {"loss.entropy_coef": 0, "framework.grad_reduce": "sum", "framework.ga_reduce": "sum"}
    fn = lambda f: f"{__name__}:{f}"  # noqa: E731
    t1 = {**base, "loss.temperature": 1.0}
    quiet = {**t1, "loss.kl_coef": 0}  # the head alone: T = 1, KL off (NeMo-RL's KL gradient: rl-kl-score-function)
    fp32 = {"inputs.dtype": "fp32"}
    plan = [(256, base, "entropy off"), (256, t1, "entropy off, T = 1")]
    plan += [(chunk, quiet, "entropy off, T = 1, KL off") for chunk in CHUNKS]
    plan += [(chunk, {**quiet, **fp32}, "entropy off, T = 1, KL off, fp32") for chunk in (4, 256)]
    plan += [(256, {**base, "loss.kl_coef": 0}, "entropy off, KL off")]
    for chunk, sets, note in plan:
        for tp in (1, 2, 4):
            out.append(Run(fn(f"linear_ce_{chunk}"), CASE, {"tp": tp, **rest}, sets, note))
    return out
