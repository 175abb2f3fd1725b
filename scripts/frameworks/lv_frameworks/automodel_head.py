"""NeMo Automodel's LM-head losses on lossverify's LM-head cases (`head-ce-*`), imported from a checkout and called
through the recipe's own dispatcher, `nemo_automodel.components.loss.utils.calculate_loss`, as
recipes/llm/train_ft.py calls it:

- `ChunkedCrossEntropy` (components/loss/chunked_ce.py; reduction "sum", its default and the recipe's, which runs its
  `_ChunkedCrossEntropySum`: each chunk of `chunk_len` rows upcast to fp32 for the log-sum-exp, the fp32 softmax
  recomputed in backward and rounded once to the logits' dtype). It takes the model's logits, so the model's output
  layer is written out as torchtune_head writes it: `F.linear(h, W.to(ctx.dtype))`, a Hugging Face `lm_head`
  without bias in the model's dtype, one micro-batch's packed rows as a batch of one. chunk_len 32 (its default)
  and 4.
- `FusedLinearCrossEntropy` (components/loss/linear_ce.py): it calls Apple Cut Cross-Entropy's
  `linear_cross_entropy(hidden_states, lm_weight, targets=labels, ignore_index=, softcap=, reduction="sum",
  shift=False, filter_eps=None)` with the default impl, which on Linux is the Triton kernel ("cce"): there is no
  argument that selects CCE's torch path, so it runs on a GPU only (on a CPU, CCE's import of its Triton module
  fails and linear_ce.py raises its missing-package error). cut_cross_entropy is imported from LV_CCE_CHECKOUT, or
  from a `cut_cross_entropy/` folder inside the checkout, or as installed. The weight is passed as a plain tensor
  (`materialize_lm_weight` returns it unchanged: no FSDP DTensor here), `W.to(ctx.dtype)` as the model holds it.

The recipe's normalisation (train_ft.py `_run_train_optim_step` and `_forward_backward_step`): `num_label_tokens` is
the step's count of labels != -100 over every micro-batch, all-reduced over DP (the batches hold whole sequences
before the CP split, so it counts every CP rank's tokens: lossverify's N_v); the loss is `sum / num_label_tokens`
(the loss's own `num_label_tokens` argument), back-propagated as `local_loss * dp_group_size(include_cp=True)`, and
FSDP averages the gradients over DP x CP (the case's framework model). Neither loss is vocabulary-parallel
(linear_ce.py refuses tensor-parallel layouts), so the runs are at tp 1; ignore_index -100, the recipe's.

The two loss files and utils.py are loaded unmodified, as is nemo_automodel/shared/import_utils.py (it holds the
missing-package message linear_ce.py imports). Stubbed: only the package __init__ files above them (package shells),
and, on torch < 2 without Triton, cut_cross_entropy's own import fails as it does for a user without Triton
(HAVE_CUT_CROSS_ENTROPY False), which leaves FusedLinearCrossEntropy unrunnable and ChunkedCrossEntropy's sum path
untouched (it uses no torch.compile).
"""
import os
import sys

import torch.nn.functional as F

from lossverify.torch import Reduced
from lv_frameworks import Run, checkout, git_commit, head_cross_entropy_cases, head_overrides, triton_gpu, with_fp32
from lv_frameworks.single_gpu import package_shell

NAME = "NeMo Automodel"
EXPLANATIONS = ["head-dw-16bit-accumulate", "head-target-rounded-early", "head-softcap-dropped",
                "head-dh-shard-partial", "head-dh-double-reduce", "head-bias-repeated"]
IGNORE_INDEX = -100  # the recipe counts labels != -100
CHUNK_LENS = (32, 4)  # 32: ChunkedCrossEntropy's default chunk_len
_modules = {}


def _cce_path():
    """Where cut_cross_entropy is imported from: LV_CCE_CHECKOUT, the checkout itself when it holds a copy, or the
    installed package (None)."""
    explicit = os.environ.get("LV_CCE_CHECKOUT")
    if explicit:
        return explicit
    inside = checkout()
    return inside if os.path.isdir(os.path.join(inside, "cut_cross_entropy")) else None


