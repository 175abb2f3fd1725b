"""Adapters that call real frameworks' loss functions, as shipped, under lossverify.torch.

Each module imports its framework from the checkout named by LV_FRAMEWORK_CHECKOUT (the rank processes
import these modules by name, so the path travels in the environment) and defines:
  NAME            the framework's name in the results
  describe(path)  {"commit": ..., "source": ...}: what is judged
  runs(cases)     the (function, case, layout, overrides, note) runs of its supported subset
and the module-level loss functions that the runs name.
"""
import os
import subprocess
import sys
import types


def checkout():
    """The framework checkout the rank processes import from."""
    path = os.environ.get("LV_FRAMEWORK_CHECKOUT")
    if not path:
        raise RuntimeError("LV_FRAMEWORK_CHECKOUT is not set: run scripts/frameworks/judge.py")
    return path


def stub_module(name, **attributes):
    """A module standing in for an import the judged code needs but never runs (process-group plumbing, config
    classes, loggers): its attributes are the ones given. Registered in sys.modules under `name`."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def stub_megatron_core_utils(fallback_group=lambda: None):
    """megatron.core.utils, as much as Megatron's cross_entropy.py and tensor_parallel/utils.py import from it:
    a group's rank and size, divide, the torch-version probe, and the TP group where a caller passes none
    (fallback_group())."""
    import torch

    def divide(numerator, denominator):
        assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
        return numerator // denominator

    def is_torch_min_version(version, check_equality=True):
        have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3] if x.isdigit())
        want = tuple(int(x) for x in version.split("."))
        return have >= want if check_equality else have > want

    return stub_module("megatron.core.utils", get_pg_rank=lambda group=None: torch.distributed.get_rank(group),
                       get_pg_size=lambda group=None: torch.distributed.get_world_size(group),
                       get_tensor_model_parallel_group_if_none=lambda group, **kwargs:
                       group if group is not None else fallback_group(),
                       divide=divide, is_torch_min_version=is_torch_min_version)


def git_commit(path):
    """The checkout's commit (short), or "unknown" when it is not a git work tree."""
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cross_entropy_cases(cases):
    """(name, case, loss section) of every shipped cross-entropy case, by name."""
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind", "cross_entropy") == "cross_entropy":
            yield name, case, loss


def head_cross_entropy_cases(cases, upstream=True):
    """(name, case, loss section) of every shipped cross-entropy case with an LM head in front, by name; without
    those that give upstream weights (reduction none) unless `upstream`."""
    for name, case, loss in cross_entropy_cases(cases):
        if case.get("stage", {}).get("kind") == "lm_head" and (upstream or "upstream_weights" not in loss):
            yield name, case, loss


def head_overrides(case, loss, without=(), ignore_index=None, bias=True, sp=True):
    """The --set overrides, and notes saying them, that bring an LM-head case within what a fused head computes:
    the loss features in `without` turned off (adapt), `ignore_index` where it differs from the case's, the bias
    dropped unless the head takes one (`bias`), sequence parallelism off unless it takes it (`sp`)."""
    overrides, notes = adapt(loss, without=without)
    if ignore_index is not None and loss.get("ignore_index", -100) != ignore_index:
        overrides["loss.ignore_index"] = ignore_index
        notes.append(f"ignore_index {ignore_index}")
    if not bias and case.get("stage", {}).get("bias"):
        overrides["stage.bias"] = False
        notes.append("no bias")
    if not sp and case.get("layout", {}).get("sp"):
        overrides["layout.sp"] = False
        notes.append("no sequence parallelism")
    return overrides, notes


def with_fp32(case, overrides, notes):
    """(overrides, note) in the case's dtype and, for a 16-bit case, in fp32 too."""
    first = case.get("inputs", {}).get("dtype", "fp32")
    yield dict(overrides), ", ".join(notes)
    if first != "fp32":
        yield {**overrides, "inputs.dtype": "fp32"}, ", ".join(notes + ["fp32"])


def triton_gpu():
    """Whether this machine can run Triton kernels (a framework's GPU functions are listed only there)."""
    try:
        import triton  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def adapt(loss, without=(), convention=None):
    """The --set overrides, and notes saying them, that bring a case's loss within what a kernel computes:
    the features in `without` (label_smoothing, z_loss_weight, softcap) turned off, and the smoothing `convention`
    it uses."""
    overrides, notes = {}, []
    names = {"label_smoothing": "no smoothing", "z_loss_weight": "z-loss off", "softcap": "softcap off"}
    for key in without:
        if loss.get(key, 0):
            overrides[f"loss.{key}"] = 0
            notes.append(names[key])
    if convention and loss.get("label_smoothing", 0) and loss.get("smoothing_convention", "pytorch") != convention:
        overrides["loss.smoothing_convention"] = convention
        notes.append(f"{convention} convention")
    return overrides, notes


class Run:
    """One check: a loss function on a shipped case at a layout, with --set overrides."""

    def __init__(self, function, case, layout, overrides=None, note="", sweep=None):
        self.function = function  # "lv_frameworks.module:function"
        self.case = case          # a shipped case's name
        self.layout = layout      # {"tp": 2, ...}; for a sweep, the layouts instead
        self.overrides = overrides or {}
        self.note = note
        self.sweep = sweep        # a list of layout labels ("tp2-cp1-dp1-ga1"): a sweep with invariance

    @property
    def label(self):
        if self.sweep:
            return f"sweep of {len(self.sweep)}"
        return "-".join(f"{k}{v}" for k, v in self.layout.items())
