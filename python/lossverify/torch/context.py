"""What the harness hands the checked loss function: `fn(logits, labels, ctx)`.

`logits` is this rank's shard of one micro-batch, a leaf tensor of the case's dtype on the rank's device
that requires grad; `labels` are the data loader's labels of its rows (next-token labels were formed on
the whole sequence before the CP split; ignore_index on ignored tokens and CP padding rows). `ctx`, a
`Context`, carries everything else a framework's loss would see: process groups, ranks and sizes, the
rank's vocabulary columns, the loss configuration, the framework model, the global valid-token count,
and the rows' masks, token ids and positions.

fn returns either the per-token losses [rows] (the harness masks them, applies the case's reduction, or a
policy case's aggregation weights, and the framework model, back-propagates and logs), `LogProbs(logprob,
entropy)` (policy: a trainer's log-prob pass, judged token by token; the harness builds the case's objective
on them), or `Reduced(loss, ...)`, an already reduced loss whose own normalisation is what gets
back-propagated and logged.

A policy case (kind "policy", ../docs/pytorch.md) also carries, per row, the rollout policy's log-probability
`old_logprob`, the reference policy's `ref_logprob` and the advantage before whitening `advantages`
(objective policy_loss), and per step the counts its aggregation needs: N (num_valid_tokens), B
(num_sequences) and n_s (sequence_valid_tokens), all-reduced over DP x CP before the step as frameworks do.
Under loss.ratio "sequence" (GSPO) each row's `sequences` names the sequence whose ratio it takes.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from lossverify.kinds import kind_inputs, kind_settings

__all__ = ["Context", "LossConfig", "FrameworkConfig", "MicroBatch", "Reduced", "LogProbs", "RouterLosses"]


class LossConfig:
    """The case's loss section, resolved: `kind`, `reduction`, and every setting of the kind's table as an
    attribute by its key in the case (`lossverify list` lists them: cross-entropy's label_smoothing,
    smoothing_convention, z_loss_weight, softcap, ignore_index; KD's temperature and t2_scaling; the policy kind's
    objective, temperature, clip_low, clip_high, dual_clip, ratio, kl_penalty, kl_coef, entropy_coef, aggregation,
    norm_constant, whiten_advantages, whiten_epsilon). A setting the case does not state, or that does not apply
    to it, holds its fallback. Immutable."""

    __slots__ = ("kind", "reduction", "_settings")

    def __init__(self, kind="cross_entropy", reduction="mean", **settings):
        table = kind_settings(kind)
        known = {entry["key"] for entry in table}
        unknown = sorted(set(settings) - known) if table else []
        if unknown:
            raise TypeError(f"LossConfig: {', '.join(unknown)} is not a setting of loss kind {kind!r} "
                            f"(its settings: {', '.join(entry['key'] for entry in table)})")
        values = dict(settings)
        for entry in table:
            if entry["key"] not in values:
                source = entry.get("default_from")
                values[entry["key"]] = values[source] if source in values else entry["default"]
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "reduction", reduction)
        object.__setattr__(self, "_settings", values)

    @classmethod
    def from_case(cls, loss):
        """The resolved case's "loss" object (export-inputs' case.json)."""
        kind = loss.get("kind", "cross_entropy")
        known = {entry["key"] for entry in kind_settings(kind)}
        settings = {k: v for k, v in loss.items() if k in known or (not known and k not in _SHARED_KEYS)}
        return cls(kind=kind, reduction=loss.get("reduction", "mean"), **settings)

    def replace(self, **changes):
        """A copy with some settings (or the kind or reduction) changed."""
        settings = dict(self._settings)
        kind = changes.pop("kind", self.kind)
        reduction = changes.pop("reduction", self.reduction)
        settings.update(changes)
        return LossConfig(kind=kind, reduction=reduction, **settings)

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "_settings")[name]
        except KeyError:
            raise AttributeError(f"loss kind {object.__getattribute__(self, 'kind')!r} has no setting {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("LossConfig is immutable")

    def __eq__(self, other):
        return isinstance(other, LossConfig) and (self.kind, self.reduction, self._settings) == (
            other.kind, other.reduction, other._settings)

    def __hash__(self):
        return hash((self.kind, self.reduction, tuple(sorted(self._settings.items()))))

    def __repr__(self):
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings.items())
        return f"LossConfig(kind={self.kind!r}, reduction={self.reduction!r}, {settings})"


# Keys of a resolved "loss" object that every kind shares (not a kind's settings).
_SHARED_KEYS = ("kind", "reduction", "upstream_weights")


@dataclass(frozen=True)
class FrameworkConfig:
    """How the framework combines the ranks' gradients (README, "Layouts and the framework model")."""

    grad_reduce: str = "avg"  # avg: DDP/FSDP average over the DP x CP group | sum
    ga_reduce: str = "sum"  # sum of the micro-batch gradients | mean


