#!/usr/bin/env bash
# --backend cuda: with no usable GPU (or a build without CUDA), a clear error and exit code 3; with a GPU,
# a passing run.
set -u
lv=$1 case_file=$2
if "$lv" --version | grep -q "CUDA GPUs visible now: [1-9]"; then
  "$lv" run "$case_file" --backend cuda --quiet
  code=$?
  [ "$code" -eq 0 ] && echo "GPU present: --backend cuda passed" && exit 0
  echo "FAIL: --backend cuda exited $code with a GPU present"; exit 1
fi
output=$("$lv" run "$case_file" --backend cuda 2>&1)
code=$?
if [ "$code" -ne 3 ] || ! grep -Eq -- "--backend cuda: (no usable CUDA device|this build has no CUDA)" <<<"$output"; then
  echo "FAIL: expected exit 3 and a message naming the reason, got $code: $output"; exit 1
fi
echo "no GPU: --backend cuda exits 3: $output"
