"""TRL's GRPO loss (`trl.trainer.grpo_trainer.GRPOTrainer.compute_loss` -> `_compute_loss`, with its
`_get_per_token_logps_and_entropies`, `selective_log_softmax` and `entropy_from_logits`), imported from a
checkout and driven without a model, at tp 1 (GRPOTrainer has no tensor or context parallelism) with the
cases' dp and ga, for its loss types grpo, bnpo, dr_grpo and dapo.

The module is loaded unmodified; the trainer instance is built with object.__new__ and given the
attributes `_compute_loss` reads (the GRPOConfig values a user sets). Stubbed around it, none of its
math: the package __init__ files, TRL's modules that grpo_trainer.py imports for generation, chat
templates, profiling (`profiling_decorator` becomes the identity), model preparation, callbacks and its
config and base trainer classes, and third-party packages where they are not installed (then placeholders:
transformers, accelerate, datasets, pandas, ... — the loss uses only torch); `trl.trainer.utils` is real.
The model is a stand-in whose forward returns the run's logits as `outputs.logits`, so TRL's own
`_get_per_token_logps_and_entropies` (drop the last position, `logits.div_(temperature)`,
`selective_log_softmax`, `entropy_from_logits`) computes the log-probs and entropies. The accelerator is
process-group plumbing over the run's DP group: `num_processes`, `gather` (all-gather) and `reduce`
(all-reduce sum).

What the adapter does around `compute_loss`, as GRPOTrainer and the HF Trainer do: one sequence per batch
row (a 1-token prompt, the completion = the sequence's next-token labels, completion_mask = the loss mask),
the sequence's advantage, old and reference log-probs, `num_items_in_batch` = N of the whole step (the
generation batch of steps_per_generation = GA micro-batches, gathered over processes),
`current_gradient_accumulation_steps` = GA, max_completion_length = the case's H_max (Dr. GRPO); the loss
back-propagated as returned (GRPOTrainer passes a non-None `compute_loss_func` so that the Trainer does
not divide by GA, and the Accelerator is built without gradient accumulation), DDP averaging the
gradients over DP, micro-batch gradients summed.
"""
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections import defaultdict

import torch
import torch.distributed as dist

from lossverify.torch import Reduced
from lv_frameworks import Run, checkout, git_commit
from lv_frameworks.nemo_rl import cleared, derived_case
from lv_frameworks.single_gpu import package_shell

NAME = "TRL"
EXPLANATIONS = ["dp-local-mean", "rl-token-mean-sample-weighted", "rl-microbatch-self-normalized",
                "rl-schedule-double-divide", "rl-temperature-one-side", "ga-microbatch-mean",
                "microbatch-local-mean", "rl-stats-microbatch-mean", "rl-logprob-16bit"]
# third-party packages grpo_trainer.py and trl/trainer/utils.py import for anything but the loss: replaced by
# placeholders only where they are not installed
OPTIONAL = {"transformers", "accelerate", "datasets", "pandas", "huggingface_hub", "packaging", "peft", "rich",
            "liger_kernel", "trackio", "wandb", "comet_ml", "jinja2", "vllm", "jmespath", "numpy"}
# TRL's own modules grpo_trainer.py imports for anything but the loss (generation, chat templates, profiling,
# model preparation, callbacks, config, base trainer)
TRL_STUBS = ["trl.chat_template_utils", "trl.data_utils", "trl.distributed", "trl.extras", "trl.extras.profiling",
             "trl.generation", "trl.generation.vllm_generation", "trl.import_utils", "trl.models", "trl.models.utils",
             "trl.trainer.base_trainer", "trl.trainer.callbacks", "trl.trainer.grpo_config",
             "trl.trainer.model_config"]
_state = {"module": None, "stubbed": []}


