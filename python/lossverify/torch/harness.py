"""Checking a PyTorch loss function on real torch.distributed ranks against lossverify's reference.

`check(fn, case, tp=2)`:
1. `lossverify export-inputs` writes every rank's exact inputs of the case at the layout;
2. tp x cp x dp rank processes (gloo on CPU; NCCL with one GPU per rank for device="cuda") each run fn on
   their logits shard, micro-batch by micro-batch, back-propagate and write their part of a dump;
3. `lossverify check-dump` checks the dump; its report comes back as a `Report`.

Rank processes are started from a fork server that has already imported torch, so a launch costs
milliseconds instead of a torch import per rank. A rank that fails ends the launch: the others are
stopped at once (no waiting for a collective timeout), and the error names the rank and carries its
traceback (UserFunctionError for the checked code, ToolError otherwise); a launch that does not finish in
time raises HarnessTimeout.
"""

import contextlib
import importlib.util
import itertools
import json
import math
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid

from lossverify import inputs as inputs_module
from lossverify import tool
from lossverify.errors import HarnessTimeout, ToolError, UsageError, UserFunctionError
from lossverify.layout import parse_layout
from lossverify.output import check_output_folder, check_output_path, write_output
from lossverify.torch._launch import RETURNS, Job, Launch, process_context, rank_entry, start_process_context
from lossverify.torch._orphans import orphans_end_with_the_launch

__all__ = ["check", "check_many", "sweep"]

_STOP_GRACE_SECONDS = 1.0  # after a rank fails, how long the others get to write their own status
MAX_SWEEP_LAYOUTS = 256  # as the C++ tool's sweeps
_process_context = process_context  # the tests start their own ranks from the same server


def check(fn, case, tp=None, cp=None, dp=None, ga=None, device="cpu", set=None, returns="auto", binary=None,
          keep_dump=None, timeout=None, name=None, report=None, backend=None, control=True):
    """Run `fn(logits, labels, ctx)` on every rank of `case` (a case file) at the layout and check it.

    tp, cp, dp, ga override the case's layout; set: --set overrides ({"loss.label_smoothing": 0.1} or
    ["k=v", ...]); returns: "auto" (per-token losses, or a Reduced), "token_loss" or "reduced" (a scalar is
    an already-reduced loss); keep_dump: a new or empty folder to keep the inputs, dump and report in;
    timeout: seconds per launch (default: the case's timeout_seconds); report: also write the report JSON
    there; backend: the process group's, "gloo" (the default on the CPU; on "cuda" the ranks then share the
    GPUs, rank % GPUs) or "nccl" (the default on "cuda": one GPU per rank); control: the control band (the
    margins lossverify's correct implementation reaches on the same inputs in float32 and in the case's 16-bit
    dtype, docs/checks.md), on by default. Returns the Report
    (report.assert_pass() for tests); raises UserFunctionError when fn raises.
    """
    name = name or _function_name(fn)
    check_output_path("--report", report, inputs=[case])
    _check_report_beside_dump(report, keep_dump)
    reports = check_many({name: fn}, case, tp=tp, cp=cp, dp=dp, ga=ga, device=device, set=set, returns=returns,
                         binary=binary, keep_dump=keep_dump, timeout=timeout, backend=backend, control=control)
    result = reports[name]
    if report:
        _copy_report(result, report)
    return result


_LAYOUT_LABEL = re.compile(r"tp\d+(-sp)?-cp\d+-dp\d+-ga\d+")


def _check_report_beside_dump(report, keep_dump):
    """A --report inside the --keep-dump folder may sit beside what the launch writes there, never on it: its
    inputs/ and dumps/ (a sweep's layout folders and report.json), or its hidden status folders. Refused before
    the run, which would otherwise fail writing it at the end."""
    if not report or not keep_dump:
        return
    folder = os.path.abspath(os.fspath(keep_dump))
    path = os.path.abspath(os.fspath(report))
    relative = os.path.relpath(path, folder)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return  # elsewhere
    first = relative.split(os.sep)[0]
    if os.sep in relative or first in ("inputs", "dumps", "report.json") or first.startswith(".") or (
            _LAYOUT_LABEL.fullmatch(first)):
        raise UsageError(f"--report {path!r}: inside --keep-dump {folder!r}, where the launch writes {first!r}: "
                         "give a file name of its own at the folder's top, or write it elsewhere")


