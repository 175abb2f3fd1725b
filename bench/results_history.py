#!/usr/bin/env python3
"""One CSV row per benchmark result file (`lossverify bench --report` or an end-to-end `run --report`).

usage: python3 bench/results_history.py FILE... >> bench/results/history.csv
bench/results/ keeps the latest file of each benchmark; history.csv keeps every run's figures. A row holds the
file it came from, the benchmark (bench-tp1, bench-tp8, e2e or the experiment's name), the shape, the dtype,
the TP degree and the figures: for a kernel benchmark its time, the memory floor and the fraction of it (for
`bench --gpus N`, TP = N, the slowest GPU's shard kernels, and the whole step's time in e2e_ms);
for an end-to-end run the rank compute and the reference and checks, their sum, and that over the 2.80 ms
floor of the TP=1 shape (as bench/device_run.sh prints it).
"""
import csv
import json
import os
import re
import sys

FIELDS = ["file", "benchmark", "shape", "dtype", "tp", "kernel_ms", "floor_ms", "percent_of_floor",
          "compute_ms", "reference_and_checks_ms", "e2e_ms", "e2e_over_floor", "verdict"]
E2E_FLOOR_MS = 2.80


def benchmark_of(name):
    stem = re.sub(r"^h[12]00(x\d)?-(v\d+-)?", "", os.path.splitext(name)[0])
    stem = re.sub(r"-\d+$", "", stem)
    # early names: "bench" was the TP=1 kernel benchmark, "e2e-gpu-reference-v4" an end-to-end run
    return {"bench": "bench-tp1", "e2e-gpu-reference-v4": "e2e"}.get(stem, stem)


def row(path):
    d = json.load(open(path))
    name = os.path.basename(path)
    r = {"file": name, "benchmark": benchmark_of(name)}
    if "runs" in d:  # an end-to-end report
        run = d["runs"][0]
        t = run["timings_seconds"]
        e2e = 1e3 * (t["compute_max_rank"] + t["reference_and_checks"])
        shape = run["case"]["shape"]
        r.update(shape=f"{shape['tokens']}x{shape['vocab']}", dtype=run["case"]["inputs"]["dtype"],
                 tp=run["layout"]["tp"], compute_ms=f"{1e3 * t['compute_max_rank']:.2f}",
                 reference_and_checks_ms=f"{1e3 * t['reference_and_checks']:.2f}", e2e_ms=f"{e2e:.2f}",
                 e2e_over_floor=f"{e2e / E2E_FLOOR_MS:.2f}", verdict=run["verdict"])
    elif "gpus" in d:  # lossverify bench --gpus N: the shard kernels of the slowest GPU; the step's time as e2e
        k = d["kernels"]
        r.update(shape=f"{d['shape']['tokens']}x{d['shape']['vocab']}", dtype=d["dtype"], tp=d["gpus"],
                 kernel_ms=f"{k['ms']:.3f}", floor_ms=f"{k['floor_ms']:.3f}",
                 percent_of_floor=f"{k['percent_of_floor']:.1f}", e2e_ms=f"{d['step']['ms']:.3f}",
                 verdict="pass" if d["check"]["pass"] else "fail")
    else:  # lossverify bench
        shape = d["shape"]
        if isinstance(shape, dict):
            shape = f"{shape['tokens']}x{d.get('global_vocab', shape.get('vocab_per_rank'))}"
        r.update(shape=shape,
                 dtype=d["dtype"], tp=d.get("tp", 1), kernel_ms=f"{d['kernel_ms']:.3f}",
                 floor_ms=f"{d['floor_ms']:.3f}", percent_of_floor=f"{d['percent_of_floor']:.1f}",
                 verdict="pass" if d["check"]["pass"] else "fail")
    return r


def main(paths):
    out = csv.DictWriter(sys.stdout, FIELDS, lineterminator="\n")
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for p in paths:
        out.writerow(row(p))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
