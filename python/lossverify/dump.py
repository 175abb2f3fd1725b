"""Writing a training step as a `lossverify.dump/1` dump, for `lossverify check-dump`.

Every rank hands over, micro-batch by micro-batch, its logits shard and what its loss computed from it,
with its coordinates, vocabulary columns and the global token of each row; the writer stores one
safetensors file per rank and, once every rank's file is on disk, the manifest, atomically:

    writer = DumpWriter("dump/", shape=(N, V), dtype="bf16", layout={"tp": 2, "dp": 2},
                        loss={"kind": "cross_entropy", "label_smoothing": 0.1, "smoothing_convention": "megatron"})
    rank = writer.rank(tp=tp_rank, cp=0, dp=dp_rank, vocab=(begin, end))
    mb = rank.begin_micro_batch(rows, logits=x, labels=y, loss_mask=m)   # copies the inputs now
    loss = my_loss(x, y); loss.backward()
    mb.finish(grad_logits=x.grad, token_loss=per_token_loss)             # and checks x, y, m are unchanged
    rank.stats(loss=logged_loss, num_tokens=global_count)
    writer.close()        # under torch.distributed: gathers to rank 0, which writes the manifest; barrier

Why the inputs are copied when the micro-batch begins: some implementations overwrite their input in
place (Megatron-LM's vocab_parallel_cross_entropy turns fp32 logits into softmax values), and a dump of
the overwritten tensor would be checked against the reference of the wrong logits. The writer stores the
values as they were, and reports the modification (a ModifiedInputWarning naming rank, micro-batch and
tensor; also in `writer.modified_inputs`).

Everything the manifest names lies inside its folder. Logged values that are not finite are written as
the strings "NaN", "Infinity" and "-Infinity" (strict JSON has no such numbers), and label smoothing
without an explicit convention is refused: PyTorch and Megatron-LM mean different targets by the same
alpha, and a guess would check the wrong one.
"""

import json
import math
import operator
import os
import warnings

import torch

from lossverify import safetensors
from lossverify.errors import DumpError
from lossverify.kinds import kind_inputs
from lossverify.layout import parse_layout

__all__ = ["DumpWriter", "RankDump", "MicroBatchDump", "ModifiedInputWarning", "rows_json", "require_convention",
           "json_number"]

MANIFEST_FORMAT = "lossverify.dump/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_INPUT_TENSORS = ("logits", "labels", "loss_mask", "teacher_logits", "grad_output", "old_logprob", "ref_logprob",
                  "advantages")
_OUTPUT_TENSORS = ("grad_logits", "token_loss", "token_logprob", "token_entropy")
# Per-row float tensors [rows]: the policy kind's inputs (old_logprob, ref_logprob, advantages before
# whitening) and what a policy loss computed per token (log-probability and entropy, 0 on masked rows).
_ROW_FLOATS = ("token_loss", "grad_output", "old_logprob", "ref_logprob", "advantages", "token_logprob",
               "token_entropy")
# The statistics a rank may log besides loss and num_tokens (policy; each a global token-mean).
POLICY_STATS = kind_inputs("policy").logged_statistics


def _kind_of(loss):
    """The KindInputs of a loss section's kind, or None for a kind the package does not know (the tool judges)."""
    try:
        return kind_inputs(loss.get("kind", "cross_entropy"))
    except ValueError:
        return None

SMOOTHING_CONVENTIONS = (
    "pytorch: q = (1-a)[v=l] + a/V (torch.nn.functional.cross_entropy's label_smoothing), or "
    "megatron: q = (1-a)[v=l] + a/(V-1)[v!=l] (Megatron-LM's vocab_parallel_cross_entropy)"
)


class ModifiedInputWarning(UserWarning):
    """The checked implementation modified one of its inputs in place."""


def require_convention(loss):
    """ValueError unless label smoothing > 0 comes with loss["smoothing_convention"]."""
    alpha = loss.get("label_smoothing", 0.0) or 0.0
    if alpha > 0 and loss.get("smoothing_convention") not in ("pytorch", "megatron"):
        raise ValueError(f"label_smoothing = {alpha} needs an explicit smoothing_convention, one of {SMOOTHING_CONVENTIONS}; "
                         "the same alpha means different targets in the two, so lossverify does not guess")


