#!/usr/bin/env bash
# Peak resident memory of `lossverify run` as the TP degree grows (issue 20: memory that does not grow with
# tp^2). Prints one line per TP degree and each one's ratio to the first. Nothing asserts on the figures.
# usage: bash bench/memory_scaling.sh [BINARY] [CASE] [TP...]   (default: build/release/cli/lossverify,
#        cases/smoothing-pytorch.json, tp 8 100 1000)
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/release/cli/lossverify}
case_file=${2:-cases/smoothing-pytorch.json}
shift 2 2>/dev/null || shift $#
tps=("$@")
((${#tps[@]})) || tps=(8 100 1000)
first=""
for tp in "${tps[@]}"; do
  line=$(/usr/bin/time -f "%M %e" "$bin" run "$case_file" --tp "$tp" --quiet --threads 1 2>&1 >/dev/null | tail -1)
  rc=${PIPESTATUS[0]}
  read -r kb seconds <<<"$line"
  [[ -z $first ]] && first=$kb
  awk -v tp="$tp" -v kb="$kb" -v first="$first" -v base="${tps[0]}" -v s="$seconds" -v rc="$rc" 'BEGIN {
    printf "tp %5s  peak RSS %8.1f MB  (%5.2fx tp %s)  wall %6.2f s  exit %s\n", tp, kb / 1024, kb / first, base, s, rc }'
done
