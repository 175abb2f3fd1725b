"""What the harness hands the checked loss function: `fn(logits, labels, ctx)`.

`logits` is this rank's shard of one micro-batch, a leaf tensor of the case's dtype on the rank's device
that requires grad; `labels` are the data loader's labels of its rows (next-token labels were formed on
the whole sequence before the CP split; ignore_index on ignored tokens and CP padding rows). `ctx`, a
`Context`, carries everything else a framework's loss would see: process groups, ranks and sizes, the
rank's vocabulary columns, the loss configuration, the framework model, the global valid-token count,
and the rows' masks, token ids and positions.

fn returns either the per-token losses [rows] (the harness masks them, applies the case's reduction and
framework model, back-propagates and logs), or `Reduced(loss, ...)`, an already reduced loss whose own
normalisation is what gets back-propagated and logged.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

__all__ = ["Context", "LossConfig", "FrameworkConfig", "MicroBatch", "Reduced"]


@dataclass(frozen=True)
class LossConfig:
    """The case's loss section, resolved: every field present whatever the case file spelled out."""

    kind: str = "cross_entropy"  # a registered kind (lossverify.kinds): cross_entropy | kd
    label_smoothing: float = 0.0
    smoothing_convention: str = "pytorch"  # pytorch: a/V on every column; megatron: a/(V-1) off the label
    z_loss_weight: float = 0.0
    ignore_index: int = -100
    softcap: float = 0.0  # c > 0: the logits become c tanh(x / c)
    reduction: str = "mean"  # mean | sum | none
    temperature: float = 1.0  # KD
    t2_scaling: bool = True  # KD: multiply the KL by T^2

    @classmethod
    def from_case(cls, loss):
        known = {k: loss[k] for k in cls.__dataclass_fields__ if k in loss}
        return cls(**known)


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

    @property
    def rows(self):
        return self.labels.shape[0]


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
    """

    def __init__(self, loss, token_loss=None, num_tokens=None, logged=None, logged_precision=None):
        self.loss = loss
        self.token_loss = token_loss
        self.num_tokens = num_tokens
        self.logged = logged
        self.logged_precision = logged_precision

    def __repr__(self):
        return f"Reduced(loss={self.loss!r}, num_tokens={self.num_tokens!r})"