class _Falsy:
    """A placeholder value: callable, subscriptable, falsy (so `if is_x_available():` skips)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Falsy()

    def __getattr__(self, name):
        return _Falsy()

    def __getitem__(self, key):
        return _Falsy()

    def __bool__(self):
        return False

    def __or__(self, other):
        return _Falsy

    __ror__ = __or__


def _placeholder_class(name):
    return type(name, (_Falsy,), {"__module__": "lv_frameworks.trl.placeholder"})


class _Placeholder(types.ModuleType):
    """A module whose every attribute is a placeholder class (usable as a base class, a decorator that
    returns a placeholder, a falsy predicate)."""

    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "99.0.0"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder_class(name)
        setattr(self, name, value)
        return value


class _OptionalFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: a placeholder for an OPTIONAL package that no other finder found."""

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in OPTIONAL:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        _state["stubbed"].append(spec.name)
        return _Placeholder(spec.name)

    def exec_module(self, module):
        pass


def _identity_decorator(function):
    return function


def _load():
    if _state["module"] is None:
        root = os.path.join(checkout(), "trl")
        package_shell("trl", root)
        package_shell("trl.trainer", os.path.join(root, "trainer"))
        for name in TRL_STUBS:
            sys.modules[name] = _Placeholder(name)
        sys.modules["trl.extras.profiling"].profiling_decorator = _identity_decorator
        sys.meta_path.append(_OptionalFinder())
        from trl.trainer import grpo_trainer
        _state["module"] = grpo_trainer
    return _state["module"]


class _Accelerator:
    """The run's DP group as accelerate's Accelerator (num_processes, gather, reduce)."""

    def __init__(self, ctx):
        self.group = ctx.dp_group
        self.num_processes = ctx.dp_size
        self.sync_gradients = ctx.micro_batch == ctx.ga - 1
        self.is_main_process = ctx.rank == 0

    def gather(self, tensor):
        tensor = tensor.detach().reshape(-1) if tensor.dim() == 0 else tensor.detach()
        if self.num_processes == 1:
            return tensor
        sizes = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(self.num_processes)]
        dist.all_gather(sizes, torch.tensor([tensor.shape[0]], device=tensor.device), group=self.group)
        longest = int(max(int(s) for s in sizes))
        padded = torch.full((longest,) + tuple(tensor.shape[1:]), float("nan"), dtype=tensor.dtype,
                            device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.num_processes)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        out = tensor.detach().clone()
        if self.num_processes > 1:
            dist.all_reduce(out, group=self.group)
        return out if reduction == "sum" else out / self.num_processes


class _Model:
    """The policy model's stand-in: its forward returns the run's logits, laid out by the adapter."""

    training = True

    def __init__(self, logits):
        self.logits = logits

    def __call__(self, **inputs):
        return types.SimpleNamespace(logits=self.logits)


def _sequence_values(values, mask, sequences, slot, count):
    """One value per sequence (the advantage TRL takes per completion), checked constant over its tokens."""
    out = torch.zeros(count, dtype=torch.float32, device=values.device)
    for s, i in slot.items():
        rows = (sequences == s) & mask
        if rows.any():
            v = values[rows].float()
            if not torch.all(v == v[0]):
                raise ValueError("TRL takes one advantage per completion: this case's advantages vary within one")
            out[i] = v[0]
    return out


