#!/usr/bin/env bash
# Runs a case under mpiexec (one process per rank) and on thread ranks, and checks that both give the
# same exit code and bitwise the same checks (every metric, margin and worst element).
# usage: compare_backends.sh MPIEXEC LOSSVERIFY PYTHON PROCESSES CASE IMPL WORK_DIR
set -u
mpiexec=$1 lv=$2 python=$3 n=$4 case=$5 impl=$6 work=$7
mkdir -p "$work"
name=$(basename "$case" .json)-$(basename "$impl" | tr -c 'A-Za-z0-9_.=-\n' '_')
timeout 300 "$mpiexec" -n "$n" "$lv" run "$case" --impl "$impl" --quiet --report "$work/$name.mpi.json"
mpi_code=$?
timeout 300 "$lv" run "$case" --impl "$impl" --launcher threads --quiet --report "$work/$name.threads.json"
threads_code=$?
if [ "$mpi_code" -ne "$threads_code" ]; then
  echo "FAIL: exit code mpi $mpi_code, threads $threads_code"
  exit 1
fi
"$python" - "$work/$name.mpi.json" "$work/$name.threads.json" <<'PY'
import json, sys
mpi, threads = (json.load(open(p)) for p in sys.argv[1:3])
assert mpi["environment"]["backend"] == "mpi" and threads["environment"]["backend"] == "cpu-threads"
a, b = mpi["runs"][0], threads["runs"][0]
for ca, cb in zip(a["checks"], b["checks"]):
    if ca != cb:
        print("FAIL: check", ca["name"], "differs:\n mpi     ", json.dumps(ca)[:600], "\n threads ", json.dumps(cb)[:600])
        sys.exit(1)
assert a["verdict"] == b["verdict"]
print(f"{a['case']['name']} --impl {a['implementation']['name']}: {a['layout']['ranks']} ranks, verdict {a['verdict']}, "
      f"{len(a['checks'])} checks bitwise identical on mpi and threads")
PY