@dataclass
class MicroBatch:
    """One micro-batch of this rank's rows, on the rank's device. Padding rows (CP) have tokens = -1,
    token_ids = -1, loss_mask = False, labels = ignore_index and upstream weight 0."""

    index: int
    labels: torch.Tensor  # int64 [rows]
    loss_mask: torch.Tensor  # bool [rows]: the token counts in the loss
    tokens: torch.Tensor  # int64 [rows]: global token of the row
    token_ids: torch.Tensor  # int64 [rows]: input token id at that position (next-token labels come from these)
    sequences: torch.Tensor  # int64 [rows]: packed sequence of the row
    positions: torch.Tensor  # int64 [rows]: position inside its (padded) sequence
    upstream_weights: torch.Tensor  # float64 [rows]: g_t for reduction none (1 otherwise, 0 on padding)
    teacher_logits: Optional[torch.Tensor] = None  # KD: [rows, columns] in the case dtype
    # The kind's per-row inputs by name (lossverify.kinds: KindInputs.row_inputs), float32 [rows], 0 on masked and
    # padding rows, None where the case has none; read as attributes: the policy kind's mb.old_logprob (the
    # rollout policy's log-probability of the label), mb.ref_logprob (the reference policy's) and mb.advantages
    # (the token's advantage before whitening, its sequence's).
    row_inputs: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    # The micro-batch's exported logits, for a kind whose loss reads other micro-batches' (a router's global aux
    # loss with the step's counts routes every micro-batch before micro-batch 0); None for the other kinds. Read it:
    # the dump holds the exported values whatever a function does to this copy.
    logits: Optional[torch.Tensor] = None

    @property
    def rows(self):
        return self.labels.shape[0]

    def __getattr__(self, name):
        row_inputs = self.__dict__.get("row_inputs", {})
        if name in row_inputs:
            return row_inputs[name]
        raise AttributeError(f"MicroBatch has no field or row input {name!r}")


@dataclass
class Context:
    """Everything a rank's loss sees besides its logits and labels (see the module docstring)."""

    # world and process groups (torch.distributed; a group of one rank is still a group)
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    tp_group: Any
    cp_group: Any
    dp_group: Any
    dp_cp_group: Any  # the group gradients are averaged over, and valid-token counts summed over
    device: torch.device
    dtype: torch.dtype
    # vocabulary: this rank's columns [vocab_start, vocab_end) of vocab_size
    vocab_start: int
    vocab_end: int
    vocab_size: int
    loss: LossConfig
    framework: FrameworkConfig
    # (1/(DP CP) under grad_reduce avg) x (1/GA under ga_reduce mean): what the framework multiplies this
    # rank's gradient by. A correct already-reduced loss is (this rank's share of L) / framework_factor.
    framework_factor: float
    num_valid_tokens: int  # N_v: tokens that count in the loss, over every rank and micro-batch
    micro_batch: int  # index of the current micro-batch
    ga: int  # micro-batches per step
    micro_batches: List[MicroBatch]  # this rank's whole step (normalisers computed before micro-batch 0)
    state: Dict[str, Any] = field(default_factory=dict)  # shared by this rank's calls of one step
    # The kind's values of the whole step, all-reduced over DP x CP before micro-batch 0 (lossverify.torch.kinds),
    # read as attributes: the policy kind's ctx.num_sequences (B: sequences with a valid token),
    # ctx.sequence_valid_tokens (int64 [sequences]: n_s, by the rows' `sequences`), ctx.advantage_mean and
    # ctx.advantage_std (the advantages' mean and unbiased deviation over the step's valid tokens; None: none).
    step: Dict[str, Any] = field(default_factory=dict)
    # The TP x CP group (one per DP rank), and the ranks holding other tokens: DP x CP, and TP too under sequence
    # parallelism (sp) of a kind whose rows are whole on every rank (a router's, with TP splitting each CP rank's
    # tokens; without it TP replicates them). Counts over the whole step are summed over batch_group. An LM head
    # under sp gets its token shard of h and gathers it (../docs/pytorch.md, "An LM head"): the kind's rows stay
    # whole per TP group and batch_group is DP x CP.
    tp_cp_group: Any = None
    batch_group: Any = None
    sp: bool = False
    # An LM head case (../docs/pytorch.md, "An LM head"): the case's resolved stage section ({"kind": "lm_head",
    # "hidden": H, "bias": ..., "dh_reduce": "head" | "framework", ...}); None without a head.
    head: Optional[Dict[str, Any]] = None

    def __getattr__(self, name):
        """The kind's step values, the current micro-batch's row inputs (ctx.old_logprob), and the kind's context
        methods (ctx.whitened_advantages())."""
        step = self.__dict__.get("step", {})
        if name in step:
            return step[name]
        micro_batches = self.__dict__.get("micro_batches")
        if micro_batches:
            row_inputs = micro_batches[self.__dict__["micro_batch"]].__dict__.get("row_inputs", {})
            if name in row_inputs:
                return row_inputs[name]
        loss = self.__dict__.get("loss")
        if loss is not None:
            from lossverify.torch.kinds import harness_kind

            method = harness_kind(loss.kind).context_methods.get(name)
            if method is not None:
                return lambda *args, **kwargs: method(self, *args, **kwargs)
        raise AttributeError(f"Context has no field {name!r} (nor a step value, row input or method of its kind)")

    # the current micro-batch's rows
    @property
    def current(self):
        return self.micro_batches[self.micro_batch]

    @property
    def labels(self):
        return self.current.labels

    @property
    def loss_mask(self):
        return self.current.loss_mask

    @property
    def tokens(self):
        return self.current.tokens

    @property
    def token_ids(self):
        return self.current.token_ids

    @property
    def sequences(self):
        return self.current.sequences

    @property
    def positions(self):
        return self.current.positions

    @property
    def upstream_weights(self):
        return self.current.upstream_weights

    @property
    def teacher_logits(self):
        return self.current.teacher_logits

    def aggregation_weights(self):
        """Each row's weight w_t in the step's loss L = sum_t w_t l_t (float64 [rows], 0 on masked rows), as
        lossverify's reference weighs it: the case's reduction's (mean 1/N_v, sum 1, none the upstream weight g_t),
        or the kind's own aggregation (policy: token-mean 1/N, token-sum 1, seq-mean-token-sum 1/B,
        seq-mean-token-mean 1/(B n_s), seq-mean-token-sum-norm 1/(B norm_constant)). A framework's own normalisation
        is what a check judges: this is the answer to compare with, not a part of the objective to hand back."""
        from lossverify.torch.kinds import harness_kind

        return harness_kind(self.loss.kind).aggregation_weights(self)

    @property
    def rank_valid_tokens(self):
        """This rank's own valid-token count over its micro-batches (no communication)."""
        return int(sum(int(mb.loss_mask.sum()) for mb in self.micro_batches))


