"""Reading what `lossverify export-inputs` writes: every rank's exact inputs of a case at one layout.

A folder holds `inputs.json` (format `lossverify.inputs/1`: the resolved case, the layout, the global
valid-token count, cu_seqlens and per rank its coordinates, vocabulary columns, row count and micro-batch
ranges) and one `rank<R>.safetensors` per world rank with the rank's rows, micro-batch after micro-batch
(CP padding rows included): logits [rows, columns] in the case dtype (an LM head case: the head's inputs h
[rows, H], and W [columns, H] and b [columns] of the rank's shard, instead), teacher_logits (KD), labels,
loss_mask, tokens (-1 on padding), token_ids, sequences, positions and upstream_weights, and the kind's
per-row inputs where the index's per-rank "tensors" list names them (policy: old_logprob, ref_logprob and
advantages, float32 [rows]).

The logits are bit-identical to what `lossverify run` feeds its own kernels, so a PyTorch loss run on
them can be checked by `check-dump` against the same float64 reference. `load` validates the index and
each rank file against it; errors (InputsError) name the file and the field.
"""

import contextlib
import json
import os
import tempfile

from lossverify import tool
from lossverify.errors import InputsError
from lossverify.kinds import kind_inputs
from lossverify.layout import Layout, vocab_shard

__all__ = ["Inputs", "RankInputs", "load", "export", "exported", "TORCH_DTYPES"]

INPUTS_FORMAT = "lossverify.inputs/1"
DTYPE_NAMES = ("fp32", "bf16", "fp16")


# torch is imported when a rank's tensors are first read, not with this module: the harness's parent reads
# the index only, and a torch import costs seconds.
def _torch_dtypes():
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _row_tensors():
    """name -> dtype (None: the case dtype); all [rows] except the logits."""
    import torch

    return {"logits": None, "labels": torch.int64, "loss_mask": torch.bool, "tokens": torch.int64,
            "token_ids": torch.int64, "sequences": torch.int64, "positions": torch.int64,
            "upstream_weights": torch.float64}


def _row_input_dtype():
    """A kind's per-row float inputs (policy: old_logprob, ref_logprob, advantages) are float32."""
    import torch

    return torch.float32


def __getattr__(name):
    if name == "TORCH_DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The kinds the package's LM head runs in front of (lossverify.torch.implementations.head): every kind lossverify's own
# head runs in front of.
HEAD_KINDS = ("cross_entropy", "kd", "policy")


def head_not_run_because(case):
    """Why the package does not run a case's LM head (a case dict, its stage section present), or "" where it does:
    its head takes cross-entropy, KD and the policy kind, with or without sequence parallelism."""
    if "stage" not in case:
        return ""
    kind = case.get("loss", {}).get("kind", "cross_entropy")
    if kind in HEAD_KINDS:
        return ""
    return (f"an LM head in front of loss kind {kind!r}: lossverify's head runs in front of "
            f"{', '.join(HEAD_KINDS)} only")


