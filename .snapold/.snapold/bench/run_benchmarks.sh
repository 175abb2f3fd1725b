#!/usr/bin/env bash
# Benchmarks of the walking skeleton (figures, not pass/fail). Build first: bash scripts/build.sh
#  1. reference and generator throughput (float64 logits per second, 1 thread and all threads)
#  2. end to end `run` at N=4096, V=131072, tp=8, fp32: wall time, stage split, peak RSS vs inputs+gradients
#  3. the whole gate: wall time and peak memory
#  4. 512 thread ranks (tp=8, cp=4, dp=16, ga=2) on a small case: where the time goes
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/release
"$bin"/bench/bench_reference 256 131072
report=$(mktemp --suffix=.json)
"$bin"/cli/lossverify run bench/cases/large-fp32-n4096-v131072-tp8.json --report "$report"
python3 - "$report" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
t, shape = run["timings_seconds"], run["case"]["shape"]
data = shape["tokens"] * shape["vocab"] * 4 * 2  # fp32 logits + fp32 gradients
rss = run["resources"]["peak_rss_bytes"]
logits = shape["tokens"] * shape["vocab"]
print(f"end to end: {t['total']:.1f} s  (ranks {t['ranks_wall']:.1f} s: generate {t['generate_max_rank']:.1f}, "
      f"compute {t['compute_max_rank']:.1f}, collectives {t['collectives_max_rank']:.2f}; "
      f"reference+checks {t['reference_and_checks']:.1f} s = {logits / t['reference_and_checks']:.3e} logits/s)")
print(f"peak RSS {rss / 2**30:.3f} GiB vs inputs+gradients {data / 2**30:.3f} GiB: ratio {rss / data:.3f} (target < 1.5)")
PY
"$bin"/cli/lossverify gate --report "$report" --quiet || true
python3 - "$report" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))["gate"]
runs = sum(1 for c in g["cells"] if c["verdict"] != "not_applicable")
layouts = sum(len(s["layouts"]) for s in g["sweeps"])
print(f"gate: {len(g['cases'])} cases x {len(g['implementations'])} implementations = {runs} runs + {layouts} sweep "
      f"layouts in {g['wall_seconds']:.1f} s (goal 60 s), peak RSS {g['peak_rss_bytes'] / 2**30:.2f} GiB; "
      f"mutation score {g['bugs_caught']}/{g['bugs_run']}, false alarms {g['false_alarms']}")
PY
"$bin"/cli/lossverify run bench/cases/r512-tp8-cp4-dp16.json --report "$report" --quiet
python3 - "$report" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
t = run["timings_seconds"]
print(f"{run['layout']['ranks']} thread ranks: total {t['total']:.2f} s; ranks {t['ranks_wall']:.2f} s "
      f"(slowest rank: collectives and splits {t['collectives_max_rank']:.3f} s, compute {t['compute_max_rank']:.4f} s, "
      f"generation {t['generate_max_rank']:.4f} s); reference + checks {t['reference_and_checks']:.2f} s")
PY
rm -f "$report"