def check_many(fns, case, tp=None, cp=None, dp=None, ga=None, device="cpu", set=None, returns="auto", binary=None,
               keep_dump=None, timeout=None, backend=None, control=True):
    """Like `check` for several functions on the same inputs and process group, one dump and report each
    (cheaper than one launch per function). fns: {name: fn} or a list of functions. Returns {name: Report}."""
    jobs_in = _named_functions(fns)
    backend = _check_arguments(device, returns, backend, timeout)
    _check_case_file(case)
    check_output_folder("--keep-dump", keep_dump)
    binary = tool.find_binary(binary)
    start_process_context()  # the server imports torch while the inputs are exported
    with _work_directory(keep_dump) as work:
        inputs_dir = os.path.join(work, "inputs")
        inputs = _export(case, inputs_dir, tp, cp, dp, ga, set, binary)
        folders = _unique_slugs(jobs_in)
        jobs = [Job(fn=f, name=n, dump_dir=os.path.join(work, "dumps", folders[n]), returns=returns)
                for n, f in jobs_in.items()]
        warnings = _launch(inputs, jobs, device, backend, timeout, work)
        reports = {}
        for job in jobs:
            kept = job.dump_dir if keep_dump else None
            reports[job.name] = tool.check_dump(os.path.join(job.dump_dir, "manifest.json"),
                                                os.path.join(job.dump_dir, "report.json"), binary=binary,
                                                warnings=warnings.get(job.name, []), dump_dir=kept,
                                                dump_kept=bool(keep_dump), control=control)
        return reports


def sweep(fn, case, layouts=None, device="cpu", set=None, returns="auto", binary=None, keep_dump=None, timeout=None,
          name=None, report=None, backend=None, control=True):
    """Run fn at several layouts of the same case and check each run and their invariance (check-dump with
    one manifest per layout). layouts: a list of {"tp": 2, ...}, (tp, cp, dp, ga) tuples or
    "tp2-cp1-dp1-ga1" strings; default: the product of the case file's "sweep" section."""
    backend = _check_arguments(device, returns, backend, timeout)
    _check_case_file(case)
    check_output_path("--report", report, inputs=[case])
    check_output_folder("--keep-dump", keep_dump)
    _check_report_beside_dump(report, keep_dump)
    name = name or _function_name(fn)
    _named_functions({name: fn})
    layouts = _sweep_layouts(case, layouts)
    binary = tool.find_binary(binary)
    start_process_context()
    with _work_directory(keep_dump) as work:
        manifests, warnings = [], []
        for layout in layouts:
            folder = os.path.join(work, layout.label)
            inputs = _export(case, os.path.join(folder, "inputs"), layout.tp, layout.cp, layout.dp, layout.ga,
                             _with_sp(set, layout), binary)
            job = Job(fn=fn, name=name, dump_dir=os.path.join(folder, "dump"), returns=returns)
            warnings += _launch(inputs, [job], device, backend, timeout, folder).get(name, [])
            manifests.append(os.path.join(job.dump_dir, "manifest.json"))
        result = tool.check_dump(manifests, os.path.join(work, "report.json"), binary=binary, warnings=warnings,
                                 dump_dir=work if keep_dump else None, dump_kept=bool(keep_dump),
                                 control=control)
    if report:
        _copy_report(result, report)
    return result


# ---------------------------------------------------------------------------------------------------------


def _require_torch():
    """This Python must be able to import torch (the ranks do): a usage error naming the interpreter otherwise,
    found without importing it (a virtual environment without --system-site-packages does not see the system's)."""
    if importlib.util.find_spec("torch") is None:
        raise UsageError(f"lossverify.torch needs PyTorch >= 1.13, and {sys.executable} cannot import torch: install "
                         "it there (Debian: python3-torch; a venv must see it: --system-site-packages), or run the "
                         "Python that has it")


