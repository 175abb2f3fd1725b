#!/usr/bin/env bash
# The seams of src/lossverify, checked on its #include lines (docs/architecture.md):
#   checks/  judges outputs through the Oracle interface: it includes no backend (impl/), no oracle, no
#            CUDA plumbing (cuda/), no runner and no CUDA or NCCL header;
#   oracle/  owns its inputs: it includes nothing of the backends (impl/);
#   impl/    computes a rank's outputs: it includes no oracle, no checks and no reference (except the kernel
#            benchmarks, which check their sampled rows against the reference).
# usage: scripts/check_layering.sh [SRC_DIR]   (default: src/lossverify); exit 1 on a violation.
set -u
src="${1:-$(cd "$(dirname "$0")/.." && pwd)/src/lossverify}"
[ -d "$src" ] || { echo "check_layering: no such directory: $src" >&2; exit 2; }
status=0
forbid() {  # DIR PATTERN WHY [EXCEPT_FILE]
  local dir="$1" pattern="$2" why="$3" except="${4:-}"  # EXCEPT_FILE: an extended regex of files
  [ -d "$src/$dir" ] || return 0
  local hits
  hits=$(grep -rnE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[<\"]($pattern)" "$src/$dir" \
           --include='*.hpp' --include='*.cpp' --include='*.cu' --include='*.cuh' --include='*.h' |
         { if [ -n "$except" ]; then grep -vE "^$src/($except):"; else cat; fi; })
  if [ -n "$hits" ]; then
    echo "check_layering: $dir/ $why:"
    echo "$hits" | sed "s#^$src/#  #"
    status=1
  fi
}
forbid checks 'lossverify/(impl|oracle|cuda|runner)/|cuda|nccl' "must not include backends, oracles, CUDA or the runner"
forbid oracle 'lossverify/impl/' "must not include the backends"
forbid impl 'lossverify/(oracle|checks|reference)/' "must not include oracles, checks or the reference" \
  'impl/cuda/cuda_bench.cpp|impl/cuda/multi_gpu_bench.cpp'
[ "$status" -eq 0 ] && echo "check_layering: the seams hold"
exit "$status"