def json_number(value):
    """A logged value for the manifest: a finite float, or "NaN" / "Infinity" / "-Infinity"."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def rows_json(tokens):
    """Global token per local row (-1 = padding) as the manifest's compact list: [begin, end) ranges of
    consecutive tokens, single tokens, and {"padding": k} for runs of padding rows."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    out, i, n = [], 0, len(tokens)
    while i < n:
        j = i + 1
        if tokens[i] < 0:
            while j < n and tokens[j] < 0:
                j += 1
            out.append({"padding": j - i})
        else:
            while j < n and tokens[j] == tokens[j - 1] + 1:
                j += 1
            out.append([tokens[i], tokens[j - 1] + 1] if j - i > 1 else tokens[i])
        i = j
    return out


def _as_row_list(rows, where):
    if isinstance(rows, range):
        return list(rows)
    if isinstance(rows, tuple) and len(rows) == 2 and all(isinstance(x, int) for x in rows):
        return list(range(rows[0], rows[1]))
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.dtype.is_floating_point:
            raise DumpError(f"{where}: rows must be a 1-D integer tensor, got {rows.dtype} {list(rows.shape)}")
        return rows.tolist()
    try:
        return [int(t) for t in rows]
    except TypeError:
        raise DumpError(f"{where}: rows must be a list of global tokens (-1 = padding), a range or "
                        f"(begin, end), got {type(rows).__name__}") from None


def _whole(value):
    """A whole number: a Python, NumPy or torch integer, or a float such as 2.0; never 0.5 or True."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
        return True
    except TypeError:
        return isinstance(value, float) and value.is_integer()


def _snapshot(tensor):
    """A CPU copy that shares nothing with the live tensor."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _describe_change(name, before, after):
    """How a tensor changed: count and the first changed element (either may live on a GPU)."""
    before, after = before.detach().to("cpu"), after.detach().to("cpu")
    if after.shape != before.shape or after.dtype != before.dtype:
        return (f"{name} changed shape or dtype in place: {before.dtype} {list(before.shape)} -> "
                f"{after.dtype} {list(after.shape)}")
    same = (after == before) | (torch.isnan(after) & torch.isnan(before)) if after.is_floating_point() else (
        after == before)
    changed = (~same).nonzero()
    if changed.numel() == 0:
        return None
    first = tuple(changed[0].tolist())
    return (f"{name} was modified in place: {changed.shape[0]} of {before.numel()} elements changed, the first at "
            f"{list(first)}: {before[first].item():.6g} -> {after[first].item():.6g}")


class MicroBatchDump:
    """One micro-batch of one rank: its inputs (copied when it began) and, after `finish`, its outputs."""

    def __init__(self, rank_dump, index, rows, inputs):
        self.rank_dump = rank_dump
        self.index = index
        self.rows = rows
        self._live = {k: v for k, v in inputs.items() if v is not None}
        self.tensors = {k: _snapshot(v) for k, v in self._live.items()}
        self.finished = False

    @property
    def where(self):
        return f"{self.rank_dump.where}, micro-batch {self.index}"

    def finish(self, grad_logits=None, token_loss=None, token_logprob=None, token_entropy=None, counts=None, dh=None):
        """Record the outputs; report any input the implementation modified in place since `begin`.
        token_logprob, token_entropy: a policy loss's per-token log-probabilities and entropies [rows]; counts: a
        router's counts per expert of the micro-batch's scope as the rank holds them after their all-reduce, one per
        column of a row ([layers, experts] or flat). dh: an LM head's gradient of the micro-batch's hidden states
        [rows, H], as the rank's head returns it (a head's dump has no grad_logits: the head keeps them)."""
        if self.finished:
            raise DumpError(f"{self.where}: finish() called twice")
        head = self.rank_dump.writer.stage is not None
        if head and (dh is None or grad_logits is not None):
            raise DumpError(f"{self.where}: an LM head's micro-batch finishes with dh (the gradient of h) and no "
                            "grad_logits (the head keeps the logits' gradient inside)")
        if not head and grad_logits is None:
            raise DumpError(f"{self.where}: grad_logits is None: the loss did not reach the logits "
                            "(was backward() called, and do the logits require grad?)")
        for name, live in self._live.items():
            change = _describe_change(name, self.tensors[name], live)
            if change:
                self.rank_dump.writer._report_modified(f"{self.where}: {change}; the dump holds the values from "
                                                       "before the call")
        self._live = {}
        if head:
            self.tensors["dh"] = _snapshot(dh)
        else:
            self.tensors["grad_logits"] = _snapshot(grad_logits)
        if counts is not None:
            width = self.rank_dump.writer.vocab
            if not isinstance(counts, torch.Tensor) or counts.numel() != width:
                described = (f"{counts.dtype} {list(counts.shape)}" if isinstance(counts, torch.Tensor)
                             else type(counts).__name__)
                raise DumpError(f"{self.where}: counts must hold one value per column of a row ({width}), got "
                                f"{described}")
            self.tensors["counts"] = _snapshot(counts).reshape(width).double()
        for name, value in (("token_loss", token_loss), ("token_logprob", token_logprob),
                            ("token_entropy", token_entropy)):
            if value is not None:
                self.tensors[name] = _snapshot(value)
        self.rank_dump._validate(self)
        self.finished = True
        return self