def _check_arguments(device, returns, backend, timeout=None):
    """Validates the options; returns the process group's backend."""
    _require_torch()
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or (
                timeout <= 0):
            raise UsageError(f"timeout must be a finite number of seconds above 0, got {timeout!r}")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be \"cpu\" or \"cuda\", got {device!r}")
    if returns not in RETURNS:
        raise UsageError(f"returns must be one of {', '.join(RETURNS)}, got {returns!r}")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise UsageError(f"backend must be \"gloo\" or \"nccl\", got {backend!r}")
    if backend == "nccl" and device != "cuda":
        raise UsageError("backend \"nccl\" needs device=\"cuda\"")
    return backend


def _function_name(fn):
    """module:qualname, with the project's implementations under their public module."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None) or "?"
    if module.startswith("lossverify.torch.implementations."):
        module = "lossverify.torch.implementations"
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


def _named_functions(fns):
    if isinstance(fns, dict):
        named = dict(fns)
    else:
        named = {}
        for fn in fns:
            named[_function_name(fn)] = fn
    if not named:
        raise UsageError("no loss function to check")
    for name, fn in named.items():
        if not (callable(fn) or isinstance(fn, str)):
            raise UsageError(f"expected a function or \"module:function\", got {fn!r}")
        if callable(fn):
            try:  # the rank processes import it by name: a lambda or a nested function cannot travel
                pickle.dumps(fn)
            except Exception as e:
                raise UsageError(f"{name}: the loss function must be importable by name (a module-level "
                                 f"function, or \"module:function\"): {e}") from None
    return named


def _unique_slugs(names):
    """{name: folder name}: the function's name made file-safe, numbered when two would collide."""
    folders, used = {}, set()
    for name in names:
        slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.split(":")[-1]).strip("-.") or "fn"
        folder, k = slug, 2
        while folder in used:
            folder, k = f"{slug}-{k}", k + 1
        used.add(folder)
        folders[name] = folder
    return folders


@contextlib.contextmanager
def _work_directory(keep):
    """The launch's folder: `keep` (new or empty, kept) or a temporary one."""
    if keep:
        keep = os.path.abspath(os.fspath(keep))
        check_output_folder("--keep-dump", keep)
        os.makedirs(keep, exist_ok=True)
        yield keep
    else:
        with tempfile.TemporaryDirectory(prefix="lossverify-torch-") as work:
            yield work


def _with_sp(overrides, layout):
    """The --set overrides with the sweep layout's sequence parallelism (layout.sp) added."""
    if isinstance(overrides, dict):
        return {**overrides, "layout.sp": layout.sp}
    items = [overrides] if isinstance(overrides, str) else list(overrides or [])
    return items + ["layout.sp=" + ("true" if layout.sp else "false")]


def _export(case, out_dir, tp, cp, dp, ga, overrides, binary):
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    inputs = inputs_module.export(case, out_dir, tp=tp, cp=cp, dp=dp, ga=ga, overrides=overrides, binary=binary)
    _ = inputs.head  # an LM head the package does not run is an InputsError here, before any rank starts
    return inputs


def _check_case_file(case):
    """The case file exists and is a regular file (export-inputs judges its contents)."""
    path = os.fspath(case)
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such case file" if not os.path.exists(path) else f"{path}: not a regular file")


def _sweep_layouts(case, layouts):
    """Every layout of the sweep, parsed and bounded before the first one runs."""
    try:
        parsed = [parse_layout(x) for x in layouts] if layouts else _case_sweep(case)
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"sweep layouts: {e}") from None
    if not parsed:
        raise UsageError(f"{case}: no layouts to sweep (give layouts=... or a \"sweep\" section in the case)")
    if len(parsed) > MAX_SWEEP_LAYOUTS:
        raise UsageError(f"{case}: the sweep has {len(parsed)} layouts; at most {MAX_SWEEP_LAYOUTS} run in one command "
                         "(split it)")
    for layout in parsed:
        _check_world_size(layout.world_size, layout.label)
    return parsed


