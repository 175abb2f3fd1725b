"""NeMo-RL's policy loss (`nemo_rl.algorithms.loss.loss_functions.ClippedPGLossFn`) on the next-token
log-probabilities of its vocabulary-parallel log-prob pass (`nemo_rl.distributed.model_utils`:
`get_next_token_logprobs_from_logits` -> `from_parallel_logits_to_logprobs` -> `DistributedLogprob`, and
`ChunkedDistributedEntropy`), imported from a checkout, at tp 1, 2 and 4 (V split evenly, as NeMo-RL
derives a shard's columns from its width), with its trainer's arithmetic around them.

The modules are loaded unmodified. Stubbed around them, none of their math: the package __init__ files,
the imports of `nemo_rl.algorithms.utils` that serve its tokenizer and logging helpers (transformers,
chat templates, TokenizerConfig, fastokens, Logger), the cross-tokenizer distillation helpers that
loss_functions.py imports (`x_token.loss_utils`), `BatchedDataDict` (a dict here), `to_local_if_dtensor`,
and, on a torch without it (1.13), `torch.distributed.tensor` (only its isinstance test runs on this path)
and pydantic's BaseModel (the config class: its defaults and the keywords given).

What the adapter does around the functions, as the DTensor policy worker (nemo_rl/models/automodel/
train.py) does: the logits divided by the temperature in place in their own dtype (`logits.div_(T)`), the
micro-batch laid out as NeMo-RL's [samples, positions] batch (one row per sequence: input_ids with the
next-token labels, token_mask, sample_mask, advantages, prev/generation/reference log-probs at the
position of the token they score, i.e. shifted by one as `data[...][:, 1:]` expects), global_valid_toks =
N and global_valid_seqs = B of the whole step (every DP rank and micro-batch), and the loss multiplied by
DP x CP before backward ("FSDP averages, we want to sum"); micro-batch gradients summed.
"""
import importlib
import importlib.util
import os

import torch

from lossverify.torch import LogProbs, Reduced
from lv_frameworks import Run, checkout, git_commit, stub_module as _stub
from lv_frameworks.single_gpu import package_shell

NAME = "NeMo-RL"
EXPLANATIONS = ["rl-logprob-untracked-allreduce", "rl-entropy-untracked-allreduce", "rl-temperature-one-side",
                "rl-token-mean-sample-weighted", "rl-microbatch-self-normalized", "rl-schedule-double-divide",
                "rl-kl-no-grad", "dp-local-mean", "ga-microbatch-mean", "rl-temperature-16bit",
                "rl-kl-score-function"]
ENTROPY_CHUNK = 16  # ChunkedDistributedEntropy's sequence chunk (any value: the chunks are independent)
_modules = {}