class RankDump:
    """One rank's part of a dump: coordinates, vocabulary columns, micro-batches and logged stats."""

    def __init__(self, writer, coordinates, world_rank, vocab):
        self.writer = writer
        self.coordinates = coordinates
        self.world_rank = world_rank
        self.vocab = vocab
        self.micro_batches = []
        self.loss = None
        self.num_tokens = None
        self.statistics = {}
        self.shard = {}  # an LM head's W, b (copied when given) and dW, db of the rank's vocabulary shard
        self.file = f"rank{world_rank}.safetensors"
        self.written = False

    @property
    def where(self):
        c = self.coordinates
        return f"rank {self.world_rank} (tp={c.tp} cp={c.cp} dp={c.dp})"

    def begin_micro_batch(self, rows, logits=None, labels=None, loss_mask=None, teacher_logits=None, grad_output=None,
                          old_logprob=None, ref_logprob=None, advantages=None, h=None):
        """Start the next micro-batch: `rows` gives the global token of each row (-1: padding). The inputs
        are copied now; call `finish(grad_logits=..., token_loss=...)` on the result after backward.
        old_logprob, ref_logprob, advantages: a policy case's per-row inputs (objective policy_loss; the
        advantages before whitening). h: an LM head case's hidden states of the rows [rows, H], in place of the
        logits (the head makes them)."""
        if self.written:
            raise DumpError(f"{self.where}: already written")
        if self.micro_batches and not self.micro_batches[-1].finished:
            raise DumpError(f"{self.micro_batches[-1].where}: not finished before the next micro-batch began")
        index = len(self.micro_batches)
        if index >= self.writer.layout.ga:
            raise DumpError(f"{self.where}: more micro-batches than layout.ga = {self.writer.layout.ga}")
        row_list = _as_row_list(rows, f"{self.where}, micro-batch {index}")
        head = self.writer.stage is not None
        if head and (h is None or logits is not None):
            raise DumpError(f"{self.where}, micro-batch {index}: an LM head's dump takes h (the hidden states), not "
                            "logits (the head makes them)")
        if not head and logits is None:
            raise DumpError(f"{self.where}, micro-batch {index}: logits are required")
        mb = MicroBatchDump(self, index, row_list, {"logits": logits, "h": h, "labels": labels, "loss_mask": loss_mask,
                                                    "teacher_logits": teacher_logits, "grad_output": grad_output,
                                                    "old_logprob": old_logprob, "ref_logprob": ref_logprob,
                                                    "advantages": advantages})
        self.micro_batches.append(mb)
        return mb

    def add_micro_batch(self, rows, logits, grad_logits, labels=None, loss_mask=None, token_loss=None,
                        teacher_logits=None, grad_output=None, old_logprob=None, ref_logprob=None, advantages=None,
                        token_logprob=None, token_entropy=None):
        """A whole micro-batch at once (no in-place check: use begin_micro_batch/finish for that)."""
        mb = self.begin_micro_batch(rows, logits, labels=labels, loss_mask=loss_mask, teacher_logits=teacher_logits,
                                    grad_output=grad_output, old_logprob=old_logprob, ref_logprob=ref_logprob,
                                    advantages=advantages)
        return mb.finish(grad_logits=grad_logits, token_loss=token_loss, token_logprob=token_logprob,
                         token_entropy=token_entropy)

    def head_shard(self, W=None, b=None, dW=None, db=None):
        """An LM head's tensors of the rank's vocabulary shard: its weight rows W [columns, H] and bias b [columns]
        (inputs: give them before the step, they are copied), and their gradients dW and db over the rank's tokens
        and micro-batches, before any reduction over DP or CP (after the step's backward passes)."""
        if self.writer.stage is None:
            raise DumpError(f"{self.where}: head_shard() is for a dump with an LM head (DumpWriter(stage=...))")
        width = self.vocab[1] - self.vocab[0]
        hidden = self.writer.stage["hidden"]
        for name, value, shape in (("W", W, (width, hidden)), ("b", b, (width,)), ("dW", dW, (width, hidden)),
                                   ("db", db, (width,))):
            if value is None:
                continue
            if name in ("b", "db") and not self.writer.stage.get("bias"):
                raise DumpError(f"{self.where}: {name} given, but the head has no bias (stage bias false)")
            if value.dtype != self.writer.torch_dtype or tuple(value.shape) != shape:
                raise DumpError(f"{self.where}: {name} is {value.dtype} {list(value.shape)}, expected "
                                f"{self.writer.torch_dtype} {list(shape)} (vocabulary columns [{self.vocab[0]}, "
                                f"{self.vocab[1]}), hidden size {hidden})")
            self.shard[name] = _snapshot(value)

    def stats(self, loss=None, num_tokens=None, **statistics):
        """The values this rank logs: the reduced loss (tensor or number, may be NaN/inf) and the valid-token
        count. A tensor is stored as it is, in its dtype (a bf16 loss is judged in bf16 ulps). A kind's logged
        statistics go by name (numbers or one-element tensors): a policy loss's clip_fraction,
        dual_clip_fraction, kl and entropy (each the global token-mean over the step's valid tokens); a router's
        aux_loss and z_loss (the mean over layers of each layer's value as it enters the step's loss) and, with
        several layers, aux_loss.layer0, z_loss.layer0, ... (pass them as **{"aux_loss.layer0": v})."""
        known = self.writer.statistics
        for key, value in statistics.items():
            if key not in known:
                raise DumpError(f"{self.where}: unknown statistic {key!r} (known: loss, num_tokens"
                                f"{''.join(', ' + k for k in known)})")
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise DumpError(f"{self.where}: statistic {key} must be one number, got shape {list(value.shape)}")
                self.statistics[key] = _snapshot(value).reshape(())
            else:
                self.statistics[key] = float(value)
        if loss is not None:
            self.loss = _snapshot(loss).reshape(()) if isinstance(loss, torch.Tensor) else float(loss)
        if num_tokens is not None:
            if isinstance(num_tokens, torch.Tensor):
                self.num_tokens = _snapshot(num_tokens).reshape(())
            else:
                if int(num_tokens) != num_tokens or num_tokens < 0:
                    raise DumpError(f"{self.where}: num_tokens must be a non-negative integer, got {num_tokens!r}")
                self.num_tokens = int(num_tokens)

    def _validate(self, mb):
        """Shapes and dtypes against the manifest, named by rank, micro-batch and tensor."""
        dtype = self.writer.torch_dtype
        n = len(mb.rows)
        width = self.vocab[1] - self.vocab[0]
        for name in ("logits", "grad_logits", "teacher_logits"):
            t = mb.tensors.get(name)
            if t is None:
                continue
            if t.dtype != dtype:
                raise DumpError(f"{mb.where}: {name} is {t.dtype}, but the dump's dtype is {self.writer.dtype} ({dtype})")
            if t.dim() < 1 or t.shape[-1] != width or t.numel() != n * width:
                raise DumpError(f"{mb.where}: {name} has shape {list(t.shape)}, expected [{n}, {width}] "
                                f"({n} rows x vocabulary columns [{self.vocab[0]}, {self.vocab[1]}))")
        hidden = self.writer.stage["hidden"] if self.writer.stage is not None else None
        for name in ("h", "dh"):
            t = mb.tensors.get(name)
            if t is not None and (t.dtype != dtype or tuple(t.shape) != (n, hidden)):
                raise DumpError(f"{mb.where}: {name} is {t.dtype} {list(t.shape)}, expected {dtype} [{n}, {hidden}] "
                                f"({n} rows x hidden size {hidden})")
        for name in ("labels", "loss_mask", *_ROW_FLOATS):
            t = mb.tensors.get(name)
            if t is not None and t.numel() != n:
                raise DumpError(f"{mb.where}: {name} has {t.numel()} elements {list(t.shape)}, expected one per row ({n})")
        labels = mb.tensors.get("labels")
        if labels is not None and labels.is_floating_point():
            raise DumpError(f"{mb.where}: labels must be integers, got {labels.dtype}")
        for name in _ROW_FLOATS:
            t = mb.tensors.get(name)
            if t is not None and not t.is_floating_point():
                raise DumpError(f"{mb.where}: {name} must be floating point, got {t.dtype}")

    def _tensors_and_entry(self):
        """The rank file's tensors and the manifest entry that names them."""
        if len(self.micro_batches) != self.writer.layout.ga:
            raise DumpError(f"{self.where}: {len(self.micro_batches)} micro-batches, but layout.ga = "
                            f"{self.writer.layout.ga}")
        tensors, entry_mbs = {}, []
        for mb in self.micro_batches:
            if not mb.finished:
                raise DumpError(f"{mb.where}: begun but never finished (call finish(grad_logits=...))")
        self._match_empty_micro_batches()
        for mb in self.micro_batches:
            names = {}
            for name, t in mb.tensors.items():
                key = f"mb{mb.index}.{name}"
                tensors[key] = t
                names[name] = key
            entry_mbs.append({"rows": rows_json(mb.rows), "tensors": names})
        entry = {"rank": self.world_rank, "tp": self.coordinates.tp, "cp": self.coordinates.cp,
                 "dp": self.coordinates.dp, "vocab": list(self.vocab), "file": self.file, "micro_batches": entry_mbs}
        stats = {}
        for key, value in (("loss", self.loss), ("num_tokens", self.num_tokens), *self.statistics.items()):
            if isinstance(value, torch.Tensor):
                tensors[key] = value
                stats[key] = key
            elif value is not None:
                stats[key] = value if key == "num_tokens" else json_number(value)
        if stats:
            entry["stats"] = stats
        if self.writer.stage is not None:
            wanted = ("W", "b", "dW", "db") if self.writer.stage.get("bias") else ("W", "dW")
            missing = [name for name in wanted if name not in self.shard]
            if missing:
                raise DumpError(f"{self.where}: the LM head's {', '.join(missing)} of the rank's shard not given "
                                "(head_shard(W=..., dW=...))")
            entry["stage"] = {}
            for name in wanted:
                tensors[f"stage.{name}"] = self.shard[name]
                entry["stage"][name] = f"stage.{name}"
        return tensors, entry

    def _match_empty_micro_batches(self):
        """An empty micro-batch (no rows: a rank with fewer sequences than micro-batches) gets exactly the
        optional tensors its rank's other micro-batches have, empty: check-dump wants every micro-batch to
        dump the same things."""
        filled = [mb for mb in self.micro_batches if mb.rows]
        if not filled:
            return
        names = set(filled[0].tensors)
        width = self.vocab[1] - self.vocab[0]
        for mb in self.micro_batches:
            if mb.rows:
                continue
            for name in set(mb.tensors) - names:
                del mb.tensors[name]
            for name in names - set(mb.tensors):
                like = filled[0].tensors[name]
                if name == "counts":  # a scope without tokens counts none
                    mb.tensors[name] = torch.zeros_like(like)
                    continue
                mb.tensors[name] = like.new_empty((0, *like.shape[1:]))

    def write(self):
        """Write this rank's file; returns its manifest entry (done by DumpWriter.close)."""
        tensors, entry = self._tensors_and_entry()
        safetensors.save_file(tensors, os.path.join(self.writer.directory, self.file),
                              metadata={"writer": "lossverify.dump", "rank": str(self.world_rank)})
        self.written = True
        return entry