def _load():
    if not _modules:
        path = _cce_path()
        if path and path not in sys.path:
            sys.path.insert(0, path)
        root = os.path.join(checkout(), "nemo_automodel")
        package_shell("nemo_automodel", root)
        for package in ("shared", "components", "components.loss"):
            package_shell(f"nemo_automodel.{package}", os.path.join(root, *package.split(".")))
        import importlib
        _modules["utils"] = importlib.import_module("nemo_automodel.components.loss.utils")
        _modules["chunked"] = importlib.import_module("nemo_automodel.components.loss.chunked_ce")
        _modules["linear"] = importlib.import_module("nemo_automodel.components.loss.linear_ce")
    return _modules


def _recipe(local_loss, ctx):
    """`(local_loss * dp_group_size(include_cp=True)).backward()`; FSDP's average over DP x CP is the case's
    framework model."""
    return Reduced(local_loss * ctx.dp_size * ctx.cp_size, num_tokens=ctx.num_valid_tokens)


def _chunked(chunk_len, h, W, b, labels, ctx):
    modules = _load()
    loss_fn = modules["chunked"].ChunkedCrossEntropy(chunk_len=chunk_len, ignore_index=IGNORE_INDEX)
    logits = F.linear(h, W.to(ctx.dtype)).unsqueeze(0)  # the model's lm_head: [1, rows, V] in its dtype
    local = modules["utils"].calculate_loss(loss_fn, logits=logits, labels=labels.unsqueeze(0), model=None,
                                            hidden_states=None, lm_weight=None,
                                            num_label_tokens=ctx.num_valid_tokens)
    return _recipe(local, ctx)


def chunked_ce_32(h, W, b, labels, ctx):
    """ChunkedCrossEntropy(chunk_len=32), its default, on the model's logits."""
    return _chunked(32, h, W, b, labels, ctx)


def chunked_ce_4(h, W, b, labels, ctx):
    """ChunkedCrossEntropy(chunk_len=4)."""
    return _chunked(4, h, W, b, labels, ctx)


def fused_linear_ce(h, W, b, labels, ctx):
    """FusedLinearCrossEntropy (CCE's Triton kernel, filter_eps None, reduction sum) on h and the model's weight."""
    modules = _load()
    loss_fn = modules["linear"].FusedLinearCrossEntropy(ignore_index=IGNORE_INDEX,
                                                        logit_softcapping=ctx.loss.softcap or 0)
    weight = loss_fn.materialize_lm_weight(W.to(ctx.dtype), grad_reduce_group=None)
    local = modules["utils"].calculate_loss(loss_fn, logits=None, labels=labels.unsqueeze(0), model=None,
                                            hidden_states=h.unsqueeze(0), lm_weight=weight,
                                            num_label_tokens=ctx.num_valid_tokens, grad_reduce_group=None)
    return _recipe(local, ctx)


def describe(path):
    return {"commit": git_commit(path),
            "source": "nemo_automodel/components/loss/chunked_ce.py, linear_ce.py, utils.py"}


def runs(cases):
    """Every shipped cross-entropy LM-head case with a token-mean loss (the recipe's sum over num_label_tokens: no
    reduction none, so not the upstream-weights case) at tp 1 with its cp, dp and ga, without sequence parallelism;
    what the losses lack turned off: bias (Hugging Face's lm_head has none), label smoothing, z-loss; ignore_index
    -100. In the case's dtype and, for a bf16 case, fp32 too. ChunkedCrossEntropy at chunk_len 32 and 4;
    FusedLinearCrossEntropy only where Triton and a GPU are present."""
    out = []
    functions = [f"chunked_ce_{n}" for n in CHUNK_LENS] + (["fused_linear_ce"] if triton_gpu() else [])
    for name, case, loss in head_cross_entropy_cases(cases, upstream=False):
        overrides, notes = head_overrides(case, loss, without=("label_smoothing", "z_loss_weight"),
                                          ignore_index=IGNORE_INDEX, bias=False, sp=False)
        layout = {"tp": 1, **{k: case.get("layout", {}).get(k, 1) for k in ("cp", "dp", "ga")}}
        for these, said in with_fp32(case, overrides, notes):
            for function in functions:
                out.append(Run(f"{__name__}:{function}", name, layout, these, said))
    return out
