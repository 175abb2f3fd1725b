"""Check a PyTorch loss function against lossverify's float64 reference on real torch.distributed ranks.

    import lossverify.torch as lvt

    def my_loss(logits, labels, ctx):          # logits: this rank's shard, a leaf that requires grad
        return my_vocab_parallel_cross_entropy(logits, labels, ctx.tp_group, ctx.vocab_start)  # [rows]

    lvt.check(my_loss, "cases/smoothing-pytorch.json", tp=4).assert_pass()

From a shell: python3 -m lossverify.torch run --fn my_module:my_loss cases/smoothing-pytorch.json --tp 4.
See docs/pytorch.md. `lossverify.torch.implementations` holds the project's own implementations: the
correct vocabulary-parallel cross-entropy, KD and RL policy loss, and catalogued bugs written the way
frameworks wrote them. A policy case's function may also return `LogProbs(logprob, entropy)`, a trainer's
log-prob pass; a router case's `RouterLosses(aux, z)`, a router's aux terms and z-loss of one micro-batch.
"""

from lossverify.torch.harness import check, check_many, sweep

__all__ = ["Context", "FrameworkConfig", "LogProbs", "LossConfig", "MicroBatch", "Reduced", "RouterLosses", "check",
           "check_many", "sweep"]
_CONTEXT_NAMES = ("Context", "FrameworkConfig", "LogProbs", "LossConfig", "MicroBatch", "Reduced", "RouterLosses")


def __getattr__(name):
    """The context records import torch: they load when first named, so that `python3 -m lossverify.torch`
    can start its rank processes' torch import before its own (the harness's parent needs none)."""
    if name in _CONTEXT_NAMES:
        from lossverify.torch import context

        return getattr(context, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
