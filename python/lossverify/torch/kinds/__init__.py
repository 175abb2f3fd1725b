"""What the harness does for each loss kind beyond what every kind shares: one module per kind that needs more.

A kind's module holds its per-step values (computed before micro-batch 0, as a framework does), the weights it
gives each token in L, the results its functions may return besides per-token losses and `Reduced`, and the
methods its `Context` offers (`ctx.NAME(...)`); its inputs and statistics are declared in `lossverify.kinds`. The
harness asks `harness_kind(loss.kind)` and names no kind. A kind without a module of its own (cross-entropy, KD,
a kind registered at run time) weighs its tokens by the case's reduction.
"""

__all__ = ["HarnessKind", "register_harness_kind", "harness_kind", "kind_of_result"]


class HarnessKind:
    """A kind whose tokens are weighed by the case's reduction: mean 1/N_v, sum 1, none the upstream weight."""

    # Classes a loss function of this kind may return besides per-token losses and Reduced (add_result takes them).
    result_types = ()
    # Methods its Context offers, name -> function(ctx, *args): ctx.NAME(*args).
    context_methods = {}

    def step_values(self, inputs, micro_batches, groups, device):
        """Values of the whole step, all-reduced before micro-batch 0 over the rank's `groups` (tp, cp, dp, dp_cp,
        tp_cp, batch), that its Context carries as attributes."""
        return {}

    def aggregation_weights(self, ctx):
        """Each row's weight w_t in L = sum_t w_t l_t (float64 [rows], 0 on masked rows)."""
        mask = ctx.loss_mask.double()
        if ctx.loss.reduction == "none":
            return ctx.upstream_weights.double() * mask
        if ctx.loss.reduction == "sum":
            return mask
        return mask / ctx.num_valid_tokens if ctx.num_valid_tokens else mask * 0.0

    # Whether the case's reduction weighs the tokens (False: the kind's aggregation does).
    weighs_by_reduction = True
    # Whether its loss reads other micro-batches' logits (ctx.micro_batches[k].logits: a router's step counts).
    reads_step_logits = False

    def token_mean(self, loss):
        """Whether L is the mean over the step's valid tokens (1/N_v each)."""
        return loss.reduction == "mean"

    def logs_loss(self, loss):
        """Whether ranks log L (reduction none logs none)."""
        return loss.reduction != "none"

    def dumps_grad_output(self, loss):
        """Whether the dump carries the upstream weights as grad_output (reduction none)."""
        return loss.reduction == "none"

    def add_result(self, step, result, rows, ctx, fail):
        """(objective, token losses, per-token values) for one of result_types (see _worker._StepLog.add)."""
        raise NotImplementedError


_DEFAULT = HarnessKind()
_HARNESS = {}


def register_harness_kind(name, kind):
    """Give loss kind `name` a HarnessKind of its own; a name already given one is a ValueError."""
    if name in _HARNESS:
        raise ValueError(f"loss kind {name!r} already has a harness kind")
    _HARNESS[name] = kind


def harness_kind(name):
    """The HarnessKind of loss kind `name` (the reduction's weights when it has none of its own)."""
    return _HARNESS.get(name, _DEFAULT)


def kind_of_result(result):
    """The kind whose result types hold `result` (a policy case's LogProbs), or None."""
    for name, kind in _HARNESS.items():
        if kind.result_types and isinstance(result, kind.result_types):
            return name
    return None


def _register_builtins():
    from lossverify.torch.kinds import policy, router  # noqa: F401 - each registers itself


_register_builtins()
