#!/usr/bin/env python3
"""The verdict comparison of docs/cuda.md: the same (case, implementation) pairs at a layout on every path that
can run them here, and whether every path gives the CPU's verdict and failing checks.

    python3 bench/verdict_matrix.py --binary build/dev/cli/lossverify --layout tp4 --layout tp2-dp2 --out DIR

Paths (columns), each skipped with a reason where this machine cannot run it:
  cpu          lossverify run, thread ranks on the CPU
  gpu1         --backend cuda on one GPU (the ranks share it; host collectives)
  nccl         --backend cuda --gpus R: one GPU per rank, NCCL between them
  mpi+nccl     mpiexec -n R lossverify run --backend cuda: one process and one GPU per rank
  py-gloo      python3 -m lossverify.torch run (forked ranks, gloo on the CPU)
  py-nccl      the same with --device cuda (NCCL, one GPU per rank)
  torchrun     torchrun --nproc-per-node R -m lossverify.torch run --device cuda (NCCL; gloo without GPUs)
Prints one line per (pair, layout) and exits 1 when some path disagrees with the CPU.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

PAIRS = [("smoothing-pytorch", "correct"), ("smoothing-pytorch", "smoothing-partition-vocab"),
         ("kd-tp4-temperature2", "kd-no-t2"), ("dp-unequal-tokens", "dp-local-mean"),
         ("full-4d-layout", "correct")]
PATHS = ["cpu", "gpu1", "nccl", "mpi+nccl", "py-gloo", "py-nccl", "torchrun"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Debian's torch 1.13 on Python 3.11 cannot parse torchrun's default --redirects/--tee (see
# python/tests/test_torchrun.py); torch >= 2 needs nothing.
TORCHRUN_WORKAROUND = []


def parse_layout(text):
    counts = {"tp": 1, "cp": 1, "dp": 1, "ga": 1}
    for part in text.split("-"):
        counts[part.rstrip("0123456789")] = int(part[len(part.rstrip("0123456789")):])
    return counts


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def failing(report_path):
    with open(report_path, encoding="utf-8") as f:
        report = json.load(f)
    run = report["runs"][0]
    return run["verdict"], sorted(c["name"] for c in run["checks"] if c["verdict"] == "fail")


def command_for(path, case, impl, layout, binary, report, gpus):
    counts = ["--tp", str(layout["tp"]), "--cp", str(layout["cp"]), "--dp", str(layout["dp"]), "--ga",
              str(layout["ga"])]
    ranks = layout["tp"] * layout["cp"] * layout["dp"]
    case_file = os.path.join(REPO, "cases", case + ".json")
    lv = [binary, "run", case_file, "--impl", impl, *counts, "--quiet", "--report", report]
    fn = "lossverify.torch.implementations:" + impl.replace("-", "_")
    py = [sys.executable, "-m", "lossverify.torch", "run", "--fn", fn, case_file, *counts, "--quiet", "--report",
          report]
    return {
        "cpu": lv,
        "gpu1": lv + ["--backend", "cuda"],
        "nccl": lv + ["--backend", "cuda", "--gpus", str(ranks)],
        "mpi+nccl": ["mpiexec", "-n", str(ranks)] + lv + ["--backend", "cuda"],
        "py-gloo": py,
        "py-nccl": py + ["--device", "cuda"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                     *TORCHRUN_WORKAROUND, "-m", "lossverify.torch", "run", "--fn", fn, case_file, *counts,
                     "--report", report, "--quiet"] + (["--device", "cuda"] if gpus >= ranks else []),
    }[path]


def unavailable(path, ranks, gpus):
    if path in ("gpu1",) and gpus < 1:
        return "no GPU"
    if path in ("nccl", "mpi+nccl", "py-nccl") and gpus < ranks:
        return f"{gpus} GPU(s) for {ranks} ranks"
    if path == "mpi+nccl" and shutil.which("mpiexec") is None:
        return "no mpiexec"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", required=True)
    parser.add_argument("--layout", action="append", required=True, help="e.g. tp4, tp2-dp2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--paths", default=",".join(PATHS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, LOSSVERIFY_BIN=os.path.abspath(args.binary),
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python")] + [os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    gpus = gpu_count()
    paths = args.paths.split(",")
    version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=False).stdout.strip()
    if version.startswith("1."):
        TORCHRUN_WORKAROUND.extend(["--redirects", "2", "--tee", "1", "--log_dir", os.path.join(args.out, "torchrun")])
    disagreements = 0
    print(f"{'case':22s} {'implementation':26s} {'layout':8s} " + " ".join(f"{p:>10s}" for p in paths))
    for layout_text in args.layout:
        layout = parse_layout(layout_text)
        ranks = layout["tp"] * layout["cp"] * layout["dp"]
        for case, impl in PAIRS:
            cells, reference = [], None
            for path in paths:
                why = unavailable(path, ranks, gpus)
                if why:
                    cells.append("-")
                    continue
                report = os.path.join(args.out, f"{case}.{impl}.{layout_text}.{path}.json")
                start = time.monotonic()
                result = subprocess.run(command_for(path, case, impl, layout, args.binary, report, gpus), env=env,
                                        capture_output=True, text=True, check=False, cwd=REPO)
                seconds = time.monotonic() - start
                if not os.path.exists(report):
                    cells.append(f"exit{result.returncode}")
                    print(f"  {path}: no report (exit {result.returncode}): {result.stderr.strip()[-400:]}")
                    disagreements += 1
                    continue
                outcome = failing(report)
                if reference is None:
                    reference = outcome
                same = outcome == reference
                disagreements += 0 if same else 1
                cells.append(f"{outcome[0]}{'' if same else '!'}:{seconds:.0f}s")
            print(f"{case:22s} {impl:26s} {layout_text:8s} " + " ".join(f"{c:>10s}" for c in cells)
                  + f"   failing {reference[1] if reference else '-'}", flush=True)
    print(f"{disagreements} disagreement(s) with the first path's verdict and failing checks")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
