#!/usr/bin/env bash
# The gate on a GPU: every shipped case x every implementation on the CUDA backend, judged by the GPU oracle,
# matches the same golden/ as the CPU gate; a wrong expectation fails it. Without a GPU (or a build without
# CUDA) the test is skipped (77) saying why.
set -u
lv=$1 cases=$2 out=$3
if ! "$lv" --version | grep -q "CUDA GPUs visible now: [1-9]"; then
  echo "skipped: no CUDA GPU visible (run this test where a GPU is)"; exit 77
fi
golden=$(dirname "$cases")/golden
mkdir -p "$out"
status=0
if "$lv" gate --backend cuda --cases "$cases" --golden "$golden" --report "$out/gate-cuda.json" --quiet; then
  grep -q '"backend": "cuda"' "$out/gate-cuda.json" || { echo "FAIL: the report does not say cuda"; status=1; }
else
  echo "FAIL: the CUDA gate does not match golden/"; status=1
fi
# A bug judged as the correct implementation must fail the gate on the GPU too.
if "$lv" gate --backend cuda --impl no-max-shift --expect correct --cases "$cases" --golden "$golden" --quiet; then
  echo "FAIL: no-max-shift passed as correct on the GPU"; status=1
fi
[ $status -eq 0 ] && echo "GPU present: the CUDA gate matches golden/, and no-max-shift fails as correct"
exit $status