class _ConfigModel:
    """pydantic.BaseModel where pydantic is not installed: the class defaults, overridden by keywords."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__()

    def __init__(self, **kwargs):
        for klass in reversed(type(self).__mro__):
            for key, value in vars(klass).items():
                if not key.startswith("_") and not callable(value) and not isinstance(value, (classmethod,
                                                                                               staticmethod,
                                                                                               property)):
                    setattr(self, key, value)
        for key, value in kwargs.items():
            setattr(self, key, value)


def _stub_imports():
    try:
        import pydantic  # noqa: F401
    except ImportError:
        _stub("pydantic", BaseModel=_ConfigModel)
    try:
        import transformers  # noqa: F401
    except ImportError:
        _stub("transformers", AutoProcessor=object, AutoTokenizer=object, PreTrainedTokenizerBase=object)
    try:
        importlib.import_module("torch.distributed.tensor")
    except ImportError:  # torch 1.13: the vocab-parallel path only tests isinstance(logits, DTensor)
        class DTensor(torch.Tensor):
            pass

        def distribute_tensor(*args, **kwargs):
            raise RuntimeError("DTensor needs torch >= 2.4")

        _stub("torch.distributed.tensor", DTensor=DTensor, distribute_tensor=distribute_tensor)
    _stub("nemo_rl.data.chat_templates", COMMON_CHAT_TEMPLATES={})
    _stub("nemo_rl.models.policy", TokenizerConfig=dict)
    _stub("nemo_rl.utils.fastokens", maybe_patch_fastokens=lambda *a, **k: None)
    _stub("nemo_rl.utils.logger", Logger=object)

    class BatchedDataDict(dict):
        pass

    _stub("nemo_rl.distributed.batched_data_dict", BatchedDataDict=BatchedDataDict)
    names = ["LocalizedAlignment", "build_exact_token_map", "ce_label_mask", "chunk_average_log_probs",
             "get_sparse_projection_matrix", "next_token_accuracy", "project_student_to_teacher_vocab",
             "select_teacher_topk_indices", "slice_sparse_projection_cols", "student_next_token_ce",
             "valid_chunk_mask"]
    _stub("nemo_rl.algorithms.x_token.loss_utils", **{n: None for n in names})

    def to_local_if_dtensor(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    _stub("nemo_rl.models.dtensor.parallelize", to_local_if_dtensor=to_local_if_dtensor)


def _load():
    if not _modules:
        root = os.path.join(checkout(), "nemo_rl")
        for package in ("", ".algorithms", ".algorithms.loss", ".algorithms.x_token", ".distributed", ".data",
                        ".models", ".models.dtensor", ".utils"):
            package_shell("nemo_rl" + package, os.path.join(root, *package.split(".")[1:]))
        _stub_imports()
        from nemo_rl.algorithms.loss import loss_functions
        from nemo_rl.distributed import model_utils
        _modules["loss"] = loss_functions
        _modules["model_utils"] = model_utils
    return _modules["loss"], _modules["model_utils"]


def _tempered(logits, ctx):
    """The worker's temperature scaling: logits.div_(T) in the logits' own dtype (a copy: the harness's
    logits are a leaf)."""
    logits = logits.clone()
    if ctx.loss.temperature != 1.0:
        logits.div_(ctx.loss.temperature)
    return logits


def _batch(logits, labels, ctx):
    """The micro-batch as NeMo-RL's [samples, positions] batch: (logits [S, W + 1, V_local] with the rows at
    (sample, position) and zeros elsewhere, index (sample, position) of each row, input_ids [S, W + 1] whose
    position p + 1 holds row p's label, and a function placing per-row values at position p + 1)."""
    sequences = ctx.sequences
    present = sorted(set(int(s) for s in sequences.tolist() if s >= 0))
    slot = {s: i for i, s in enumerate(present)}
    valid_rows = (sequences >= 0).nonzero().squeeze(-1)
    sample = torch.tensor([slot[int(sequences[r])] for r in valid_rows.tolist()], dtype=torch.long,
                          device=logits.device)
    position = ctx.positions[valid_rows].long()
    width = int(position.max()) + 1 if len(valid_rows) else 1
    grid = logits.new_zeros((len(present), width + 1, logits.shape[-1]))
    grid = grid.index_put((sample, position), logits[valid_rows])
    input_ids = torch.zeros((len(present), width + 1), dtype=torch.long, device=logits.device)
    input_ids[sample, position] = ctx.token_ids[valid_rows].clamp(min=0)
    input_ids[sample, position + 1] = torch.where(labels[valid_rows] >= 0, labels[valid_rows],
                                                  torch.zeros_like(labels[valid_rows]))

    def place(values, dtype=torch.float32):
        out = torch.zeros((len(present), width + 1), dtype=dtype, device=logits.device)
        out[sample, position + 1] = values[valid_rows].to(dtype)
        return out

    def rows(grid_values):  # [S, width] next-token values back to the rows (0 on padding rows)
        out = grid_values.new_zeros(labels.shape)
        return out.index_put((valid_rows,), grid_values[sample, position])

    return grid, input_ids, place, rows, len(present)


def _logprobs(grid, input_ids, ctx, dtensor=False):
    """get_next_token_logprobs_from_logits as the workers call it: the Megatron worker with its TP group
    (vocab_parallel_group; also at tp 1), the DTensor worker (dtensor=True) with the logits as a DTensor
    sharded on the vocabulary over a TP mesh (at tp 1 plain logits: its CUDA-only non-parallel branch)."""
    _, model_utils = _load()
    if dtensor:
        if ctx.tp_size > 1:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Shard
            mesh = DeviceMesh.from_group(ctx.tp_group, ctx.device.type, mesh_dim_names=("tp",))
            shape = grid.shape[:-1] + (ctx.vocab_size,)
            grid = DTensor.from_local(grid, mesh, [Shard(grid.dim() - 1)], run_check=False, shape=torch.Size(shape),
                                      stride=(shape[1] * shape[2], shape[2], 1))
        return model_utils.get_next_token_logprobs_from_logits(input_ids=input_ids, next_token_logits=grid)
    return model_utils.get_next_token_logprobs_from_logits(
        input_ids=input_ids, next_token_logits=grid, vocab_parallel_rank=ctx.tp_rank,
        vocab_parallel_group=ctx.tp_group)