def _inputs(logits, labels, ctx):
    """(model stand-in, inputs dict, rows(grid) mapping [B, C] values back to the rows)."""
    sequences = ctx.sequences
    present = sorted(set(int(s) for s in sequences.tolist() if s >= 0))
    slot = {s: i for i, s in enumerate(present)}
    valid_rows = (sequences >= 0).nonzero().squeeze(-1)
    sample = torch.tensor([slot[int(sequences[r])] for r in valid_rows.tolist()], dtype=torch.long,
                          device=logits.device)
    position = ctx.positions[valid_rows].long()
    count, width = len(present), int(position.max()) + 1
    # outputs.logits [B, 1 + C, V]: position p of the completion is predicted by row p; the last is dropped
    grid = logits.new_zeros((count, width + 1, logits.shape[-1])).index_put((sample, position), logits[valid_rows])
    completion_ids = torch.zeros((count, width), dtype=torch.long, device=logits.device)
    completion_ids[sample, position] = torch.where(labels[valid_rows] >= 0, labels[valid_rows],
                                                   torch.zeros_like(labels[valid_rows]))

    def place(values, dtype=torch.float32):
        out = torch.zeros((count, width), dtype=dtype, device=logits.device)
        out[sample, position] = values[valid_rows].to(dtype)
        return out

    first = torch.zeros((count, 1), dtype=torch.long, device=logits.device)
    for s, i in slot.items():
        first[i, 0] = ctx.token_ids[(sequences == s).nonzero()[0, 0]].clamp(min=0)
    inputs = {
        "prompt_ids": first, "prompt_mask": torch.ones_like(first),
        "completion_ids": completion_ids, "completion_mask": place(ctx.loss_mask, torch.long),
        "advantages": _sequence_values(ctx.advantages, ctx.loss_mask, sequences, slot, count),
        "old_per_token_logps": place(ctx.old_logprob), "ref_per_token_logps": place(ctx.ref_logprob),
        "num_items_in_batch": torch.tensor(float(ctx.num_valid_tokens), device=logits.device),
    }

    def rows(values):
        out = values.new_zeros(labels.shape)
        return out.index_put((valid_rows,), values[sample, position])

    return _Model(grid), inputs, rows


LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
              "dapo": "token-mean"}


