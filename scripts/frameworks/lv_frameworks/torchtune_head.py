"""torchtune's chunked output losses on lossverify's LM-head cases (`head-ce-*`), imported from a checkout: the
current `LinearCrossEntropyLoss` (torchtune/modules/loss/cross_entropy_loss.py: it takes the hidden states, masks the
ignored tokens, splits the rows into `num_output_chunks` chunks and runs the model's output projection and an fp32
`F.cross_entropy(..., reduction="sum")` per chunk, divided by the valid-token count), and the deprecated
`CEWithChunkedOutputLoss` (ce_chunked_output_loss.py: it takes the model's logits as a list of chunks,
`TransformerDecoder.chunked_output`'s `[self.output(chunk) for chunk in h.tensor_split(n, dim=1)]`, and upcasts each
chunk to fp32 for the same sum).

The model side is written out here, as torchtune's model and recipe do it: the output projection is `F.linear(h,
W)` without bias (torchtune's `nn.Linear(embed_dim, vocab_size, bias=False)`, or `TiedLinear`) with W in the
recipe's `dtype` (bf16 in torchtune's configs: the parameters themselves are bf16, no fp32 master copy), here the
case's dtype, so `W.to(ctx.dtype)` once per micro-batch, shared by the chunks; h is the micro-batch's packed rows as
one sequence, `[1, rows, H]` (torchtune's packed datasets). The recipe's normalisation
(full_finetune_distributed.py: `loss_fn(...) * current_num_tokens` back-propagated per micro-batch, the gradients
scaled by `world_size / num_tokens` after the step, num_tokens all-reduced over DP) is applied to the loss instead
(`* current_num_tokens / ctx.num_valid_tokens / ctx.framework_factor`): the same value, but the harness judges each
micro-batch's dh, so the scale cannot wait for the step's end.

The two loss files are loaded unmodified. Stubbed around them, none of their math: the package __init__ files,
`torchtune.utils` (its `deprecated` decorator and `get_logger`), and, where torch has none (torch < 2.4),
`torch.distributed.tensor` (`DTensor`, `Shard`, `ColwiseParallel`: only tested with isinstance, never constructed at
TP 1).
"""
import logging
import os

import torch.nn.functional as F

from lossverify.torch import Reduced
from lv_frameworks import (Run, checkout, git_commit, head_cross_entropy_cases, head_overrides, stub_module as _stub,
                           with_fp32)
from lv_frameworks.single_gpu import package_shell

NAME = "torchtune"
EXPLANATIONS = ["head-dh-shard-partial", "head-dh-double-reduce", "head-dw-16bit-accumulate",
                "head-grad-output-first", "head-bias-repeated", "head-smoothing-dropped", "head-softcap-dropped",
                "head-target-rounded-early"]
STUBS = ["torchtune, torchtune.modules, torchtune.modules.loss: package shells (their __init__ files not run)",
         "torchtune.utils: deprecated (identity decorator), get_logger (logging.getLogger)",
         "torch.distributed.tensor, torch.distributed.tensor.parallel (only under torch < 2.4): DTensor, Shard, "
         "ColwiseParallel as empty classes"]
IGNORE_INDEX = -100  # torchtune's default
CHUNKS = (1, 4, 8)  # 8: torchtune's default num_output_chunks
_modules = {}


def _stub_imports():
    try:
        from torch.distributed.tensor import DTensor, Shard  # noqa: F401
        from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: F401
    except ImportError:
        class DTensor:  # isinstance(x, DTensor) is False for every tensor here
            pass

        class Shard:
            def __init__(self, dim):
                self.dim = dim

        class ColwiseParallel:
            def __init__(self, **kwargs):
                pass

        _stub("torch.distributed.tensor", DTensor=DTensor, Shard=Shard)
        _stub("torch.distributed.tensor.parallel", ColwiseParallel=ColwiseParallel)
    _stub("torchtune.utils", deprecated=lambda msg="": (lambda obj: obj), get_logger=logging.getLogger)


def _load():
    if not _modules:
        root = os.path.join(checkout(), "torchtune")
        for package in ("", ".modules", ".modules.loss"):
            package_shell("torchtune" + package, os.path.join(root, *package.split(".")[1:]))
        _stub_imports()
        import importlib
        _modules["linear"] = importlib.import_module("torchtune.modules.loss.cross_entropy_loss")
        _modules["chunked"] = importlib.import_module("torchtune.modules.loss.ce_chunked_output_loss")
    return _modules