def _case_sweep(case):
    """Layouts of the case file's "sweep" section (tp fastest, then ga, cp, dp), the rest from its layout."""
    try:
        with open(case, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{case}: cannot read the case: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{case}: a case is a JSON object")
    section = data.get("sweep")
    if not section:
        return []
    base = {"tp": 1, "cp": 1, "dp": 1, "ga": 1, "sp": False, **data.get("layout", {})}
    axes = {k: section.get(k, [base[k]]) for k in ("dp", "cp", "ga", "tp", "sp")}
    layouts = []
    for dp, cp, ga, tp, sp in itertools.product(axes["dp"], axes["cp"], axes["ga"], axes["tp"], axes["sp"]):
        if sp and tp == 1:
            continue  # sequence parallelism splits over TP ranks: the layout is the one without it (as lossverify)
        layouts.append(parse_layout({"tp": tp, "cp": cp, "dp": dp, "ga": ga, "sp": sp}))
    return layouts


def _copy_report(result, path):
    write_output("--report", path, json.dumps(result.raw, indent=1) + "\n")


def max_rank_processes():
    """Rank processes one launch may start: 16 per core, at least 32 (LOSSVERIFY_TORCH_MAX_RANKS overrides).
    Past that, their start-up alone (a process group and its groups over a shared file) outlasts timeouts."""
    override = os.environ.get("LOSSVERIFY_TORCH_MAX_RANKS")
    if override:
        return max(1, int(override))
    return max(32, 16 * (os.cpu_count() or 1))


def _check_world_size(world, label):
    limit = max_rank_processes()
    if world > limit:
        raise UsageError(f"layout {label}: {world} rank processes, but at most {limit} run in one launch on this "
                         f"machine ({os.cpu_count()} cores): use `lossverify run` (thread ranks) for the same layout, "
                         "or torchrun across machines")


def _launch(inputs, jobs, device, backend, timeout, work):
    """Run the jobs on one world of rank processes; {job name: [warnings]}. Raises on any rank's failure."""
    world = inputs.layout.world_size
    _check_world_size(world, inputs.layout.label)
    if device == "cuda":
        _require_gpus(world if backend == "nccl" else 1)
    timeout = float(timeout or inputs.case.get("timeout_seconds") or 120.0)
    status_dir = os.path.join(work, f".status-{uuid.uuid4().hex[:8]}")
    os.makedirs(status_dir)
    launch = Launch(inputs_dir=inputs.directory, jobs=jobs, world_size=world, device=device, backend=backend,
                    init_file=os.path.join(status_dir, "init"), status_dir=status_dir, timeout_seconds=timeout,
                    threads=_threads_per_rank(), launched_at=time.monotonic())
    context = process_context()
    processes = [context.Process(target=rank_entry, args=(rank, launch), name=f"lossverify-rank{rank}")
                 for rank in range(world)]
    ended = {}  # rank -> time.time() when the parent saw its process end
    where = {}
    stopped = set()
    with orphans_end_with_the_launch(keep=_fork_server_pids):
        try:
            with _terminated_cleanly():
                for p in processes:
                    p.start()
                timed_out = not _wait(processes, timeout * max(1, len(jobs)), status_dir, ended)
                if timed_out:
                    where = _where_ranks_are(processes, status_dir)
        finally:
            stopped = _stop(processes)
    statuses = _read_statuses(status_dir, world)
    shutil.rmtree(status_dir, ignore_errors=True)
    _raise_for_failures(processes, statuses, ended, stopped, timed_out, where, timeout, inputs)
    warnings = {job.name: [] for job in jobs}
    for rank in range(world):
        for name, messages in statuses[rank].get("warnings", {}).items():
            warnings[name] += messages
    return warnings


def _fork_server_pids():
    """The fork server ranks start from: a child of this process that lives on for the next launch."""
    try:
        from multiprocessing import forkserver

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        return {pid} if pid else set()
    except ImportError:
        return set()


class Terminated(BaseException):
    """SIGTERM reached the harness: the launch's ranks, their children and its folders go first."""


@contextlib.contextmanager
def _terminated_cleanly():
    """While ranks run, SIGTERM unwinds the harness (stopping the ranks, removing its temporary folders) instead
    of leaving them behind; the command line then ends as SIGTERM would have ended it."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _threads_per_rank():
    """torch intra-op threads of each rank: LOSSVERIFY_TORCH_THREADS, else 1. The ranks already run in
    parallel, and one thread per rank makes a rank's arithmetic independent of the machine. (With the
    cores shared out instead, three full test runs on a 16-core machine with torch 2.11 each had one check
    in which one thread's block of 32 rows came out about 1e-5 off; it never reproduced in 200 runs alone.)"""
    if os.environ.get("LOSSVERIFY_TORCH_THREADS"):
        return max(1, int(os.environ["LOSSVERIFY_TORCH_THREADS"]))
    return 1


def _require_gpus(world):
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < world:
        raise UsageError(f"device=\"cuda\" with NCCL runs one rank per GPU: this layout has {world} ranks but {count} "
                         "GPU(s) are visible (backend=\"gloo\" lets ranks share a GPU)" if world > 1 else
                         "device=\"cuda\": no GPU is visible")


def _status_ok(status_dir, rank):
    try:
        with open(os.path.join(status_dir, f"rank{rank}.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("ok"))
    except (OSError, ValueError):
        return False


def _wait(processes, seconds, status_dir, ended):
    """Wait until every process exits, or one ends without its result (whatever its exit code: os._exit(0) in
    the loss function too); False when the time runs out first. `ended` gets when each one was seen to end."""
    deadline = time.monotonic() + seconds
    pending = {p.sentinel: (rank, p) for rank, p in enumerate(processes)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=remaining):
            rank, process = pending.pop(sentinel)
            ended[rank] = time.time()
            process.join()
            if process.exitcode != 0 or not _status_ok(status_dir, rank):
                time.sleep(_STOP_GRACE_SECONDS)  # the others record their own state, then they are stopped
                return True
    return True


def _where_ranks_are(processes, status_dir):
    """{rank: (waiting in a collective?, "file:line in function")} of the ranks still running, from the Python
    stack each dumps on SIGUSR1 (faulthandler, registered by the rank)."""
    alive = [(r, p) for r, p in enumerate(processes) if p.is_alive()]
    for _, p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(0.3)
    where = {}
    for rank, _ in alive:
        try:
            with open(os.path.join(status_dir, f"rank{rank}.stack"), encoding="utf-8", errors="replace") as f:
                frames = [line.strip() for line in f if line.strip().startswith("File ")]
        except OSError:
            frames = []
        if not frames:
            where[rank] = (False, "before its job began")
            continue
        innermost = frames[0]  # faulthandler writes the most recent call first
        in_collective = "torch/distributed" in innermost
        ours = [f for f in frames if "lossverify/torch/" not in f and "torch/" not in f]
        where[rank] = (in_collective, _frame_text(ours[0] if ours else innermost))
    return where


def _frame_text(line):
    """'File "a/b/x.py", line 12 in fn' -> 'x.py:12 in fn'."""
    try:
        path = line.split('"')[1]
        rest = line.split('"')[2].strip().lstrip(",").strip()  # 'line 12 in fn'
        number, _, function = rest.partition(" in ")
        return f"{os.path.basename(path)}:{number.replace('line ', '')} in {function}"
    except IndexError:
        return line


def _stop(processes):
    """Stop every rank still running at once (SIGTERM, 2 s in all, then SIGKILL) and everything each one started
    (its process group); returns the ranks that were stopped here, not ended on their own."""
    stopped = {r for r, p in enumerate(processes) if p.is_alive()}
    for r in stopped:
        processes[r].terminate()
    deadline = time.monotonic() + 2.0
    for r in stopped:
        processes[r].join(timeout=max(0.0, deadline - time.monotonic()))
    for r in stopped:
        if processes[r].is_alive():
            processes[r].kill()
            processes[r].join()
    for p in processes:  # children of the loss function (a rank leads its own process group)
        if p.pid is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    return stopped


def _read_statuses(status_dir, world):
    statuses = {}
    for rank in range(world):
        path = os.path.join(status_dir, f"rank{rank}.json")
        try:
            with open(path, encoding="utf-8") as f:
                statuses[rank] = json.load(f)
        except (OSError, ValueError):
            statuses[rank] = {}
    return statuses


def _raise_for_failures(processes, statuses, ended, stopped, timed_out, where, timeout, inputs):
    """The failure that came first: a rank that ended without a word (its death is never an echo of another's
    failure: those write their own status), else the first status error, else the timeout naming where each
    unfinished rank was."""
    layout = inputs.layout
    usage = [s for s in statuses.values() if s.get("kind") == "usage"]
    if usage:  # every rank looks the function up alike: the first one's words
        raise UsageError(min(usage, key=lambda s: s["rank"])["message"])
    silent = sorted((ended.get(r, float("inf")), r) for r, p in enumerate(processes)
                    if not statuses[r] and r not in stopped and p.exitcode is not None)
    if silent:
        rank = silent[0][1]
        code = processes[rank].exitcode
        others = [r for _, r in silent[1:]]
        raise UserFunctionError(rank, f"rank {rank} ended without a report ({_exit_text(code)}){_exit_hint(code)}",
                                coordinates=layout.coordinates(rank)._asdict(),
                                note=f"also ended without a report: ranks {others}" if others else "")
    user = [s for s in statuses.values() if s.get("kind") == "user"]
    if user:  # the checked code's first error: the later ones are usually its echo in a collective
        first = min(user, key=lambda s: (s["time"], s["rank"]))
        coordinates = layout.coordinates(first["rank"])._asdict()
        raise UserFunctionError(first["rank"], first["message"], coordinates=coordinates,
                                micro_batch=first.get("micro_batch"))
    harness = [s for s in statuses.values() if s.get("kind") == "harness"]
    if harness:
        first = min(harness, key=lambda s: (s["time"], s["rank"]))
        raise ToolError(f"rank {first['rank']} failed:\n{first['message']}")
    if timed_out:
        unfinished = [r for r in range(len(processes)) if not statuses[r].get("ok")]
        raise HarnessTimeout(f"rank(s) {unfinished} did not finish within {timeout:g} s" + _where_text(where) +
                             " (a collective that not every rank reached? raise the case's timeout_seconds or pass "
                             "timeout=)")
    dead = [(r, p.exitcode) for r, p in enumerate(processes) if p.exitcode != 0 or not statuses[r].get("ok")]
    if dead:
        described = ", ".join(f"rank {r} ({_exit_text(code)})" for r, code in dead)
        raise ToolError(f"rank process(es) ended without a result: {described}")


def _where_text(where):
    if not where:
        return ""
    hung = [f"rank {r} at {text}" for r, (waiting, text) in sorted(where.items()) if not waiting]
    waiting = [r for r, (in_collective, _) in sorted(where.items()) if in_collective]
    parts = []
    if hung:
        parts.append("; ".join(hung) + " (not in a collective)")
    if waiting:
        parts.append(f"rank(s) {waiting} waiting in a collective")
    return ": " + "; ".join(parts)


def _exit_hint(code):
    if code is None:
        return ""
    if code == -signal.SIGKILL:
        return ": SIGKILL, sent by the out-of-memory killer or from outside"
    if code == -signal.SIGSEGV:
        return ": SIGSEGV, a crash in native code"
    if code == -signal.SIGABRT:
        return ": SIGABRT, an abort (gloo and NCCL abort a rank on mismatched collectives)"
    if code >= 0:
        return ": the process exited while running (sys.exit or os._exit in the loss function?)"
    return ""


def _exit_text(code):
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"