class RankInputs:
    """One rank's inputs: coordinates, vocabulary columns [begin, end), rows, micro-batch row ranges, and
    its tensors (read from its safetensors file on first use)."""

    def __init__(self, entry, inputs, where):
        self._inputs = inputs
        self.where = where
        self.rank = _int(entry, "rank", where)
        self.tp = _int(entry, "tp", where)
        self.cp = _int(entry, "cp", where)
        self.dp = _int(entry, "dp", where)
        vocab = entry.get("vocab")
        if not (isinstance(vocab, list) and len(vocab) == 2 and all(type(v) is int for v in vocab)):
            raise InputsError(f"{where}.vocab: expected [begin, end), got {vocab!r}")
        self.vocab = (vocab[0], vocab[1])
        self.rows = _int(entry, "rows", where)
        self.file = os.path.join(inputs.directory, _str(entry, "file", where))
        ranges = entry.get("micro_batches")
        if not isinstance(ranges, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in ranges):
            raise InputsError(f"{where}.micro_batches: expected a list of [begin, end) row ranges")
        self.micro_batches = [tuple(r) for r in ranges]
        names = entry.get("tensors", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise InputsError(f"{where}.tensors: expected a list of tensor names, got {names!r}")
        self.tensor_names = list(names)
        self._tensors = None

    @property
    def coordinates(self):
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp}

    @property
    def tensors(self):
        """{name: tensor} of the whole rank (all micro-batches), validated against the index."""
        if self._tensors is None:
            self._tensors = self._load()
        return self._tensors

    def micro_batch(self, k):
        """{name: tensor} of micro-batch k: rows micro_batches[k][0] to [1] of every per-row tensor (a head's shard
        tensors W and b are the rank's, see shard())."""
        begin, end = self.micro_batches[k]
        shard = self._inputs.head_shard_tensors
        return {name: t[begin:end] for name, t in self.tensors.items() if name not in shard}

    def shard(self):
        """An LM head case's tensors of the rank's vocabulary shard: {"W": [columns, H], "b": [columns] (with a
        bias)}, in the case dtype; {} without a head."""
        return {name: self.tensors[name] for name in self._inputs.head_shard_tensors}

    def _load(self):
        if not os.path.isfile(self.file):
            raise InputsError(f"{self.file}: missing (named by {self.where}.file)")
        from lossverify import safetensors

        try:
            tensors = safetensors.load_file(self.file)
        except safetensors.SafetensorsError as e:
            raise InputsError(str(e)) from None
        inputs = self._inputs
        expected = _row_tensors()
        if inputs.head is not None:  # the head makes the logits: its inputs are h (per row), W and b (the shard)
            del expected["logits"]
        if inputs.kind_inputs.teacher_logits:
            expected["teacher_logits"] = None
        for name in inputs.kind_inputs.row_inputs:  # the kind's optional per-row inputs, where the index names them
            if name in self.tensor_names:
                expected[name] = _row_input_dtype()
        width = self.vocab[1] - self.vocab[0]
        for name, dtype in expected.items():
            if name not in tensors:
                raise InputsError(f"{self.file}: tensor {name!r} missing (the rank of {self.where})")
            tensor = tensors[name]
            want_dtype = dtype or inputs.torch_dtype
            want_shape = (self.rows, width) if dtype is None else (self.rows,)
            if tensor.dtype != want_dtype or tuple(tensor.shape) != want_shape:
                raise InputsError(f"{self.file}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, expected "
                                  f"{want_dtype} {list(want_shape)} ({self.rows} rows x {width} columns of "
                                  f"{self.where})")
        if inputs.head is not None:
            hidden = inputs.head["hidden"]
            shapes = {"h": (self.rows, hidden), "W": (width, hidden), "b": (width,)}
            for name in ("h", *inputs.head_shard_tensors):
                tensor = tensors.get(name)
                if tensor is None:
                    raise InputsError(f"{self.file}: tensor {name!r} missing (the LM head's input, {self.where})")
                if tensor.dtype != inputs.torch_dtype or tuple(tensor.shape) != shapes[name]:
                    raise InputsError(f"{self.file}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, "
                                      f"expected {inputs.torch_dtype} {list(shapes[name])} (the LM head's input, "
                                      f"hidden size {hidden}, {self.where})")
        return tensors


