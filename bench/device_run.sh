#!/usr/bin/env bash
# One call on a lent GPU machine: probe, build (Release, sm_90), the CUDA tests, multi-GPU runs whose
# verdicts are compared with the CPU, fault runs, and the benchmarks. Usage: bash bench/device_run.sh [all|PART,PART...]
# Header-only dependencies may come from a folder given as DEPS_INCLUDE (the device has no Debian packages).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
# A comma-separated list of parts: build (always), cudatests, gate (the gate on the GPU and the CUDA CTests),
# parity (every case x implementation on CUDA, reports of the tree in out/before vs this one), tests, faults,
# sweep, bench, ncu (the reference kernels under Nsight Compute), e2e (stage times of
# the end-to-end run, and an Nsight Systems summary where nsys exists), gates (the gate on 1, 2 and 4 GPUs, per
# kind, and replay parity; fails the script on any mismatch), reverted (REVERT_PATCH taken out: the regression tests),
# benchgpus (bench --gpus 2 and 4), verdicts (bench/verdict_matrix.py: CPU, one GPU, NCCL, MPI + NCCL, the
# Python package over gloo and NCCL, torchrun), launch (python3 -m lossverify.torch run timed, the package of
# PYTHON_BEFORE beside this one), torchrun (4 processes over NCCL, and two launches of 2 as two machines);
# all = tests,faults,bench.
[[ $mode == all ]] && mode=tests,faults,bench
has() { [[ ",$mode," == *",$1,"* ]]; }
build=${BUILD_DIR:-build/dev}
# FRESH_BUILD=1: build from scratch. A warm machine keeps the build folder between calls, and sources
# unpacked by `git archive` carry the commit's time, so an older snapshot would not be rebuilt.
[[ ${FRESH_BUILD:-0} == 1 ]] && rm -rf "$build"
out=${OUT:-/tmp/lossverify-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
nccl_root=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null || true)
echo "== probe"; nvidia-smi -L; ldd --version | head -1; which mpiexec mpicc 2>&1 | head -2
ls /usr/local/cuda/include/nccl.h 2>/dev/null; echo "pip NCCL: ${nccl_root:-none}"
extra=()
[[ -n "${DEPS_INCLUDE:-}" ]] && extra+=("-DLOSSVERIFY_DEPS_INCLUDE_DIR=$DEPS_INCLUDE")
[[ ! -f /usr/local/cuda/include/nccl.h && -n "$nccl_root" ]] && extra+=("-DLOSSVERIFY_NCCL_ROOT=$nccl_root")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
grep "lossverify:" "$out/configure.log"
# REVERT_PATCH=FILE with the part "reverted": the tree with that patch reversed (a fix taken out) is built beside
# this one, in the background from here; its CUDA tests and replay parity must fail, where the regression tests
# were written to catch it.
if has reverted; then
  reverted=/tmp/lossverify-reverted
  rm -rf "$reverted"; mkdir -p "$reverted"
  tar --exclude=./build --exclude=./out -cf - . | tar -xf - -C "$reverted"
  patch -d "$reverted" -R -p1 < "${REVERT_PATCH:?REVERT_PATCH names the fix to take out}" | tail -3
  { cmake -S "$reverted" -B "$reverted/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" &&
      cmake --build "$reverted/build" -j"$(nproc)" --target lossverify lossverify_cuda_tests; } \
    > "$out/build-reverted.log" 2>&1 &
  reverted_build=$!
fi
# BUILD_TARGETS="lossverify lossverify_cuda_tests" builds only those (a shorter first call on a bare machine).
echo "build started $(date +%T)"
cmake --build "$build" -j"$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS} > "$out/build.log" 2>&1 ||
  { grep -B2 -A8 "error" "$out/build.log" | head -60; exit 1; }
echo "build done $(date +%T)"
[[ -n "$nccl_root" ]] && export LD_LIBRARY_PATH="$nccl_root/lib:${LD_LIBRARY_PATH:-}"
bin=$build/cli/lossverify
"$bin" --version
mpi=$(grep -q "MPI backend ON" "$out/configure.log" && command -v mpiexec || true)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if has cudatests || has tests; then
  echo "== CUDA tests $(date +%T)"; timeout 300 "$build"/tests/lossverify_cuda_tests -d 2>&1 | grep -v "^$" | tail -40
