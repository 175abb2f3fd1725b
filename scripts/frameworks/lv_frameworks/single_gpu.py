"""Shared by the adapters of GPU-only kernels judged on one GPU: the runs of a single rank (tp = cp = dp = 1,
the case's own GA), and package shells for imports that must not run a package's __init__."""
import sys
import types

from lv_frameworks import Run, cross_entropy_cases


def package_shell(name, path):
    """A package whose __init__ is not run (it imports the rest of the library); submodules load from `path`."""
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
    return module


def single_rank_runs(module, function, cases, supports):
    """Every shipped cross-entropy case on one rank; `supports(loss)` returns the overrides and notes that
    bring the case within what the kernel computes, or None to leave the case out."""
    out = []
    for name, case, loss in cross_entropy_cases(cases):
        adapted = supports(loss)
        if adapted is None:
            continue
        overrides, notes = adapted
        ga = case.get("layout", {}).get("ga", 1)
        out.append(Run(f"{module}:{function}", name, {"tp": 1, "cp": 1, "dp": 1, "ga": ga}, overrides, ", ".join(notes)))
    return out
