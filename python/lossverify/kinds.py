"""The loss kinds the package knows: which inputs each one reads besides the logits, and its settings.

A kind is one entry of a registry, as on the C++ side: code that needs to know whether a kind has labels
or teacher logits asks `kind_inputs(kind)` instead of testing the kind's name. The built-ins are
cross_entropy (labels), kd (teacher logits) and policy (labels, and the rollout's old and reference
log-probabilities and advantages per row); `register_kind` adds another. A kind's settings are its C++ table's
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


_KINDS = {}

# Kinds the C++ tool checks whose inputs the package cannot hand a user's function yet: what it would need.
_TOOL_ONLY = {"router": "a router's logits of every MoE layer with its scopes' groups under sequence parallelism, "
                        "and take back its aux terms"}


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
        if name in _TOOL_ONLY:
            raise ValueError(f"loss kind {name!r} is checked by the lossverify tool (lossverify run), not yet by "
                             f"this package: it cannot hand a function {_TOOL_ONLY[name]}") from None
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
