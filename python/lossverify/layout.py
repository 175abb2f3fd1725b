"""Rank layouts as lossverify numbers them: world rank = (dp * CP + cp) * TP + tp, TP shards of the
vocabulary with the remainder spread over the first ranks, and the framework factor that turns a rank's
local gradient into the effective one. Shared by the inputs reader, the dump writer and the harness so
that all three agree with the C++ tool (README, "Layouts and the framework model")."""

from typing import NamedTuple

__all__ = ["Layout", "Coordinates", "vocab_shard", "sequence_parallel_slots", "framework_factor", "parse_layout"]


class Coordinates(NamedTuple):
    tp: int
    cp: int
    dp: int


class Layout(NamedTuple):
    tp: int = 1
    cp: int = 1
    dp: int = 1
    ga: int = 1
    # Sequence parallelism, for a kind whose rows are whole on every rank (a router's): TP splits each CP rank's
    # tokens instead of replicating them.
    sp: bool = False

    @property
    def counts(self):
        """(tp, cp, dp, ga)."""
        return (self.tp, self.cp, self.dp, self.ga)

    @property
    def world_size(self):
        return self.tp * self.cp * self.dp

    @property
    def label(self):
        """tp2-cp1-dp1-ga1 (tp2-sp-cp1-dp1-ga1 under sequence parallelism), as lossverify names layouts."""
        return f"tp{self.tp}" + ("-sp" if self.sp else "") + f"-cp{self.cp}-dp{self.dp}-ga{self.ga}"

    def world_rank(self, tp, cp, dp):
        return (dp * self.cp + cp) * self.tp + tp

    def coordinates(self, rank):
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = rank // (self.tp * self.cp)
        return Coordinates(tp, cp, dp)

    def as_dict(self):
        counts = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "ga": self.ga}
        return {**counts, "sp": True} if self.sp else counts


def vocab_shard(vocab, tp, tp_rank):
    """Columns [begin, end) of TP rank `tp_rank`: begin = r floor(V/TP) + min(r, V mod TP)."""
    base, extra = divmod(vocab, tp)
    begin = tp_rank * base + min(tp_rank, extra)
    return begin, begin + base + (1 if tp_rank < extra else 0)


def sequence_parallel_slots(rows, tp, tp_rank):
    """TP rank `tp_rank`'s token shard of a micro-batch of `rows` rows under sequence parallelism, as lossverify's
    layout cuts it: [0, rows) padded to a multiple of `tp`, the rank's contiguous ceil(rows / tp) slots, a slot past
    the last row -1 (padding)."""
    part = -(-rows // tp)
    return [slot if slot < rows else -1 for slot in range(part * tp_rank, part * (tp_rank + 1))]


def framework_factor(layout, grad_reduce="avg", ga_reduce="sum"):
    """What the framework multiplies a rank's local gradient by: 1/(DP CP) when it averages gradients over
    the DP x CP group, and 1/GA when it averages micro-batches. A correct loss divides its local objective
    by this factor so that the effective gradient is dL/dx of the global objective."""
    factor = 1.0
    if grad_reduce == "avg":
        factor /= layout.dp * layout.cp
    if ga_reduce == "mean":
        factor /= layout.ga
    return factor


def _count(value, where):
    """A whole, positive count: 2 or 2.0, never 0.5 or True."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"layout {where!r}: counts must be whole numbers, got {value!r}")
    return int(value)


def _flag(value, where):
    if not isinstance(value, bool):
        raise ValueError(f"layout {where!r}: sp must be true or false, got {value!r}")
    return value


def parse_layout(value):
    """A Layout from a dict {"tp": 2, ..., "sp": True}, a tuple (tp, cp, dp, ga), a Layout, or "tp2-cp1-dp1-ga1"
    / "tp=2,cp=2" (with "-sp" for sequence parallelism); missing counts are 1."""
    if isinstance(value, Layout):
        layout = Layout(*[_count(v, value) for v in value.counts], sp=_flag(value.sp, value))
    elif isinstance(value, dict):
        unknown = set(value) - set(Layout._fields)
        if unknown:
            raise ValueError(f"layout {value!r}: unknown keys {sorted(unknown)} (expected tp, cp, dp, ga, sp)")
        layout = Layout(**{k: _flag(v, value) if k == "sp" else _count(v, value) for k, v in value.items()})
    elif isinstance(value, (tuple, list)):
        if len(value) > 4:
            raise ValueError(f"layout {value!r}: at most 4 counts (tp, cp, dp, ga)")
        layout = Layout(*[_count(v, value) for v in value])
    elif isinstance(value, str):
        counts = {}
        for part in value.replace("-", ",").split(","):
            part = part.strip()
            if not part:
                continue
            if part == "sp":
                counts["sp"] = True
                continue
            name = part.rstrip("0123456789=").rstrip("=")
            digits = part[len(name):].lstrip("=")
            if name not in Layout._fields or not digits.isdigit():
                raise ValueError(f"layout {value!r}: cannot read {part!r} (expected e.g. tp2-cp1 or tp=2,cp=1)")
            counts[name] = int(digits)
        layout = Layout(**counts)
    else:
        raise ValueError(f"cannot read a layout from {value!r}")
    if min(layout.counts) < 1:
        raise ValueError(f"layout {value!r}: counts must be >= 1")
    if layout.sp and layout.tp == 1:
        raise ValueError(f"layout {value!r}: sp splits the tokens over TP ranks and needs tp > 1")
    return layout
