#!/usr/bin/env bash
# The seams of src/lossverify, checked on its #include lines (docs/development.md, "The seams"):
#   checks/  judges outputs through the Oracle interface: it includes no backend (impl/), no oracle, no
#            CUDA plumbing (cuda/), no runner and no CUDA or NCCL header;
#   oracle/  owns its inputs: it includes nothing of the backends (impl/);
#   impl/    computes a rank's outputs: it includes no oracle, no checks and no reference (except
#            bench_check.hpp, with which the kinds' kernel benchmarks check sampled rows against the reference);
#   kinds/   above every other folder, reached through kind_api/ (which includes only plain types); a loss
#            kind's module holds both sides, kept apart by file: its reference (*_reference.cpp)
#            includes no backend and none of its kind's kernel math or protocol, and its implementation
#            (*_math.hpp, *_protocol.*, *_cpu.cpp, *_cuda.cpp) includes no reference, oracle or checks.
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
# The kinds sit above everything else and are reached through kind_api/: no other folder includes kinds/.
for dir in $(cd "$src" && ls -d */ | tr -d / | grep -vx kinds); do
  forbid "$dir" 'lossverify/kinds/' "must not include a kind (reach it through kind_api/)"
done
forbid kind_api 'lossverify/(case|inputs|impl|oracle|checks|runner|dump|repro|report|outputs|comm)/' \
  "is the seam below the kinds: it includes only plain types (core, layout, reference, cuda storage)"
forbid oracle 'lossverify/impl/' "must not include the backends"
forbid impl 'lossverify/(oracle|checks|reference)/' "must not include oracles, checks or the reference" \
  'impl/cuda/bench_check.hpp'
forbid_in_files() {  # FILE_REGEX PATTERN WHY: FILE_REGEX (extended, relative to src) selects the files
  local files="$1" pattern="$2" why="$3" hits
  hits=$(grep -rnE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[<\"]($pattern)" "$src/kinds" \
           --include='*.hpp' --include='*.cpp' --include='*.cu' 2>/dev/null | grep -E "^$src/($files):")
  if [ -n "$hits" ]; then
    echo "check_layering: $why:"
    echo "$hits" | sed "s#^$src/#  #"
    status=1
  fi
}
forbid_in_files 'kinds/.*_reference\.cpp' 'lossverify/impl/|lossverify/kinds/.*_(math|protocol)\.hpp' \
  "a kind's reference must not include backends or its kernel math"
forbid_in_files 'kinds/.*(_math\.hpp|_protocol\.(hpp|cpp)|_cpu\.cpp|_cuda\.cpp)' \
  'lossverify/(reference|oracle|checks)/' "a kind's implementation must not include the reference, oracles or checks"
[ "$status" -eq 0 ] && echo "check_layering: the seams hold"
exit "$status"
