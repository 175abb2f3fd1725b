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

from lossverify.kinds import kind_inputs

__all__ = ["Context", "LossConfig", "FrameworkConfig", "MicroBatch", "Reduced", "LogProbs", "POLICY_STATS"]

# The statistics a policy loss logs besides the loss and the token count: each the global token-mean over the
# step's valid tokens (clipped tokens, dual-clipped tokens, the KL penalty, the entropy).
POLICY_STATS = kind_inputs("policy").logged_statistics


@dataclass(frozen=True)
class LossConfig:
    """The case's loss section, resolved: every field present whatever the case file spelled out."""

    kind: str = "cross_entropy"  # a registered kind (lossverify.kinds): cross_entropy | kd | policy
    label_smoothing: float = 0.0
    smoothing_convention: str = "pytorch"  # pytorch: a/V on every column; megatron: a/(V-1) off the label
    z_loss_weight: float = 0.0
    ignore_index: int = -100
    softcap: float = 0.0  # c > 0: the logits become c tanh(x / c)
    reduction: str = "mean"  # mean | sum | none
    temperature: float = 1.0  # KD and policy: logits / T
    t2_scaling: bool = True  # KD: multiply the KL by T^2
    # policy (docs/spec.md §3.3): l = surrogate + kl_coef KL - entropy_coef H, or -lambda - entropy_coef H
    objective: str = "policy_loss"  # policy_loss | logprob (a trainer's log-prob pass)
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    dual_clip: float = 0.0  # c > 1: the surrogate capped at -c A where A < 0; 0: off
    # token: each token's own ratio e^(lambda - old); sequence: GSPO's rho_s = e^(mean over the valid tokens of
    # its sequence, all its CP chunks, of lambda - old) for every token of s, differentiated through every lambda
    ratio: str = "token"
    kl: str = "none"  # none | k1 | k2 | k3 (the case file's kl_penalty)
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    # token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    aggregation: str = "token-mean"
    norm_constant: float = 0.0  # H_max of seq-mean-token-sum-norm
    whiten_advantages: bool = False  # A' = (A - mu) / (sigma + whiten_epsilon) over the step's valid tokens
    whiten_epsilon: float = 1e-6

    @classmethod
    def from_case(cls, loss):
        known = {k: loss[k] for k in cls.__dataclass_fields__ if k in loss}
        if "kl" not in known and "kl_penalty" in loss:  # the case file's spelling
            known["kl"] = loss["kl_penalty"]
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
    # policy (objective policy_loss), float32 [rows], 0 on masked and padding rows:
    old_logprob: Optional[torch.Tensor] = None  # the rollout policy's log-probability of the label
    ref_logprob: Optional[torch.Tensor] = None  # the reference policy's
    advantages: Optional[torch.Tensor] = None  # the token's advantage before whitening (its sequence's)

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
    # policy: the step's counts, all-reduced over DP x CP before micro-batch 0
    num_sequences: int = 0  # B: sequences of the step with at least one valid token
    sequence_valid_tokens: Optional[torch.Tensor] = None  # int64 [sequences]: n_s, by the rows' `sequences`
    advantage_mean: Optional[float] = None  # mean and unbiased deviation of the advantages over the step's
    advantage_std: Optional[float] = None  # valid tokens (every DP x CP rank and micro-batch); None: no advantages

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
    def old_logprob(self):
        return self.current.old_logprob

    @property
    def ref_logprob(self):
        return self.current.ref_logprob

    @property
    def advantages(self):
        return self.current.advantages

    def aggregation_weights(self):
        """Each row's weight w_t in the step's loss L = sum_t w_t l_t (float64 [rows], 0 on masked rows), as
        lossverify's reference weighs it. Policy: token-mean 1/N, token-sum 1, seq-mean-token-sum 1/B,
        seq-mean-token-mean 1/(B n_s), seq-mean-token-sum-norm 1/(B norm_constant); cross-entropy and KD: the
        reduction's (mean 1/N_v, sum 1, none the upstream weight g_t). A framework's own normalisation is what
        a check judges: this is the answer to compare with, not a part of the objective to hand back."""
        mask = self.loss_mask.double()
        loss = self.loss
        if loss.kind == "policy":
            aggregation = loss.aggregation
            if aggregation == "token-sum":
                return mask
            if aggregation == "token-mean":
                return mask / self.num_valid_tokens if self.num_valid_tokens else mask * 0.0
            sequences = max(self.num_sequences, 1)
            if aggregation == "seq-mean-token-sum":
                return mask / sequences
            if aggregation == "seq-mean-token-sum-norm":
                return mask / (sequences * loss.norm_constant)
            if aggregation == "seq-mean-token-mean":
                n_s = self.sequence_valid_tokens[self.sequences.clamp(min=0)].double().clamp(min=1.0)
                return mask / (sequences * n_s)
            raise ValueError(f"unknown policy aggregation {aggregation!r}")
        if loss.reduction == "none":
            return self.upstream_weights.double() * mask
        if loss.reduction == "sum":
            return mask
        return mask / self.num_valid_tokens if self.num_valid_tokens else mask * 0.0

    def whitened_advantages(self):
        """The current micro-batch's advantages as the policy objective uses them (float32 [rows]): whitened
        with the step's mean and deviation, (A - mu) / (sigma + whiten_epsilon), when the case whitens them
        (0 on masked rows), as given otherwise; None where the case has none (objective logprob)."""
        advantages = self.advantages
        if advantages is None or not self.loss.whiten_advantages:
            return advantages
        mean = torch.tensor(self.advantage_mean, dtype=torch.float32)
        scale = 1.0 / (torch.tensor(self.advantage_std, dtype=torch.float32) +
                       torch.tensor(self.loss.whiten_epsilon, dtype=torch.float32))
        whitened = (advantages.float() - mean.to(advantages.device)) * scale.to(advantages.device)
        return torch.where(self.loss_mask, whitened, torch.zeros_like(whitened))

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
    Policy cases only: logprob, entropy: the per-token log-probabilities and entropies [rows] (judged token
    by token by the `logprob` and `entropy` checks; masked rows are dumped as 0); stats: this rank's and
    micro-batch's part of each logged statistic, {"clip_fraction", "dual_clip_fraction", "kl", "entropy"}
    (any subset), summed like `logged` over the micro-batches and DP x CP: a correct part is the sum over
    the micro-batch's valid tokens / N (ctx.num_valid_tokens).
    """

    def __init__(self, loss, token_loss=None, num_tokens=None, logged=None, logged_precision=None, logprob=None,
                 entropy=None, stats=None):
        self.loss = loss
        self.token_loss = token_loss
        self.num_tokens = num_tokens
        self.logged = logged
        self.logged_precision = logged_precision
        self.logprob = logprob
        self.entropy = entropy
        self.stats = stats

    def __repr__(self):
        return f"Reduced(loss={self.loss!r}, num_tokens={self.num_tokens!r})"


class LogProbs:
    """What a trainer's log-prob pass returns for a policy case: the per-token log-probabilities of the labels
    at the case's temperature, logprob [rows], and the entropies of the tempered softmax, entropy [rows]
    (None: not computed; then the case's entropy_coef must be 0). Both must depend on the logits (they carry
    the gradient) and be finite on valid rows; masked rows are ignored (dumped as 0).

    The harness judges both token by token (the `logprob` and `entropy` checks), builds the case's objective
    on them (ratio to ctx.old_logprob, each token's or, under loss.ratio "sequence", its sequence's over every
    CP rank; clip, dual clip, KL to ctx.ref_logprob, entropy bonus, the whitened advantages; or -logprob -
    entropy_coef H), weighs each token by the case's aggregation, back-propagates through the returned values
    and logs L, N and the statistics computed from them.
    """

    def __init__(self, logprob, entropy=None):
        self.logprob = logprob
        self.entropy = entropy

    def __repr__(self):
        return f"LogProbs(logprob={self.logprob!r}, entropy={self.entropy!r})"