class Inputs:
    """An export-inputs folder: the resolved case and every rank's inputs (see the module's docstring)."""

    def __init__(self, directory, data):
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, "inputs.json")
        self.data = data
        where = self.path
        if data.get("format") != INPUTS_FORMAT:
            raise InputsError(f"{where}: $.format: expected {INPUTS_FORMAT!r}, got {data.get('format')!r}")
        self.case = data.get("case")
        if not isinstance(self.case, dict) or not isinstance(self.case.get("loss"), dict):
            raise InputsError(f"{where}: $.case: expected the resolved case with its loss section")
        self.case_file = data.get("case_file")
        self.overrides = list(data.get("overrides", []))
        self.tool = data.get("tool", {})
        shape = data.get("shape", {})
        self.tokens = _int(shape, "tokens", f"{where}: $.shape")
        self.vocab = _int(shape, "vocab", f"{where}: $.shape")
        self.dtype = data.get("dtype")
        if self.dtype not in DTYPE_NAMES:
            raise InputsError(f"{where}: $.dtype: expected one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        layout = data.get("layout", {})
        sp = layout.get("sp", False) if isinstance(layout, dict) else False
        if not isinstance(sp, bool):
            raise InputsError(f"{where}: $.layout.sp: expected true or false, got {sp!r}")
        self.layout = Layout(*[_int(layout, k, f"{where}: $.layout") for k in ("tp", "cp", "dp", "ga")], sp=sp)
        if min(self.layout.counts) < 1:
            raise InputsError(f"{where}: $.layout: counts must be >= 1, got {layout}")
        self.valid_tokens = _int(data, "valid_tokens", f"{where}: $")
        self.cu_seqlens = data.get("cu_seqlens")
        entries = data.get("ranks")
        if not isinstance(entries, list) or len(entries) != self.layout.world_size:
            raise InputsError(f"{where}: $.ranks: expected {self.layout.world_size} ranks (tp*cp*dp of "
                              f"{self.layout.label}), got {len(entries) if isinstance(entries, list) else entries!r}")
        self.ranks = [RankInputs(e, self, f"{where}: $.ranks[{i}]") for i, e in enumerate(entries)]
        self._validate_ranks()

    @property
    def torch_dtype(self):
        return _torch_dtypes()[self.dtype]

    @property
    def head(self):
        """The case's LM head (its resolved stage section: hidden, bias, dh_reduce, ...), or None."""
        stage = self.case.get("stage")
        if stage is None:
            return None
        if not isinstance(stage, dict) or stage.get("kind") != "lm_head" or type(stage.get("hidden")) is not int:
            raise InputsError(f"{self.path}: $.case.stage: the package runs the lm_head stage only, got {stage!r}")
        why = head_not_run_because(self.case)
        if why:
            raise InputsError(f"{self.path}: $.case: {why}")
        return stage

    @property
    def head_shard_tensors(self):
        """The names of the head's tensors of a rank's vocabulary shard: ("W",), ("W", "b") with a bias, () without
        a head."""
        head = self.head
        if head is None:
            return ()
        return ("W", "b") if head.get("bias") else ("W",)

    @property
    def loss(self):
        """The resolved loss section (kind, label_smoothing, smoothing_convention, ...)."""
        return self.case["loss"]

    @property
    def kind(self):
        return self.loss.get("kind", "cross_entropy")

    @property
    def kind_inputs(self):
        """The KindInputs of the case's loss kind (lossverify.kinds): which inputs it reads besides logits."""
        try:
            return kind_inputs(self.kind)
        except ValueError as e:
            raise InputsError(f"{self.path}: $.case.loss.kind: {e}") from None

    @property
    def framework(self):
        return self.case.get("framework", {"grad_reduce": "avg", "ga_reduce": "sum"})

    def rank(self, world_rank):
        return self.ranks[world_rank]

    def _validate_ranks(self):
        layout = self.layout
        for i, r in enumerate(self.ranks):
            if r.rank != i or layout.world_rank(r.tp, r.cp, r.dp) != i:
                raise InputsError(f"{r.where}: rank {r.rank} at tp={r.tp} cp={r.cp} dp={r.dp}, expected world rank "
                                  f"{i} = (dp*CP + cp)*TP + tp in position {i}")
            if self.kind_inputs.whole_rows:
                if r.vocab != (0, self.vocab):
                    raise InputsError(f"{r.where}.vocab: {list(r.vocab)}, expected the whole row [0, {self.vocab}] "
                                      f"(a {self.kind} row is whole on every rank)")
            elif r.vocab != vocab_shard(self.vocab, layout.tp, r.tp):
                raise InputsError(f"{r.where}.vocab: {list(r.vocab)}, expected TP rank {r.tp}'s shard "
                                  f"{list(vocab_shard(self.vocab, layout.tp, r.tp))} of {self.vocab} columns")
            if len(r.micro_batches) != layout.ga:
                raise InputsError(f"{r.where}.micro_batches: {len(r.micro_batches)} ranges, expected ga = {layout.ga}")
            position = 0
            for k, (begin, end) in enumerate(r.micro_batches):
                if begin != position or end < begin:
                    raise InputsError(f"{r.where}.micro_batches[{k}]: [{begin}, {end}) does not follow row {position}")
                position = end
            if position != r.rows:
                raise InputsError(f"{r.where}.micro_batches: cover {position} rows, but the rank has {r.rows}")


def load(directory):
    """Read and validate an export-inputs folder (rank files are read when first used)."""
    path = os.path.join(directory, "inputs.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise InputsError(f"{path}: missing (is {directory} a lossverify export-inputs folder?)") from None
    except json.JSONDecodeError as e:
        raise InputsError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InputsError(f"{path}: expected a JSON object")
    return Inputs(directory, data)


def export(case, out_dir, tp=None, cp=None, dp=None, ga=None, overrides=None, binary=None, rank=None):
    """Run `lossverify export-inputs` into `out_dir` (new or empty) and load the result.

    `overrides` are --set items: {"loss.label_smoothing": 0.1} or ["loss.label_smoothing=0.1"]; `rank`: only
    that world rank's tensors are written (a process of a distributed launch regenerates its own).
    """
    tool.export_inputs(case, out_dir, tp=tp, cp=cp, dp=dp, ga=ga, overrides=overrides, binary=binary, rank=rank)
    return load(out_dir)


@contextlib.contextmanager
def exported(case, tp=None, cp=None, dp=None, ga=None, overrides=None, binary=None):
    """`with exported("cases/x.json", tp=2) as inputs:` exports into a temporary folder, removed after."""
    with tempfile.TemporaryDirectory(prefix="lossverify-inputs-") as directory:
        yield export(case, os.path.join(directory, "inputs"), tp=tp, cp=cp, dp=dp, ga=ga, overrides=overrides,
                     binary=binary)


def _int(obj, key, where):
    value = obj.get(key) if isinstance(obj, dict) else None
    if type(value) is not int:
        raise InputsError(f"{where}.{key}: expected an integer, got {value!r}")
    return value


def _str(obj, key, where):
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise InputsError(f"{where}.{key}: expected a file name, got {value!r}")
    return value