def _recipe_scale(value, labels, ctx):
    """full_finetune_distributed's normalisation: loss * current_num_tokens, over the step's all-reduced
    num_tokens, times world_size against FSDP's averaging."""
    current_num_tokens = (labels != IGNORE_INDEX).sum()
    return Reduced(value * current_num_tokens / ctx.num_valid_tokens / ctx.framework_factor)


def _projection(W, ctx):
    """The model's output layer: F.linear with the weight in the recipe's dtype, no bias."""
    weight = W.to(ctx.dtype)
    return lambda x: F.linear(x, weight)


def _linear_ce(chunks, h, W, b, labels, ctx):
    loss = _load()["linear"].LinearCrossEntropyLoss(num_output_chunks=chunks, ignore_index=IGNORE_INDEX)
    loss.linear_projection = _projection(W, ctx)  # what set_model_output(model) sets: model.output
    value = loss(h.unsqueeze(0), labels.unsqueeze(0))
    return _recipe_scale(value, labels, ctx)


def _chunked_output_ce(chunks, h, W, b, labels, ctx):
    loss = _load()["chunked"].CEWithChunkedOutputLoss(num_output_chunks=chunks, ignore_index=IGNORE_INDEX)
    output = _projection(W, ctx)
    # TransformerDecoder.chunked_output: the output layer per chunk of the sequence
    logits = [output(chunk) for chunk in h.unsqueeze(0).tensor_split(chunks, dim=1)]
    value = loss(logits, labels.unsqueeze(0))
    return _recipe_scale(value, labels, ctx)


def linear_ce_1(h, W, b, labels, ctx):
    """LinearCrossEntropyLoss(num_output_chunks=1) on the model's bf16/fp32 projection."""
    return _linear_ce(1, h, W, b, labels, ctx)


def linear_ce_4(h, W, b, labels, ctx):
    """LinearCrossEntropyLoss(num_output_chunks=4)."""
    return _linear_ce(4, h, W, b, labels, ctx)


def linear_ce_8(h, W, b, labels, ctx):
    """LinearCrossEntropyLoss(num_output_chunks=8), torchtune's default."""
    return _linear_ce(8, h, W, b, labels, ctx)


def chunked_output_ce_1(h, W, b, labels, ctx):
    """CEWithChunkedOutputLoss(num_output_chunks=1) on TransformerDecoder.chunked_output's logits."""
    return _chunked_output_ce(1, h, W, b, labels, ctx)


def chunked_output_ce_4(h, W, b, labels, ctx):
    """CEWithChunkedOutputLoss(num_output_chunks=4)."""
    return _chunked_output_ce(4, h, W, b, labels, ctx)


def chunked_output_ce_8(h, W, b, labels, ctx):
    """CEWithChunkedOutputLoss(num_output_chunks=8), its default."""
    return _chunked_output_ce(8, h, W, b, labels, ctx)


def describe(path):
    return {"commit": git_commit(path),
            "source": "torchtune/modules/loss/cross_entropy_loss.py, torchtune/modules/loss/ce_chunked_output_loss.py"}


def runs(cases):
    """Every shipped cross-entropy LM-head case at tp 1 (cp 1, no sequence parallelism), with its dp and ga; what
    torchtune's losses lack turned off: bias (its output layer has none), label smoothing, z-loss, softcap, and
    reduction none (the loss is a token mean); ignore_index -100. Each in the case's dtype and, for a bf16 case, in
    fp32 too (the recipe's dtype: fp32), at 1, 4 and 8 chunks, through both losses."""
    out = []
    for name, case, loss in head_cross_entropy_cases(cases, upstream=False):  # torchtune's loss is a token mean
        overrides, notes = head_overrides(case, loss, without=("label_smoothing", "z_loss_weight", "softcap"),
                                          ignore_index=IGNORE_INDEX, bias=False, sp=False)
        layout = {"tp": 1, "cp": 1, **{k: case.get("layout", {}).get(k, 1) for k in ("dp", "ga")}}
        for these, said in with_fp32(case, overrides, notes):
            for function in ("linear_ce", "chunked_output_ce"):
                for chunks in CHUNKS:
                    out.append(Run(f"{__name__}:{function}_{chunks}", name, layout, these, said))
    return out
