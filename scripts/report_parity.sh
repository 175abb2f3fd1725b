#!/usr/bin/env bash
# Report parity: prove that a refactor leaves every lossverify report identical (timings aside).
#
#   scripts/report_parity.sh BINARY OUTDIR
#       Runs BINARY on every case file cases/*.json (at the case's own layout; no --tp, no --sweep)
#       x every built-in implementation of `BINARY list --json`:
#           BINARY run CASE --impl IMPL --report OUTDIR/CASE__IMPL.json --quiet --threads N
#       on the CPU (default backend, thread launcher), at most 2 runs at a time. Every run leaves
#       OUTDIR/CASE__IMPL.exit ("exit=RC", plus "stderr=FIRST LINE" when the run wrote to stderr,
#       e.g. exit 2 for an implementation that does not apply to the case; then no report exists).
#       Each report is then normalised in place (fields that vary from run to run are removed,
#       see scripts/report_normalise.py), and the script prints the number of runs, the wall time and a
#       sha256 over every normalised .json and .exit file in sorted (C locale) order, each file
#       preceded by a "== NAME" line.
#       OUTDIR is created; it must be empty if it exists.
#
#   scripts/report_parity.sh --compare DIR_A DIR_B
#       Exit 0 when both folders hold the same files with identical contents; else exit 1 and
#       print the files only in one folder, and for every differing file its first differing lines.
#
# Environment:
#   PARITY_CASES_DIR   case folder (default: cases/ of this repository)
#   PARITY_THREADS     --threads for every run (default 1: 2 parallel jobs on a 2-core machine, and
#                      a fixed thread count so the reference's summation order never changes)
#   PARITY_JOBS        parallel runs (default 2)
#   PARITY_RUN_ARGS    more arguments for every run, split on spaces (e.g. "--backend cuda")
#   PARITY_IMPLS       only these implementations, space-separated (default: every built-in one)
#
# Exit codes: 0 done (the pass ran; individual runs' outcomes are in the .exit files) /
#             --compare: identical; 1 --compare: different; 2 usage error; 3 a run could not be
#             recorded (e.g. exit 0/1 without a report, or a report that is not JSON).
set -euo pipefail
export LC_ALL=C

script_path=$(readlink -f -- "${BASH_SOURCE[0]}")
repo_root=$(cd -- "$(dirname -- "$script_path")/.." && pwd)

