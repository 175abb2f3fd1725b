#!/usr/bin/env python3
"""Replay parity: a run gives the same report after any other runs in the same process as alone in a fresh one.

    replay_parity.py BINARY OUTDIR [--backend cpu|cuda] [--gpus N] [--cells correct|all] [--jobs J]

1. One process: `BINARY gate --run-reports OUTDIR/one` runs every shipped case x implementation and every sweep
   layout in the gate's order, keeping every report.
2. Fresh processes: each replayed run again alone, `BINARY run CASE --impl IMPL` at the same layout (a sweep's
   layouts with the CPU reference, as the sweep judges them), J at a time.
3. Each pair of reports is normalised (timings, resources and the binary's identity removed, as
   scripts/report_parity.sh does) and compared; every difference is printed.

--cells correct (the default) replays the correct implementation's cells and every sweep layout; all replays every
cell. State a run leaves behind (device memory a freed buffer returns to the pool, NCCL endpoints, plugin hosts,
caches) shows here as a difference. With --backend cuda and fewer GPUs than --gpus, it skips (exit 77, saying so).

Exit codes: 0 identical, 1 a difference, 2 usage error, 3 a run that could not be made, 77 skipped.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from report_normalise import scrub  # noqa: E402  (scripts/report_parity.sh's rules)


def normalised_run(run):
    return json.dumps(scrub(run), sort_keys=True, indent=1)


def first_difference(a, b, path="run"):
    if type(a) is not type(b):
        return f"{path}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'the replay' if k in a else 'the fresh run'}"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} (in one process) vs {b!r} (alone)"


def visible_gpus(binary):
    """The GPUs the binary sees (its --version line), 0 for a build without CUDA."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"CUDA GPUs visible now: (\d+)", out)
    return int(found.group(1)) if found else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary")
    p.add_argument("outdir")
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--cells", choices=["correct", "all"], default="correct")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--cases", default="cases")
    p.add_argument("--golden", default="golden")
    a = p.parse_args()
    if a.backend == "cuda":
        seen = visible_gpus(a.binary)
        if seen < a.gpus:
            print(f"skipped: replay parity on CUDA needs {a.gpus} GPUs, {seen} visible (run it where they are)")
            return 77
    os.makedirs(a.outdir, exist_ok=True)
    one = os.path.join(a.outdir, "one")
    for own in (one, os.path.join(a.outdir, "alone")):  # this script's own folders, from an earlier pass
        shutil.rmtree(own, ignore_errors=True)
    device = ["--backend", a.backend] + (["--gpus", str(a.gpus)] if a.backend == "cuda" else [])
    gate = subprocess.run([a.binary, "gate", "--cases", a.cases, "--golden", a.golden, "--threads", "2", "-q",
                           "--run-reports", one] + device, capture_output=True, text=True)
    if gate.returncode not in (0, 1):
        print(f"replay_parity: the gate exited {gate.returncode}: {gate.stderr.strip()[:2000]}")
        return 3
    print(f"one process: gate {' '.join(device)} exited {gate.returncode} "
          f"({'every outcome matches golden' if gate.returncode == 0 else 'outcomes differ from golden'})")

    jobs = []  # (label, replayed run, command of the fresh run)
    for name in sorted(os.listdir(one)):
        case_name, what = name[:-len(".json")].split("__", 1)
        if what != "sweep" and a.cells == "correct" and what != "correct":
            continue
        case_file = os.path.join(a.cases, case_name + ".json")
        with open(os.path.join(one, name)) as f:
            report = json.load(f)
        for run in report["runs"]:
            impl = run["implementation"]["name"]
            cmd = [a.binary, "run", case_file, "--impl", impl, "--threads", "2", "--no-control", "-q"] + device
            label = f"{case_name} --impl {impl}"
            if what == "sweep":
                lay = run["layout"]
                layout = sum(([f"--{k}", str(lay[k])] for k in ("tp", "cp", "dp", "ga")), [])
                # sequence parallelism (a kind whose rows are whole) is in the run's case, not in its rank counts
                sp = run["case"]["layout"].get("sp", False)
                layout += ["--set", f"layout.sp={'true' if sp else 'false'}"]
                cmd += layout + (["--reference", "cpu"] if a.backend == "cuda" else [])
                label += " at " + " ".join(layout) + " (sweep)"
            jobs.append((label, run, cmd))

    fresh_dir = os.path.join(a.outdir, "alone")
    os.makedirs(fresh_dir, exist_ok=True)

    def fresh(k):
        label, run, cmd = jobs[k]
        path = os.path.join(fresh_dir, f"{k}.json")
        done = subprocess.run(cmd + ["--report", path], capture_output=True, text=True)
        if done.returncode not in (0, 1) or not os.path.exists(path):
            return label, f"the fresh run exited {done.returncode}: {done.stderr.strip()[:500]}"
        with open(path) as f:
            alone = json.load(f)["runs"][0]
        if normalised_run(run) == normalised_run(alone):
            return label, None
        return label, first_difference(scrub(run), scrub(alone)) or "the normalised reports differ"

    differences = 0
    errors = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for label, problem in pool.map(fresh, range(len(jobs))):
            if problem is None:
                continue
            if problem.startswith("the fresh run exited"):
                errors += 1
            else:
                differences += 1
            print(f"DIFFER {label}: {problem}")
    print(f"replay parity: {len(jobs)} runs replayed alone, {differences} differ, {errors} could not run")
    if errors:
        return 3
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