def logprob_pass(logits, labels, ctx):
    """The trainer's log-prob pass alone: get_next_token_logprobs_from_logits over the TP group (the Megatron
    worker's call; the DTensor worker reaches the same DistributedLogprob), and the entropy of
    ChunkedDistributedEntropy (which returns sum p log p = -H), on the tempered logits."""
    _, model_utils = _load()
    scaled = _tempered(logits, ctx)
    grid, input_ids, place, rows, _ = _batch(scaled, labels, ctx)
    logprob = rows(_logprobs(grid, input_ids, ctx))
    entropy = None
    if ctx.loss.entropy_coef:
        neg_entropy = model_utils.ChunkedDistributedEntropy.apply(grid, ENTROPY_CHUNK, ctx.tp_group, False)
        entropy = -rows(neg_entropy)
    return LogProbs(logprob, entropy)


def _config(ctx):
    loss, _ = _load()
    lc = ctx.loss
    kl = lc.kl_penalty if lc.kl_penalty not in (None, "none") else "k3"
    return loss.ClippedPGLossConfig(
        ratio_clip_min=lc.clip_low, ratio_clip_max=lc.clip_high,
        ratio_clip_c=lc.dual_clip if lc.dual_clip > 0 else None,
        reference_policy_kl_penalty=lc.kl_coef if lc.kl_penalty not in (None, "none") else 0.0,
        reference_policy_kl_type=kl,
        token_level_loss=lc.aggregation == "token-mean",
        sequence_level_importance_ratios=lc.ratio == "sequence")


def clipped_pg(loss_module, next_token_logprobs, input_ids, place, samples, ctx, **options):
    """ClippedPGLossFn(config, **options)(next_token_logprobs, data, global_valid_seqs=B, global_valid_toks=N) with
    the worker's data dict (each per-token input placed by `place` in the [samples, T] grid): its value, and in
    token-level mode the logged KL (kl_penalty: sum of the micro-batch's KL / N)."""
    device = next_token_logprobs.device
    old = place(ctx.old_logprob)
    data = {
        "input_ids": input_ids,
        "token_mask": place(ctx.loss_mask),
        "sample_mask": torch.ones(samples, dtype=torch.float32, device=device),
        "advantages": place(ctx.advantages),
        "prev_logprobs": old,
        "generation_logprobs": old,
        "reference_policy_logprobs": place(ctx.ref_logprob),
    }
    fn = loss_module.ClippedPGLossFn(_config(ctx), **options)
    value, metrics = fn(next_token_logprobs, data,
                        global_valid_seqs=torch.tensor(float(ctx.num_sequences), device=device),
                        global_valid_toks=torch.tensor(float(ctx.num_valid_tokens), device=device))
    stats = None
    if fn.loss_type == loss_module.LossType.TOKEN_LEVEL and fn.reference_policy_kl_penalty:
        stats = {"kl": float(metrics["kl_penalty"])}
    return value, stats


def clipped_pg_loss(logits, labels, ctx, dtensor=False):
    """ClippedPGLossFn(next_token_logprobs, data, global_valid_seqs=B, global_valid_toks=N) on the worker's
    log-prob pass, times DP x CP (the worker cancels FSDP's average); with the per-token log-probs and, in
    token-level mode, the logged KL (kl_penalty: sum of the micro-batch's KL / N)."""
    loss_module, _ = _load()
    scaled = _tempered(logits, ctx)
    grid, input_ids, place, rows, samples = _batch(scaled, labels, ctx)
    next_token_logprobs = _logprobs(grid, input_ids, ctx, dtensor)
    value, stats = clipped_pg(loss_module, next_token_logprobs, input_ids, place, samples, ctx)
    return Reduced(value * (ctx.dp_size * ctx.cp_size), logprob=rows(next_token_logprobs), stats=stats,
                   logged=value.detach().double())


def derived_case(name, case, drop):
    """A copy of a shipped case without the loss fields in `drop` (lossverify refuses a field such as
    norm_constant once the aggregation no longer uses it, and --set cannot remove one), written to a
    folder under the system's temporary directory; its path, for Run."""
    import json
    import tempfile
    folder = os.path.join(tempfile.gettempdir(), "lv_frameworks_cases")
    os.makedirs(folder, exist_ok=True)
    copy = json.loads(json.dumps(case))
    for key in drop:
        copy["loss"].pop(key, None)
    short = {"norm_constant": "no-norm", "whiten_advantages": "no-whiten", "dual_clip": "no-dual-clip"}
    copy["name"] = "-".join([name] + [short[k] for k in drop if k in short])
    path = os.path.join(folder, copy["name"] + ".json")
    with open(path, "w") as f:
        json.dump(copy, f, indent=1)
    return path