def _trainer(module, loss_type, ctx, model):
    lc = ctx.loss
    trainer = object.__new__(module.GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type, beta=lc.kl_coef if lc.kl_penalty == "k3" else 0.0, epsilon_low=lc.clip_low,
        epsilon_high=lc.clip_high, temperature=lc.temperature,
        importance_sampling_level="sequence" if lc.ratio == "sequence" else "token",
        max_completion_length=int(lc.norm_constant) if lc.norm_constant else 512,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, use_liger_kernel=False, model_kwarg_keys=set(),
        entropy_coef=lc.entropy_coef, _entropy_bonus_enabled=bool(lc.entropy_coef), use_adaptive_entropy=False,
        current_gradient_accumulation_steps=ctx.ga, accelerator=_Accelerator(ctx), model=model,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    return trainer


def _check_equal_micro_batches(ctx):
    """GRPOTrainer's micro-batches hold per_device_train_batch_size completions each: grpo and dr_grpo
    divide by that count, so a layout whose micro-batches hold different numbers of sequences is one TRL
    never runs."""
    counts = torch.tensor([len(set(int(s) for s in mb.sequences.tolist() if s >= 0)) for mb in ctx.micro_batches],
                          dtype=torch.long, device=ctx.device)
    everyone = [torch.zeros_like(counts) for _ in range(ctx.dp_size)]
    dist.all_gather(everyone, counts, group=ctx.dp_group)
    if len(set(int(c) for part in everyone for c in part.tolist())) != 1:
        raise ValueError("micro-batches with different numbers of sequences: a layout GRPOTrainer never runs")


def _grpo(loss_type, with_stats=False):
    def loss_fn(logits, labels, ctx):
        module = _load()
        if loss_type in ("grpo", "dr_grpo") and ctx.micro_batch == 0:
            _check_equal_micro_batches(ctx)
        model, inputs, rows = _inputs(logits, labels, ctx)
        trainer = _trainer(module, loss_type, ctx, model)
        loss = trainer.compute_loss(model, inputs)
        metrics = trainer._metrics["train"]
        # each logged metric is a global mean over this micro-batch's tokens (all DP ranks); the Trainer's log
        # averages them over the step's micro-batches: this rank's part is value / GA / DP
        parts = {}
        share = 1.0 / (ctx.ga * ctx.dp_size)
        if "kl" in metrics:
            parts["kl"] = metrics["kl"][-1] * share
        if "entropy" in metrics:
            parts["entropy"] = metrics["entropy"][-1] * share
        if "clip_ratio/region_mean" in metrics and ctx.loss.ratio != "sequence":
            parts["clip_fraction"] = metrics["clip_ratio/region_mean"][-1] * share
        return Reduced(loss, stats=(parts or None) if with_stats else None)

    loss_fn.__name__ = f"grpo_loss_{loss_type}{'_stats' if with_stats else ''}"
    loss_fn.__doc__ = f"GRPOTrainer.compute_loss with loss_type={loss_type!r}" + \
        (", and the statistics GRPOTrainer logs (kl, entropy, clip_ratio/region_mean)." if with_stats else ".")
    return loss_fn


grpo_loss_grpo = _grpo("grpo")
grpo_loss_bnpo = _grpo("bnpo")
grpo_loss_dr_grpo = _grpo("dr_grpo")
grpo_loss_dapo = _grpo("dapo")
grpo_loss_dapo_stats = _grpo("dapo", with_stats=True)


def describe(path):
    return {"commit": git_commit(path), "source": "trl/trainer/grpo_trainer.py (GRPOTrainer._compute_loss), "
                                                  "trl/trainer/utils.py"}


def runs(cases):
    """The three policy-loss RL cases at tp 1 and cp 1 with their dp and ga, each loss type under its
    aggregation (grpo seq-mean-token-mean, bnpo and dapo token-mean, dr_grpo seq-mean-token-sum-norm); KL
    k3 (the only estimator TRL has), no dual clip, no whitening (TRL normalises rewards per group upstream);
    the entropy bonus only where TRL's (a token mean of H) is the aggregation's (bnpo, dapo); GSPO's
    sequence ratio with grpo only (TRL refuses the others). A sweep over dp and ga per case and loss type."""
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "policy" or loss.get("objective", "policy_loss") == "logprob":
            continue
        layout = case.get("layout", {})
        rest = {"tp": 1, "cp": 1, **{k: layout[k] for k in ("dp", "ga") if layout.get(k, 1) > 1}}
        base = {}
        if loss.get("kl_penalty", "none") not in ("none", "k3"):
            base["loss.kl_penalty"] = "k3"
        types_ = ["grpo"] if loss.get("ratio") == "sequence" else list(LOSS_TYPES)
        for loss_type in types_:
            aggregation = LOSS_TYPES[loss_type]
            overrides = dict(base)
            dropped = cleared(loss, aggregation=aggregation, whiten=False, dual_clip=0)
            if aggregation != loss.get("aggregation"):
                overrides["loss.aggregation"] = aggregation
            case_file = derived_case(name, case, drop=dropped) if dropped else name
            if aggregation == "seq-mean-token-sum-norm" and not loss.get("norm_constant"):
                overrides["loss.norm_constant"] = 64
            if loss.get("entropy_coef", 0) and loss_type not in ("bnpo", "dapo"):
                overrides["loss.entropy_coef"] = 0
            fn = f"{__name__}:grpo_loss_{loss_type}"
            sequences = len(case["batch"]["sequence_lengths"])
            layouts = [(d, g) for d in (1, 2) for g in (1, 2)]
            if loss_type in ("grpo", "dr_grpo", "bnpo"):  # equal sequence counts per micro-batch, as in TRL
                layouts = [(d, g) for d, g in layouts if sequences % (d * g) == 0]
            own = (rest.get("dp", 1), rest.get("ga", 1))
            if own not in layouts:
                own = max(layouts, key=lambda l: l[0] * l[1])
            out.append(Run(fn, case_file, {"tp": 1, "cp": 1, "dp": own[0], "ga": own[1]}, overrides))
            if case.get("inputs", {}).get("dtype", "fp32") in ("bf16", "fp16"):  # TRL's 16-bit log-softmax
                out.append(Run(fn, case_file, {"tp": 1, "cp": 1, "dp": own[0], "ga": own[1]},
                               dict(overrides, **{"inputs.dtype": "fp32"}), "the same inputs in float32"))
            if loss_type == "bnpo" and own != (rest.get("dp", 1), rest.get("ga", 1)):
                out.append(Run(fn, case_file, dict(rest), overrides, "unequal micro-batches"))
            if loss_type == "dapo":
                out.append(Run(f"{fn}_stats", case_file, dict(rest), overrides, "logged statistics"))
            out.append(Run(fn, case_file, None, overrides, "sweep",
                           sweep=[f"tp1-cp1-dp{d}-ga{g}" for d, g in layouts]))
    return out
