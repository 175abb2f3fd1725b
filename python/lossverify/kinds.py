"""The loss kinds the package knows: which inputs each one reads besides the logits, and its settings.

A kind is one entry of a registry, as on the C++ side: code that needs to know whether a kind has labels
or teacher logits asks `kind_inputs(kind)` instead of testing the kind's name. The built-ins are
cross_entropy (labels), kd (teacher logits), policy (labels, and the rollout's old and reference
log-probabilities and advantages per row) and router (a token's router logits of every MoE layer, whole on every
rank); `register_kind` adds another. A kind's settings are its C++ table's
(`lossverify list --json`), kept in kind_settings.json beside this file (scripts/kind_settings.py writes it, and a
test holds it to the binary): `kind_settings(kind)`. No torch here: the package imports torch only when a rank's
tensors are read.
"""

import json
import os
from dataclasses import dataclass

__all__ = ["KindInputs", "register_kind", "kind_inputs", "known_kinds", "kind_settings"]


@dataclass(frozen=True)
class KindInputs:
    """The per-row inputs a loss kind reads besides the logits: labels, the teacher's logits, and `row_inputs`,
    per-row float tensors [rows] that a case of the kind may carry (read when export-inputs' index names them
    in the rank's "tensors" list; the policy kind's objective "logprob" has none)."""

    labels: bool
    teacher_logits: bool
    row_inputs: tuple = ()
    # The statistics a framework logs beside the loss and the valid-token count, each a token mean over the step
    # (a dump's stats, a Reduced's stats), in the order the tool reports them.
    logged_statistics: tuple = ()
    # The per-token quantities a rank reports beside its loss (a dump's token_<name>, a Reduced's <name>=...).
    token_quantities: tuple = ()
    # Whether a row is whole on every rank (a router's experts): TP replicates the tokens, or splits them under
    # layout sp, and never splits the columns.
    whole_rows: bool = False
    # The name of a row's columns in a case's shape ("vocab"; a router's "experts"), and the loss setting that says
    # how many blocks of that width a row holds side by side (a router's "layers"; None: one).
    column_axis: str = "vocab"
    row_blocks: str = None
    # Statistics logged per block when a row holds several (a router's aux_loss.layer0, z_loss.layer0, ...), after
    # logged_statistics.
    block_statistics: tuple = ()
    # The name of the values a rank reports per micro-batch scope, one per column of a row (a router's "counts" per
    # expert of each layer, as the rank holds them after their all-reduce); None: none.
    scope_values: str = None

    def blocks(self, loss):
        """How many blocks a row of the loss section `loss` (a dict or a LossConfig) holds."""
        if self.row_blocks is None:
            return 1
        value = loss.get(self.row_blocks, 1) if isinstance(loss, dict) else getattr(loss, self.row_blocks)
        return int(value)

    def statistics(self, loss):
        """The statistics a rank logs for the loss section `loss`, in the tool's order."""
        blocks = self.blocks(loss)
        per_block = [f"{name}.layer{b}" for b in range(blocks) for name in self.block_statistics] if blocks > 1 else []
        return (*self.logged_statistics, *per_block)


_KINDS = {}

def register_kind(name, inputs):
    """Register loss kind `name` with its KindInputs; a name already registered is a ValueError."""
    if name in _KINDS:
        raise ValueError(f"loss kind {name!r} is already registered")
    if not isinstance(inputs, KindInputs):
        raise TypeError(f"loss kind {name!r}: expected KindInputs, got {type(inputs).__name__}")
    _KINDS[name] = inputs


def kind_inputs(name):
    """The KindInputs of loss kind `name`; an unknown kind is a ValueError naming the known ones."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown loss kind {name!r} (known: {', '.join(known_kinds())})") from None


def known_kinds():
    """The registered kinds' names, in registration order."""
    return list(_KINDS)


with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kind_settings.json"), encoding="utf-8") as _f:
    _SETTINGS = json.load(_f)


def kind_settings(name):
    """The settings table of loss kind `name`: a list of {key, type, default, default_from?, allowed, choices?,
    applies_to?, meaning}, in the table's order; [] for a kind the tool's tables do not hold (one registered here
    only)."""
    return _SETTINGS.get(name, [])


register_kind("cross_entropy", KindInputs(labels=True, teacher_logits=False))
register_kind("kd", KindInputs(labels=False, teacher_logits=True))
register_kind("policy", KindInputs(labels=True, teacher_logits=False,
                                   row_inputs=("old_logprob", "ref_logprob", "advantages"),
                                   logged_statistics=("clip_fraction", "dual_clip_fraction", "kl", "entropy"),
                                   token_quantities=("logprob", "entropy")))
register_kind("router", KindInputs(labels=False, teacher_logits=False, logged_statistics=("aux_loss", "z_loss"),
                                   whole_rows=True, column_axis="experts", row_blocks="layers",
                                   block_statistics=("aux_loss", "z_loss"), scope_values="counts"))