usage() {
    sed -n '2,29p' "$script_path" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------
# normalise FILE...: rewrite each report in place without the fields that legitimately vary.
# Numbers keep their exact text (no float re-formatting), key order and 2-space indentation are
# fixed, so two normalised reports are byte-identical exactly when their kept contents are.
normalise() {
    python3 "$repo_root/scripts/report_normalise.py" "$@"
}

# ---------------------------------------------------------------------------------------------
# --run-one BINARY OUTDIR CASE_FILE IMPL: one run (called by xargs).
run_one() {
    local bin=$1 outdir=$2 case_file=$3 impl=$4
    local case_name; case_name=$(basename -- "$case_file" .json)
    local stem="$outdir/${case_name}__${impl}"
    local errf; errf=$(mktemp "${TMPDIR:-/tmp}/parity-stderr.XXXXXX")
    local rc=0
    "$bin" run "$case_file" --impl "$impl" --report "$stem.json" --quiet \
        --threads "${PARITY_THREADS:-1}" ${PARITY_RUN_ARGS:-} </dev/null >/dev/null 2>"$errf" || rc=$?
    local first=""
    if [[ -s $errf ]]; then
        first=$(head -n 1 -- "$errf")
        # paths that differ between passes, never part of the tool's answer
        first=${first//"$outdir"/<OUTDIR>}
        first=${first//"$bin"/<BINARY>}
    fi
    rm -f -- "$errf"
    {
        printf 'exit=%s\n' "$rc"
        if [[ -n $first ]]; then printf 'stderr=%s\n' "$first"; fi
    } >"$stem.exit"
    if [[ -e $stem.json ]]; then
        normalise "$stem.json" || { echo "report_parity: cannot normalise $stem.json" >&2; return 255; }
    elif [[ $rc == 0 || $rc == 1 ]]; then
        echo "report_parity: ${case_name}__${impl}: exit $rc but no report" >&2
        return 255   # stops xargs: the pass would be incomplete
    fi
    return 0
}

# ---------------------------------------------------------------------------------------------
compare() {
    local a=$1 b=$2
    [[ -d $a && -d $b ]] || { echo "report_parity: --compare needs two folders" >&2; exit 2; }
    local differ=0 f
    local la lb
    la=$(cd -- "$a" && find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.exit' \) | sed 's|^\./||' | sort)
    lb=$(cd -- "$b" && find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.exit' \) | sed 's|^\./||' | sort)
    while IFS= read -r f; do
        [[ -n $f ]] || continue
        echo "only in $a: $f"; differ=1
    done < <(comm -23 <(printf '%s\n' "$la") <(printf '%s\n' "$lb"))
    while IFS= read -r f; do
        [[ -n $f ]] || continue
        echo "only in $b: $f"; differ=1
    done < <(comm -13 <(printf '%s\n' "$la") <(printf '%s\n' "$lb"))
    local ndiff=0 nsame=0
    while IFS= read -r f; do
        [[ -n $f ]] || continue
        if cmp -s -- "$a/$f" "$b/$f"; then
            nsame=$((nsame + 1))
        else
            differ=1; ndiff=$((ndiff + 1))
            echo "differs: $f"
            diff -U 2 -- "$a/$f" "$b/$f" | sed -n '3,20p' | sed 's/^/    /' || true
        fi
    done < <(comm -12 <(printf '%s\n' "$la") <(printf '%s\n' "$lb"))
    if ((differ)); then
        echo "report_parity: DIFFERENT ($ndiff differing files, $nsame identical)"
        exit 1
    fi
    echo "report_parity: identical ($nsame files)"
    exit 0
}

digest() {
    local dir=$1 f
    (cd -- "$dir" && find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.exit' \) | sed 's|^\./||' | sort |
        while IFS= read -r f; do printf '== %s\n' "$f"; cat -- "$f"; done) | sha256sum | cut -d' ' -f1
}

# ---------------------------------------------------------------------------------------------
case ${1-} in
    --run-one) shift; [[ $# == 4 ]] || usage; run_one "$@"; exit ;;
    --compare) shift; [[ $# == 2 ]] || usage; compare "$1" "$2" ;;
    -h|--help|"") usage ;;
    -*) echo "report_parity: unknown option $1" >&2; usage ;;
esac
[[ $# == 2 ]] || usage

bin=$(readlink -f -- "$1") || true
[[ -n $bin && -f $bin && -x $bin ]] || { echo "report_parity: $1 is not an executable" >&2; exit 2; }
mkdir -p -- "$2"
outdir=$(readlink -f -- "$2")
if [[ -n $(ls -A -- "$outdir") ]]; then
    echo "report_parity: $outdir is not empty (remove it, or name a new folder)" >&2; exit 2
fi
cases_dir=${PARITY_CASES_DIR:-$repo_root/cases}
command -v python3 >/dev/null || { echo "report_parity: python3 is needed" >&2; exit 2; }

# Case files as given to the binary: relative to the repository root when they lie under it,
# so the report's case_file does not depend on where the script is started.
cd -- "$repo_root"
mapfile -t case_files < <(find "$cases_dir" -maxdepth 1 -type f -name '*.json' | sort)
((${#case_files[@]})) || { echo "report_parity: no case files in $cases_dir" >&2; exit 2; }
for i in "${!case_files[@]}"; do
    p=$(readlink -f -- "${case_files[$i]}")
    [[ $p == "$repo_root"/* ]] && p=${p#"$repo_root"/}
    case_files[$i]=$p
done

# Built-in implementations: every name `list --json` gives, minus plugin specs (they need a .so).
mapfile -t impls < <("$bin" list --json | python3 -c '
import json, sys
for i in json.load(sys.stdin)["implementations"]:
    n = i["name"]
    if n.startswith("plugin:") or "/" in n or i.get("plugin") or i.get("requires"):
        continue
    print(n)
')
((${#impls[@]})) || { echo "report_parity: $bin list --json lists no implementations" >&2; exit 2; }
if [[ -n ${PARITY_IMPLS:-} ]]; then
    read -r -a impls <<<"$PARITY_IMPLS"
fi

jobs=${PARITY_JOBS:-2}
echo "report_parity: ${#case_files[@]} cases x ${#impls[@]} implementations, $jobs at a time, --threads ${PARITY_THREADS:-1}" >&2
start=$(date +%s.%N)
set +e
for c in "${case_files[@]}"; do
    for m in "${impls[@]}"; do
        printf '%s\0%s\0%s\0%s\0' "$bin" "$outdir" "$c" "$m"
    done
done | xargs -0 -n 4 -P "$jobs" "$script_path" --run-one
xrc=$?
set -e
end=$(date +%s.%N)
if ((xrc != 0)); then
    echo "report_parity: some runs could not be recorded (xargs exit $xrc)" >&2
    exit 3
fi

runs=$(find "$outdir" -maxdepth 1 -type f -name '*.exit' | wc -l)
reports=$(find "$outdir" -maxdepth 1 -type f -name '*.json' | wc -l)
expected=$((${#case_files[@]} * ${#impls[@]}))
((runs == expected)) || { echo "report_parity: $runs .exit files, expected $expected" >&2; exit 3; }
summary=$(cat -- "$outdir"/*.exit | grep '^exit=' | sort | uniq -c | awk '{printf "%s%s x%s", sep, $2, $1; sep=", "}')
printf 'runs: %d (%d reports; %s)\n' "$runs" "$reports" "$summary"
printf 'wall: %s s\n' "$(python3 -c "print(f'{$end - $start:.1f}')")"
printf 'sha256: %s\n' "$(digest "$outdir")"