class Reduced:
    """An already reduced loss returned by fn: `loss` (a scalar tensor) is back-propagated as it is.

    token_loss: the per-token losses [rows] as they enter the reduction (checked token by token when given);
    num_tokens: the valid-token count this rank logs (the `stats` check; not checked when None);
    logged: this rank's and micro-batch's part of the logged loss; the harness sums the parts over the
    micro-batches and the DP x CP group. Default: loss x ctx.framework_factor, so that a correct
    normalisation logs L; logged_precision: the precision the logged value carries when it was computed in
    16 bits and logged wider ("bf16", "fp16"): it is then judged by that dtype's rule.
    A kind's own quantities (lossverify.kinds: KindInputs), where its case has them: per-token ones by name
    (the policy kind's logprob=, entropy=: the per-token log-probabilities and entropies [rows], judged token
    by token by the `logprob` and `entropy` checks; masked rows are dumped as 0), and stats: this rank's and
    micro-batch's part of each logged statistic (the policy kind's {"clip_fraction", "dual_clip_fraction", "kl",
    "entropy"}, any subset), summed like `logged` over the micro-batches and DP x CP: a correct part is the sum
    over the micro-batch's valid tokens / N (ctx.num_valid_tokens).
    """

    def __init__(self, loss, token_loss=None, num_tokens=None, logged=None, logged_precision=None, stats=None,
                 **token_values):
        self.loss = loss
        self.token_loss = token_loss
        self.num_tokens = num_tokens
        self.logged = logged
        self.logged_precision = logged_precision
        self.stats = stats
        self.token_values = token_values

    def __getattr__(self, name):
        token_values = self.__dict__.get("token_values", {})
        if name in token_values:
            return token_values[name]
        raise AttributeError(f"Reduced has no field {name!r}")

    def __repr__(self):
        return f"Reduced(loss={self.loss!r}, num_tokens={self.num_tokens!r})"


# A policy case's and a router case's result types live with their kinds (lossverify.torch.kinds); named here for
# users.
from lossverify.torch.kinds.policy import LogProbs  # noqa: E402 - the kinds' modules import this one's records
from lossverify.torch.kinds.router import RouterLosses  # noqa: E402