def clipped_pg_loss_dtensor(logits, labels, ctx):
    """clipped_pg_loss with the DTensor worker's log-prob call (torch >= 2.4; tp 1 needs CUDA)."""
    return clipped_pg_loss(logits, labels, ctx, dtensor=True)


def _has_dtensor():
    return importlib.util.find_spec("torch.distributed.tensor") is not None


def describe(path):
    return {"commit": git_commit(path), "source": "nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn), "
                                                  "nemo_rl/distributed/model_utils.py"}


def _tps(vocab):
    return [tp for tp in (1, 2, 4) if vocab % tp == 0]


def cleared(loss, aggregation=None, whiten=None, dual_clip=None):
    """The loss fields to remove from a case (lossverify refuses them once unused, and --set cannot remove a
    field): norm_constant when the aggregation changes from the Dr. GRPO norm, the whitening fields when
    whitening goes off (whiten=False), dual_clip when it goes off (dual_clip=0)."""
    drop = []
    if aggregation is not None and aggregation != loss.get("aggregation") and "norm_constant" in loss:
        drop.append("norm_constant")
    if whiten is False and loss.get("whiten_advantages"):
        drop += ["whiten_advantages", "whiten_epsilon"]
    if dual_clip == 0 and loss.get("dual_clip", 0):
        drop.append("dual_clip")
    return tuple(drop)


def runs(cases):
    """The four RL cases at cp 1 (NeMo-RL's CP path shards its own padded [samples, positions] batch, not
    lossverify's packed zigzag chunks) with their dp and ga; whitening off (NeMo-RL normalises rewards per
    prompt upstream of the loss), entropy bonus off (ClippedPGLossFn has none), the two aggregations
    ClippedPGLossFn has: token-mean (token_level_loss) and seq-mean-token-mean (sequence level). KL off, and
    as the case has it; a 16-bit case at T != 1 also at T = 1. The log-prob pass alone on the logprob case,
    with its entropy. One sweep per case (KL off)."""
    out = []
    fn = f"{__name__}:clipped_pg_loss"
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy":
            continue
        layout = case.get("layout", {})
        rest = {"cp": 1, **{k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}}
        tps = _tps(case["shape"]["vocab"])
        if loss.get("objective", "policy_loss") == "logprob":
            for tp in tps:
                out.append(Run(f"{__name__}:logprob_pass", name, {"tp": tp, **rest}, {},
                               "entropy of ChunkedDistributedEntropy"))
            continue
        base = {"loss.entropy_coef": 0} if loss.get("entropy_coef", 0) else {}
        sixteen_bit = case.get("inputs", {}).get("dtype", "fp32") in ("bf16", "fp16")
        aggregations = ["token-mean", "seq-mean-token-mean"]
        if loss.get("ratio") == "sequence":
            aggregations = ["seq-mean-token-mean"]  # GSPO: sequence-level loss only
        kl_on = loss.get("kl_penalty", "none") != "none" and loss.get("kl_coef", 0)
        sweep = None
        for aggregation in aggregations:
            drop = cleared(loss, aggregation=aggregation, whiten=False)
            case_file = derived_case(name, case, drop) if drop else name
            overrides = dict(base)
            if aggregation != loss.get("aggregation", "token-mean"):
                overrides["loss.aggregation"] = aggregation
            variants = [dict(overrides, **{"loss.kl_coef": 0})] if kl_on else [overrides]
            if kl_on:
                variants.append(overrides)
            quiet = variants[0]  # KL off; at T = 1 for a 16-bit case (see the section on the temperature)
            if sixteen_bit and loss.get("temperature", 1.0) != 1.0:
                quiet = dict(variants[0], **{"loss.temperature": 1.0})
                variants.append(quiet)
            for over in variants:
                for tp in tps:
                    out.append(Run(fn, case_file, {"tp": tp, **rest}, over))
            if _has_dtensor():  # the DTensor worker's path, where torch has DTensor (tp > 1: CPU and CUDA)
                for tp in tps[1:]:
                    out.append(Run(f"{__name__}:clipped_pg_loss_dtensor", case_file, {"tp": tp, **rest}, quiet))
            if sweep is None:
                sweep = Run(fn, case_file, None, quiet, "sweep",
                            sweep=[f"tp{tp}-cp1-dp{d}-ga{g}" for tp in tps[:2] for d in (1, 2) for g in (1, 2)])
        out.append(sweep)
    return out
