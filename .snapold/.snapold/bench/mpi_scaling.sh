#!/usr/bin/env bash
# MPI scaling: the same case (N=8192, V=131072, bf16) over 1, 2, 4 and 8 processes (tp = P): peak memory
# per rank against the rank's shard, wall time, and the share of the slowest rank's time in collectives.
# Build first: bash scripts/build.sh. Oversubscribes when P exceeds the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
lv=build/release/cli/lossverify
case_file=bench/cases/mpi-bf16-n8192-v131072.json
report=$(mktemp --suffix=.json)
printf "%-9s %-14s %-22s %-12s %-10s %s\n" processes "shard (GiB)" "peak RSS/rank (GiB)" "RSS/shard" "wall (s)" "collectives share"
for p in ${PROCESSES:-1 2 4 8}; do
  mpiexec -n "$p" "$lv" run "$case_file" --tp "$p" --quiet --report "$report" || true
  python3 - "$report" "$p" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
p = int(sys.argv[2])
shape = run["case"]["shape"]
shard = shape["tokens"] * shape["vocab"] * 2 * 2 / p  # bf16 logits + bf16 gradients of one rank
rss = run["resources"]["peak_rss_bytes_per_rank"]
t = run["timings_seconds"]
share = t["collectives_max_rank"] / t["total"]
print(f"{p:<9} {shard / 2**30:<14.3f} {max(rss) / 2**30:<22.3f} {max(rss) / shard:<12.2f} {t['total']:<10.1f} "
      f"{100 * share:.1f}% (verdict {run['verdict']})")
PY
done
rm -f "$report"
