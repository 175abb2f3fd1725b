"""ms-swift's Megatron GRPO log-prob and entropy pass (`swift.megatron.trainers.vocab_parallel_utils.
compute_logps_and_entropy_from_logits`: `vocab_parallel_log_softmax`, `vocab_parallel_gather_logps`,
`vocab_parallel_entropy`), imported from a checkout, judged as LogProbs at tp 1, 2 and 4.

The module is loaded unmodified. Stubbed around it, none of its math: the `swift`, `swift.megatron` and
`swift.megatron.trainers` package __init__ files (they import the whole library), and `megatron.core.mpu`
(parallel_state), whose getters answer the run's own TP group, rank and size. The module imports nothing
else from Megatron (no `vocab_parallel_cross_entropy`).

Around it, what `MegatronGRPOTrainer.forward_step` (swift/megatron/trainers/grpo_trainer.py) does: the logits
divided by the temperature in place when it is not 1 (`logits_packed.div_(self.temperature)`; here on a copy, since
the harness's logits are a leaf), on the float32 logits that Megatron's Float16Module hands the last pipeline
stage (its float16_to_fp32), then `compute_logps_and_entropy_from_logits(logits, labels,
compute_entropy=True)`; labels are -100 on masked rows (Megatron's convention, which the function masks).
"""
import os
import sys
import types

import torch

from lossverify.torch import LogProbs
from lv_frameworks import Run, checkout, git_commit
from lv_frameworks.single_gpu import package_shell

NAME = "ms-swift"
EXPLANATIONS = ["rl-logsoftmax-untracked-allreduce", "rl-logprob-untracked-allreduce", "rl-entropy-untracked-allreduce",
                "rl-temperature-one-side"]
_module = None
_tp = {"group": None, "size": 1, "rank": 0}


def _load():
    global _module
    if _module is None:
        root = os.path.join(checkout(), "swift")
        package_shell("swift", root)
        package_shell("swift.megatron", os.path.join(root, "megatron"))
        package_shell("swift.megatron.trainers", os.path.join(root, "megatron", "trainers"))
        mpu = types.ModuleType("megatron.core.mpu")
        mpu.get_tensor_model_parallel_world_size = lambda: _tp["size"]
        mpu.get_tensor_model_parallel_rank = lambda: _tp["rank"]
        mpu.get_tensor_model_parallel_group = lambda: _tp["group"]
        if "megatron" not in sys.modules:
            package_shell("megatron", "/nonexistent")
        core = sys.modules.get("megatron.core") or package_shell("megatron.core", "/nonexistent")
        core.mpu = mpu
        sys.modules["megatron.core.mpu"] = mpu
        from swift.megatron.trainers import vocab_parallel_utils
        _module = vocab_parallel_utils
    return _module


def logps_and_entropy(logits, labels, ctx):
    """forward_step's log-prob pass: logits / T, then compute_logps_and_entropy_from_logits(..., True)."""
    module = _load()
    _tp.update(group=ctx.tp_group, size=ctx.tp_size, rank=ctx.tp_rank)
    # Megatron's Float16Module (the bf16/fp16 model wrapper) casts the last stage's output to float32
    # (float16_to_fp32): forward_step receives float32 logits
    x = logits.float()
    if ctx.loss.temperature != 1.0:
        x = x.clone()  # the harness's logits are a leaf: div_ on a copy, the same op
        x.div_(ctx.loss.temperature)
    labels = torch.where(ctx.loss_mask, labels, torch.full_like(labels, -100))
    logps, entropy = module.compute_logps_and_entropy_from_logits(x.unsqueeze(0), labels.unsqueeze(0),
                                                                   compute_entropy=True)
    return LogProbs(logps.squeeze(0), entropy.squeeze(0))


def describe(path):
    return {"commit": git_commit(path), "source": "swift/megatron/trainers/vocab_parallel_utils.py"}


def runs(cases):
    """Every RL case at tp 1, 2 and 4 where V splits evenly (vocab_start = tp_rank x shard width), with the
    case's cp, dp and ga; and each case without its entropy bonus (the log-prob gradient alone)."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy":
            continue
        layout = case.get("layout", {})
        rest = {k: layout[k] for k in ("cp", "dp", "ga") if layout.get(k, 1) > 1}
        for tp in (1, 2, 4):
            if case["shape"]["vocab"] % tp:
                continue
            out.append(Run(f"{__name__}:logps_and_entropy", name, {"tp": tp, **rest}))
            if tp > 1 and loss.get("entropy_coef", 0):
                out.append(Run(f"{__name__}:logps_and_entropy", name, {"tp": tp, **rest},
                               {"loss.entropy_coef": 0}, "no entropy bonus"))
    return out
