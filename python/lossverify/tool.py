"""Finding and running the lossverify executable: `export-inputs` and `check-dump`.

The executable is looked up, in order:
1. an explicit `binary=` argument (`--binary`);
2. the environment variable LOSSVERIFY_BIN;
3. the executable packaged with this module, lossverify/_bin/lossverify (`pip install ./python` builds it);
4. `lossverify` on PATH;
5. the checkout's build tree next to this package (python/../build/release/cli/lossverify), so a checkout
   works with PYTHONPATH=python and nothing installed.
The first two are taken as given: a wrong path there is an error, not a reason to look further.
"""

import os
import shutil
import subprocess

from lossverify.errors import BinaryNotFoundError, ToolError, UsageError
from lossverify.report import load_report

__all__ = ["find_binary", "export_inputs", "check_dump", "layout_arguments", "set_arguments"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGED = os.path.join(_HERE, "_bin", "lossverify")
_BUILD_TREE = os.path.join(_HERE, "..", "..", "build", "release", "cli", "lossverify")


def find_binary(binary=None):
    """The path of the lossverify executable; BinaryNotFoundError saying where it looked."""
    if binary:
        candidates = [("binary=", binary)]
    elif os.environ.get("LOSSVERIFY_BIN"):
        candidates = [("LOSSVERIFY_BIN", os.environ["LOSSVERIFY_BIN"])]
    else:
        candidates = [("packaged", _PACKAGED), ("PATH", shutil.which("lossverify")),
                      ("the build tree", os.path.normpath(_BUILD_TREE))]
    looked = []
    for origin, path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
        looked.append(f"{path} ({origin})" if path else "lossverify on PATH")
    raise BinaryNotFoundError("cannot find the lossverify executable; looked at " + ", ".join(looked) +
                              ". Install the package with pip (it builds the executable), pass binary=..., set "
                              "LOSSVERIFY_BIN or put lossverify on PATH.")


def layout_arguments(tp=None, cp=None, dp=None, ga=None):
    """--tp N ... for the counts that are given (None keeps the case's own)."""
    args = []
    for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("ga", ga)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
        args += [f"--{name}", str(value)]
    return args


def set_arguments(overrides):
    """--set k=v ... from a dict {"loss.label_smoothing": 0.1} or a list of "k=v" strings."""
    if not overrides:
        return []
    if isinstance(overrides, dict):
        items = []
        for key, value in overrides.items():
            if isinstance(value, bool):
                value = "true" if value else "false"
            items.append(f"{key}={value}")
    elif isinstance(overrides, str):
        items = [overrides]
    else:
        items = list(overrides)
    args = []
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set expects key=value, got {item!r}")
        args += ["--set", item]
    return args


def _run(binary, args, timeout=None):
    command = [binary] + args
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise ToolError(f"{' '.join(command)}: no answer within {timeout} s", command=command) from e


_PREFIXES = ("lossverify: error: ", "lossverify: internal error: ", "lossverify: timeout: ")


def _raise_for(result, command):
    """Exit code 2 is the caller's mistake (bad case, malformed dump): UsageError with lossverify's message
    (without its own "lossverify: error:" prefix, which the caller's message adds again)."""
    output = (result.stderr or "") + (result.stdout or "")
    lines = output.strip().splitlines()
    for i, line in enumerate(lines):
        for prefix in _PREFIXES:
            if line.startswith(prefix):
                lines[i] = line[len(prefix):]
    message = "\n".join(lines) or f"exit code {result.returncode}"
    if result.returncode == 2:
        raise UsageError(message)
    raise ToolError(f"{' '.join(command)} failed (exit code {result.returncode}):\n{message}", command=command,
                    returncode=result.returncode, output=output)


def export_inputs(case, out_dir, tp=None, cp=None, dp=None, ga=None, overrides=None, binary=None, timeout=None,
                  rank=None):
    """Run `lossverify export-inputs CASE --out OUT_DIR` (OUT_DIR new or empty); returns OUT_DIR. rank: write
    only that world rank's file (the index still describes every rank)."""
    binary = find_binary(binary)
    args = ["export-inputs", os.fspath(case), *set_arguments(overrides), *layout_arguments(tp, cp, dp, ga),
            "--out", os.fspath(out_dir)]
    if rank is not None:
        args += ["--rank", str(int(rank))]
    result = _run(binary, args, timeout)
    if result.returncode != 0:
        _raise_for(result, [binary] + args)
    return os.fspath(out_dir)


def check_dump(manifests, report_path, binary=None, timeout=None, warnings=(), dump_dir=None, dump_kept=True,
               control=True):
    """Run `lossverify check-dump --manifest M [--manifest M2 ...] --report R` and return the Report.
    control=False passes --no-control (no control band: lossverify's correct implementations are not run).

    Exit codes 0 and 1 both give a report (pass or fail); 2 (a malformed dump) raises UsageError and 3
    raises ToolError, each with lossverify's message.
    """
    binary = find_binary(binary)
    if isinstance(manifests, (str, os.PathLike)):
        manifests = [manifests]
    args = ["check-dump"]
    for manifest in manifests:
        args += ["--manifest", os.fspath(manifest)]
    args += ["--report", os.fspath(report_path), "--quiet"]
    if not control:
        args.append("--no-control")
    result = _run(binary, args, timeout)
    if result.returncode not in (0, 1) or not os.path.exists(report_path):
        _raise_for(result, [binary] + args)
    report = load_report(report_path, warnings=warnings, dump_dir=dump_dir, dump_kept=dump_kept)
    if report.exit_code != result.returncode:
        raise ToolError(f"check-dump exited {result.returncode} but its report says {report.exit_code}",
                        command=[binary] + args, returncode=result.returncode, output=result.stdout)
    return report