class DumpWriter:
    """A dump of one training step: the manifest's global fields, and the ranks this process writes.

    shape: (tokens, vocab) or {"tokens": N, "vocab": V}; dtype: "fp32" | "bf16" | "fp16" (logits and
    gradients); loss: the case file's loss section (kind, label_smoothing + smoothing_convention,
    z_loss_weight, ignore_index, softcap, reduction, temperature, t2_scaling; policy: objective, clip_low,
    clip_high, dual_clip, kl, kl_coef, entropy_coef, aggregation, norm_constant, whiten_advantages,
    whiten_epsilon; router: top_k, layers, score, aux_coef, ..., with shape's vocab the row's width, layers x
    experts); layout: {"tp", "cp", "dp", "ga", "sp"}; framework: {"grad_reduce": "avg" | "sum", "ga_reduce": "sum" | "mean"}; cu_seqlens: packed
    sequence offsets [0, ..., N] (optional); warn: emit a ModifiedInputWarning for each input modified in
    place (they are collected in `modified_inputs` either way); logged_loss_precision: the precision the logged
    losses carry when they are stored wider ("bf16" for a bf16 loss logged with .float() or .item()); stage: an
    LM head in front of the loss (the case's stage section, {"kind": "lm_head", "hidden": H, "bias": ...}): each
    micro-batch then gives h and dh instead of logits and grad_logits, and each rank its shard's W, b, dW and db
    (RankDump.head_shard).
    """

    def __init__(self, directory, shape, dtype, loss, layout, framework=None, cu_seqlens=None, implementation=None,
                 name=None, description=None, tolerances=None, timeout_seconds=None, warn=True,
                 logged_loss_precision=None, stage=None):
        if isinstance(shape, dict):
            shape = (shape["tokens"], shape["vocab"])
        if len(shape) != 2 or not all(_whole(v) and v >= 1 for v in shape):
            raise DumpError(f"shape must be two whole positive numbers (tokens, vocab), got {tuple(shape)!r}")
        self.tokens, self.vocab = int(shape[0]), int(shape[1])
        if dtype not in DTYPES:
            raise DumpError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not isinstance(loss, dict):
            raise DumpError(f"loss must be the loss section as a dict, got {type(loss).__name__}")
        require_convention(loss)
        self.directory = os.path.abspath(os.fspath(directory))
        self.dtype = dtype
        self.torch_dtype = DTYPES[dtype]
        self.loss = dict(loss)
        kind = _kind_of(self.loss)
        self.statistics = kind.statistics(self.loss) if kind else ()
        self.whole_rows = bool(kind and kind.whole_rows)
        self.shape = {"tokens": self.tokens, "vocab": self.vocab}
        if kind and kind.column_axis != "vocab":
            blocks = kind.blocks(self.loss)
            if self.vocab % blocks:
                raise DumpError(f"shape: a row of {self.vocab} columns does not hold {blocks} blocks of "
                                f"{kind.column_axis} ({kind.row_blocks} = {blocks})")
            self.shape = {"tokens": self.tokens, kind.column_axis: self.vocab // blocks}
        try:
            self.layout = parse_layout(layout)
        except ValueError as e:
            raise DumpError(str(e)) from None
        self.framework = dict(framework) if framework else None
        self.cu_seqlens = [int(c) for c in cu_seqlens] if cu_seqlens is not None else None
        self.implementation = implementation
        self.name = name
        self.description = description
        self.tolerances = tolerances
        self.timeout_seconds = timeout_seconds
        if logged_loss_precision is not None and logged_loss_precision not in DTYPES:
            raise DumpError(f"logged_loss_precision must be one of {', '.join(DTYPES)}, got {logged_loss_precision!r}")
        self.logged_loss_precision = logged_loss_precision
        if stage is not None and (not isinstance(stage, dict) or stage.get("kind") != "lm_head"
                                  or not _whole(stage.get("hidden")) or stage.get("hidden") < 1):
            raise DumpError(f"stage must be an LM head's stage section {{\"kind\": \"lm_head\", \"hidden\": H, "
                            f"...}}, got {stage!r}")
        self.stage = dict(stage) if stage is not None else None
        self.ranks = []
        self.modified_inputs = []
        self.warn = warn  # False: only collect modified_inputs (the harness reports them in its Report)
        self.manifest_path = os.path.join(self.directory, "manifest.json")
        os.makedirs(self.directory, exist_ok=True)

    def rank(self, tp=0, cp=0, dp=0, vocab=None):
        """A rank this process writes, by its coordinates; vocab = its columns (begin, end)."""
        layout = self.layout
        for key, value, size in (("tp", tp, layout.tp), ("cp", cp, layout.cp), ("dp", dp, layout.dp)):
            try:
                value = operator.index(value)  # Python, NumPy and torch integers; never 0.5
            except TypeError:
                raise DumpError(f"{key} = {value!r}: a rank coordinate is an integer") from None
            if not 0 <= value < size:
                raise DumpError(f"{key} = {value} outside [0, {size}) of the layout {layout.label}")
        whole = vocab is not None and len(vocab) == 2 and all(_whole(v) for v in vocab)
        if not whole or not 0 <= vocab[0] < vocab[1] <= self.vocab:
            raise DumpError(f"rank tp={tp} cp={cp} dp={dp}: vocab must be its columns (begin, end) inside "
                            f"[0, {self.vocab}), got {vocab!r}")
        world_rank = layout.world_rank(tp, cp, dp)
        if any(r.world_rank == world_rank for r in self.ranks):
            raise DumpError(f"rank {world_rank} (tp={tp} cp={cp} dp={dp}) added twice")
        rank_dump = RankDump(self, layout.coordinates(world_rank), world_rank, (int(vocab[0]), int(vocab[1])))
        self.ranks.append(rank_dump)
        return rank_dump

    def _report_modified(self, message):
        self.modified_inputs.append(message)
        if self.warn:
            warnings.warn(message, ModifiedInputWarning, stacklevel=4)

    def manifest(self, entries):
        """The manifest document for the given rank entries (validated: every rank exactly once)."""
        by_rank = {}
        for entry in entries:
            if entry["rank"] in by_rank:
                raise DumpError(f"{self.manifest_path}: rank {entry['rank']} was written twice")
            by_rank[entry["rank"]] = entry
        missing = [r for r in range(self.layout.world_size) if r not in by_rank]
        if missing:
            raise DumpError(f"{self.manifest_path}: no dump from rank(s) {missing} of the layout {self.layout.label} "
                            f"({self.layout.world_size} ranks); every rank must call rank(...) and close()")
        document = {"format": MANIFEST_FORMAT}
        for key, value in (("name", self.name), ("description", self.description),
                           ("implementation", self.implementation)):
            if value:
                document[key] = value
        document.update({"shape": self.shape, "dtype": self.dtype,
                         "loss": self.loss, "layout": self.layout.as_dict()})
        if self.stage is not None:
            document["stage"] = self.stage
        if self.framework:
            document["framework"] = self.framework
        if self.tolerances:
            document["tolerances"] = self.tolerances
        if self.timeout_seconds:
            document["timeout_seconds"] = self.timeout_seconds
        if self.cu_seqlens is not None:
            document["cu_seqlens"] = self.cu_seqlens
        if self.logged_loss_precision:
            document["logged_loss_precision"] = self.logged_loss_precision
        document["ranks"] = [by_rank[r] for r in sorted(by_rank)]
        return document

    def _write_manifest(self, entries):
        document = self.manifest(entries)
        try:
            text = json.dumps(document, indent=1, allow_nan=False)
        except ValueError as e:  # a bare NaN somewhere in the loss section or tolerances
            raise DumpError(f"{self.manifest_path}: {e}: logged values go in as tensors or the strings "
                            "\"NaN\", \"Infinity\", \"-Infinity\"") from None
        temporary = f"{self.manifest_path}.tmp.{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(temporary, self.manifest_path)
        return self.manifest_path

    def close(self, group=None, distributed=None):
        """Write this process's rank files, then the manifest once every rank's file is on disk.

        With torch.distributed initialized (and `distributed` not False) every process of `group` (default:
        the world) must call close(): the entries are gathered, the group's first rank writes the manifest,
        and no process returns before it exists. Without it, this process must have written every rank.
        Returns the manifest's path.
        """
        entries = [r.write() for r in self.ranks if not r.written]
        use_dist = distributed
        if use_dist is None:
            use_dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not use_dist:
            return self._write_manifest(entries)
        dist = torch.distributed
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, entries, group=group)
        all_entries = [e for part in gathered for e in part]
        self.manifest(all_entries)  # every process validates the same list: all raise alike, none hangs
        status = [None]
        if dist.get_rank(group) == 0:
            try:
                self._write_manifest(all_entries)
            except Exception as e:  # tell the others before raising, so none waits for a manifest
                status = [f"{type(e).__name__}: {e}"]
                dist.broadcast_object_list(status, src=_global_rank(group, 0), group=group)
                raise
        dist.broadcast_object_list(status, src=_global_rank(group, 0), group=group)
        if status[0] is not None:
            raise DumpError(f"{self.manifest_path}: the writing rank failed: {status[0]}")
        return self.manifest_path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        return False


def _global_rank(group, group_rank):
    """The world rank of a group's rank (torch >= 2.0 has get_global_rank; 1.13 only the private one)."""
    if group is None:
        return group_rank
    dist = torch.distributed
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, group_rank)
    return dist.distributed_c10d._get_global_rank(group, group_rank)
