"""Check a PyTorch loss function against lossverify's float64 reference on real torch.distributed ranks.

    import lossverify.torch as lvt

    def my_loss(logits, labels, ctx):          # logits: this rank's shard, a leaf that requires grad
        return my_vocab_parallel_cross_entropy(logits, labels, ctx.tp_group, ctx.vocab_start)  # [rows]

    lvt.check(my_loss, "cases/smoothing-pytorch.json", tp=4).assert_pass()

From a shell: python3 -m lossverify.torch run --fn my_module:my_loss cases/smoothing-pytorch.json --tp 4.
See docs/pytorch.md. `lossverify.torch.implementations` holds the project's own implementations: the
correct vocabulary-parallel cross-entropy and KD, and catalogued bugs written the way frameworks wrote them.
"""

from lossverify.torch.context import Context, FrameworkConfig, LossConfig, MicroBatch, Reduced
from lossverify.torch.harness import check, check_many, sweep

__all__ = ["Context", "FrameworkConfig", "LossConfig", "MicroBatch", "Reduced", "check", "check_many", "sweep"]