fi
if has tests; then
  echo "== multi-GPU CLI runs vs CPU"
  gpus=$(nvidia-smi -L | wc -l)
  for spec in "smoothing-pytorch:correct" "smoothing-pytorch:smoothing-partition-vocab" "kd-tp4-temperature2:kd-no-t2" \
              "uneven-shards-v507-tp4:correct" "dp-unequal-tokens:dp-local-mean"; do
    c=${spec%%:*}; impl=${spec##*:}
    set_args=(--set layout.tp=$gpus --set layout.cp=1 --set layout.dp=1 --set layout.ga=1)
    [[ $c == dp-* ]] && set_args=(--set layout.tp=1 --set layout.cp=1 --set layout.dp=$gpus --set layout.ga=1)
    "$bin" run cases/$c.json --impl $impl "${set_args[@]}" --quiet --report "$out/cpu-$c-$impl.json"; cpu=$?
    "$bin" run cases/$c.json --impl $impl "${set_args[@]}" --backend cuda --gpus $gpus --quiet --report "$out/gpu-$c-$impl.json"; gpu=$?
    python3 - "$out/cpu-$c-$impl.json" "$out/gpu-$c-$impl.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["runs"][0] for p in sys.argv[1:3])
fa = sorted(c["name"] for c in a["checks"] if c["verdict"] == "fail")
fb = sorted(c["name"] for c in b["checks"] if c["verdict"] == "fail")
print(f"  {a['case']['name']:26s} {a['implementation']['name']:28s} cpu {a['verdict']:4s} {fa}  gpu {b['verdict']:4s} {fb} "
      f"{b['execution']}  {'MATCH' if fa == fb else 'DIFFER'}")
PY
    echo "    exit codes cpu $cpu gpu $gpu"
    if [[ -n "$mpi" ]]; then
      mpiexec -n $gpus "$bin" run cases/$c.json --impl $impl "${set_args[@]}" --backend cuda --quiet --report "$out/mpi-$c-$impl.json"; m=$?
      python3 - "$out/cpu-$c-$impl.json" "$out/mpi-$c-$impl.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ra, rb = a["runs"][0], b["runs"][0]
fa = sorted(c["name"] for c in ra["checks"] if c["verdict"] == "fail")
fb = sorted(c["name"] for c in rb["checks"] if c["verdict"] == "fail")
print(f"  mpi+cuda ({b['environment']['processes']} processes) {rb['verdict']:4s} {fb} {rb['execution']}  {'MATCH' if fa == fb else 'DIFFER'}")
PY
      echo "    exit code mpi+cuda $m"
    fi
  done
fi
if has faults; then
  echo "== a failing rank while the others wait inside NCCL (one GPU per rank) $(date +%T)"
  gpus=$(nvidia-smi -L | wc -l)
  start=$(date +%s.%N)
  "$bin" run cases/smoothing-pytorch.json --set layout.tp=$gpus --backend cuda --gpus $gpus --inject-fault late-throw@1 --quiet
  echo "  late-throw@1: exit $? after $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
  start=$(date +%s.%N)
  timeout 120 "$bin" run cases/smoothing-pytorch.json --set layout.tp=$gpus --backend cuda --gpus $gpus --inject-fault late-hang@1 --timeout 5 --quiet
  echo "  late-hang@1 (deadline 5 s): exit $? after $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
fi
if has sweep; then
  echo "== TP=1 fused kernel: launch variants (PyTorch left out)"
  for v in off 256x4 256x3 512x2 1024x1; do
    echo "-- LOSSVERIFY_FUSED_RESIDENT=$v"
    LOSSVERIFY_FUSED_RESIDENT=$v "$bin" bench --repeats 20 --torch-script /nonexistent 2>&1 | grep -E "^lossverify|^floor"
  done
fi
summarize_e2e() {
  python3 - "$@" <<'PY'
import json, sys
for p in sys.argv[1:]:
    r = json.load(open(p))["runs"][0]
    t = r["timings_seconds"]
    g = next(c for c in r["checks"] if c["name"] == "grad")["metrics"]
    e2e = t["compute_max_rank"] + t["reference_and_checks"]
    print(f"  {p.split('/')[-1]}: verdict {r['verdict']}, {r['execution']}, generate {t['generate_max_rank']*1e3:.1f} ms, "
          f"compute {t['compute_max_rank']*1e3:.1f} ms, reference+checks {t['reference_and_checks']*1e3:.1f} ms, "
          f"total {t['total']*1e3:.1f} ms; kernel+reference+checks {e2e*1e3:.1f} ms = {e2e/2.80e-3:.2f} x the 2.80 ms floor; "
          f"judged by lookup {g.get('judged_by_lookup', 0)} of {g['compared']}")
PY
}
if has e2e; then
  echo "== end to end, stage times (LOSSVERIFY_TRACE=1): code tables (512 and 256 threads), then off"
  e2e=bench/cases/cuda-e2e-n16384-v128256-bf16.json
  for variant in "tables" "LOSSVERIFY_TABLE_THREADS=256" "LOSSVERIFY_REFERENCE_TABLES=off"; do
    echo "-- $variant"
    for k in 1 2; do
      env $([[ $variant == *=* ]] && echo "$variant") LOSSVERIFY_TRACE=1 "$bin" run $e2e --backend cuda --quiet \
        --report "$out/e2e-trace-${variant##*=}-$k.json" 2>&1 | grep -v "rank 0 verify 0\|verify 5\|verify 7"
      echo "exit ${PIPESTATUS[0]}"
    done
    summarize_e2e "$out"/e2e-trace-${variant##*=}-*.json
  done
  if command -v nsys > /dev/null; then
    nsys profile -o "$out/e2e" -t cuda,osrt --force-overwrite true "$bin" run $e2e --backend cuda --quiet > /dev/null 2>&1
    nsys stats -r cuda_api_sum,cuda_gpu_kern_sum "$out/e2e.nsys-rep" 2>&1 | grep -v "^$" | head -60
  fi
fi
if has ncu; then
  echo "== Nsight Compute: the reference kernels on N = 1024 rows of the end-to-end shape"
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  "$ncu" --kernel-name regex:"partials_kernel|compare_kernel" --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section WarpStateStats --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
    "$bin" run bench/cases/cuda-e2e-n16384-v128256-bf16.json --set shape.tokens=1024 --backend cuda --quiet 2>&1 \
    | grep -E "partials_kernel|compare_kernel|Duration|DRAM Throughput|Compute \(SM\)|inst_executed|issue_active|Registers|Achieved Occupancy|Stall|Warp Cycles Per Issued" | head -60
fi
if has gate; then
  echo "== gate --backend cuda"
  /usr/bin/time -f "gate wall %e s" "$bin" gate --backend cuda --report "$out/gate-cuda.json" 2>&1 | tail -8
  echo "== CUDA CTests"; (cd "$build" && ctest -R "cuda" --output-on-failure 2>&1 | tail -8)
fi
if has parity; then
  echo "== CUDA report parity: out/before vs this tree"
  cmake -S out/before -B build/before -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" > "$out/configure-before.log" 2>&1 &&
    cmake --build build/before -j16 --target lossverify > "$out/build-before.log" 2>&1 || tail -20 "$out/build-before.log"
  rm -rf "$out/parity-before" "$out/parity-after"
  for side in before after; do
    b=build/before/cli/lossverify; [[ $side == after ]] && b=$bin
    PARITY_JOBS=${PARITY_JOBS:-8} PARITY_THREADS=2 PARITY_RUN_ARGS="--backend cuda" \
      bash scripts/report_parity.sh "$b" "$out/parity-$side" 2>&1 | tail -3
  done
  bash scripts/report_parity.sh --compare "$out/parity-before" "$out/parity-after" 2>&1 | head -80
fi
if has bench; then
  echo "== bench"
  "$bin" bench --repeats 20 --report "$out/bench-tp1.json" 2>&1 | tail -12
  "$bin" bench --shape 16384,151936 --tp 8 --report "$out/bench-tp8.json" 2>&1 | tail -6
  echo "== end to end: run --backend cuda (GPU float64 reference), N=16384 V=128256 bf16"
  for k in 1 2 3; do
    "$bin" run bench/cases/cuda-e2e-n16384-v128256-bf16.json --backend cuda --quiet --report "$out/e2e-$k.json"; echo "exit $?"
  done
  summarize_e2e "$out"/e2e-[0-9].json
fi
# The gate on every GPU count the machine has, summarised per loss kind; any golden mismatch fails the script
# (its exit status, and a GATES FAILED line). Then replay parity over 2 GPUs (tests/cli/replay_parity.py).
gate_by_kind() {
  python3 - "$@" <<'PY'
import glob, json, os, sys
kinds = {}
for f in glob.glob("cases/*.json"):
    kinds[os.path.basename(f)[:-5]] = json.load(open(f)).get("loss", {}).get("kind", "cross_entropy")
for path in sys.argv[1:]:
    g = json.load(open(path))["gate"]
    rows = {}
    for cell in g["cells"]:
        if cell["verdict"] == "not_applicable":
            continue
        r = rows.setdefault(kinds[cell["case"]], [0, 0, 0])
        r[0] += 1
        r[1] += not cell["matches"]
    for sweep in g["sweeps"]:
        r = rows.setdefault(kinds[sweep["case"]], [0, 0, 0])
        r[2] += 1
        r[1] += not sweep["matches"]
    for kind, (cells, mismatches, sweeps) in sorted(rows.items()):
        print(f"  {g['gpus']} GPU(s) {kind:14s} {cells:4d} cells {sweeps:2d} sweeps: {mismatches} golden mismatches")
PY
}
gates_failed=0
if has gates; then
  echo "== the gate on 1, 2 and 4 GPUs (NCCL endpoints set up once per process) $(date +%T)"
  gpus=$(nvidia-smi -L | wc -l)
  for g in 1 2 4; do
    (( g <= gpus )) || continue
    /usr/bin/time -f "gate --backend cuda --gpus $g: wall %e s" "$bin" gate --backend cuda --gpus $g \
      --report "$out/gate-cuda-gpus$g.json" > "$out/gate-cuda-gpus$g.log" 2>&1
    rc=$?
    tail -3 "$out/gate-cuda-gpus$g.log"; grep "^MISMATCH" "$out/gate-cuda-gpus$g.log" | head -10
    gate_by_kind "$out/gate-cuda-gpus$g.json"
    if (( rc != 0 )); then echo "GATES FAILED: gate --backend cuda --gpus $g exited $rc"; gates_failed=1; fi
  done
  if (( gpus >= 2 )); then
    echo "== replay parity over 2 GPUs: the gate's order in one process vs each run alone $(date +%T)"
    python3 tests/cli/replay_parity.py "$bin" "$out/replay" --backend cuda --gpus 2 --jobs 8 2>&1 | tail -15
    (( PIPESTATUS[0] == 0 )) || { echo "GATES FAILED: replay parity"; gates_failed=1; }
  fi
  if [[ -z "${BUILD_TARGETS:-}" ]]; then
    echo "== CUDA CLI CTests"; (cd "$build" && ctest -R "cli_.*cuda" --output-on-failure 2>&1 | tail -6)
  fi
fi
# REVERT_PATCH=FILE: the tree with that patch reversed (a fix taken out), built beside this one; its CUDA tests and
# replay parity must fail there, where the regression tests were written to catch it.
if has reverted; then
  echo "== the tree with $REVERT_PATCH reversed (built beside this one since the start) $(date +%T)"
  wait "$reverted_build" || { grep -B2 -A8 "error" "$out/build-reverted.log" | head -30; }
  echo "-- CUDA tests of the reverted tree (the regression tests must fail)"
  timeout 300 "$reverted/build/tests/lossverify_cuda_tests" -d 2>&1 | grep -E "ERROR|test cases|FAILED|Status" | head -20
  if (( $(nvidia-smi -L | wc -l) >= 2 )); then
    echo "-- replay parity of the reverted tree over 2 GPUs"
    python3 tests/cli/replay_parity.py "$reverted/build/cli/lossverify" "$out/replay-reverted" --backend cuda --gpus 2 \
      --jobs 8 2>&1 | tail -8
  fi
fi
if has benchgpus; then
  gpus=$(nvidia-smi -L | wc -l)
  for g in 2 4; do
    (( g <= gpus )) || continue
    echo "== bench --gpus $g $(date +%T)"
    "$bin" bench --gpus $g --report "$out/bench-gpus$g.json" 2>&1
  done
fi
if has verdicts; then
  echo "== verdicts on every path (bench/verdict_matrix.py) $(date +%T)"
  python3 bench/verdict_matrix.py --binary "$bin" ${VERDICT_LAYOUTS:---layout tp2 --layout tp4 --layout tp2-dp2} \
    --out "$out/verdicts" 2>&1
fi
if has launch; then
  echo "== launch: python3 -m lossverify.torch run --fn ...correct cases/smoothing-pytorch.json --tp 2 $(date +%T)"
  export LOSSVERIFY_BIN=$PWD/$bin
  repeats=${LAUNCH_REPEATS:-3}
  for k in $(seq "$repeats"); do /usr/bin/time -f "python3 -c 'import torch': %e s" python3 -c "import torch"; done
  for side in ${PYTHON_BEFORE:+before} after; do
    pp=$PWD/python; [[ $side == before ]] && pp=$PYTHON_BEFORE
    for dev in cpu cuda; do
      for k in $(seq "$repeats"); do
        PYTHONPATH=$pp /usr/bin/time -f "$side --device $dev: %e s" python3 -m lossverify.torch run \
          --fn lossverify.torch.implementations:correct cases/smoothing-pytorch.json --tp 2 --device $dev -q
      done
    done
  done
  echo "-- phases of one run (LOSSVERIFY_TORCH_TRACE=1), cpu then cuda"
  for dev in cpu cuda; do
    LOSSVERIFY_TORCH_TRACE=1 PYTHONPATH=$PWD/python python3 -m lossverify.torch run \
      --fn lossverify.torch.implementations:correct cases/smoothing-pytorch.json --tp 2 --device $dev -q 2>&1 | sort
  done
fi
if has torchrun; then
  echo "== torchrun: 4 processes, NCCL, tp 2 x dp 2; then two launches of 2 (two 'machines', own TMPDIR each)"
  export LOSSVERIFY_BIN=$PWD/$bin  # the device build's binary (the package finds no installed one)
  PYTHONPATH=$PWD/python /usr/bin/time -f "torchrun x4: %e s" python3 -m torch.distributed.run --nproc-per-node 4 \
    -m lossverify.torch run --fn lossverify.torch.implementations:correct cases/full-4d-layout.json --tp 2 --cp 1 \
    --dp 2 --ga 2 --device cuda --report "$out/torchrun-nccl.json" 2>&1 | grep -v "^\*\|OMP_NUM\|^W"
  for n in 0 1; do
    mkdir -p "$out/node$n"
    TMPDIR=$out/node$n CUDA_VISIBLE_DEVICES=$((2 * n)),$((2 * n + 1)) PYTHONPATH=$PWD/python python3 -m torch.distributed.run \
      --nnodes 2 --node-rank $n --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29561 -m lossverify.torch run \
      --fn lossverify.torch.implementations:dp_local_mean cases/dp-unequal-tokens.json --tp 2 --cp 1 --dp 2 --ga 1 \
      --device cuda --report "$out/torchrun-2nodes.json" > "$out/node$n.log" 2>&1 &
  done
  wait
  grep -h "verdict\|FAIL\|pass " "$out/node0.log" | head -12
  PYTHONPATH=$PWD/python python3 -m lossverify.torch run --fn lossverify.torch.implementations:dp_local_mean \
    cases/dp-unequal-tokens.json --tp 2 --cp 1 --dp 2 --ga 1 --device cuda --report "$out/forked-nccl-dp.json" -q
  python3 - "$out/torchrun-2nodes.json" "$out/forked-nccl-dp.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
f = lambda r: sorted(c["name"] for c in r["runs"][0]["checks"] if c["verdict"] == "fail")
m = lambda r: {c["name"]: c["margin"] for c in r["runs"][0]["checks"]}
print(f"  torchrun over two launches: {a['verdict']} {f(a)}; forked NCCL: {b['verdict']} {f(b)}; "
      f"{'MATCH (margins equal)' if f(a) == f(b) and m(a) == m(b) else 'DIFFER'}")
PY
fi
if (( gates_failed )); then echo "GATES FAILED (see above)"; exit 1; fi
