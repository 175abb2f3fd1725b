#!/usr/bin/env bash
# Builds the libFuzzer targets of the case file and dump readers with AddressSanitizer and UndefinedBehaviorSanitizer and
# runs each for a bounded time from the seed corpus in tests/fuzz/corpus/. Not part of CI.
#   usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [safetensors|manifest|case ...]     (default: 60 s, every target)
# Needs clang with libFuzzer (Debian: apt-get install clang libclang-rt-dev). Work files go to build/fuzz/:
# the grown corpus (corpus_<target>/), and crash-/leak-/timeout- artifacts, which make the script exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors manifest case)
cxx=${CXX_FUZZ:-clang++}
command -v "$cxx" >/dev/null || { echo "fuzz.sh: $cxx not found (apt-get install clang libclang-rt-dev)" >&2; exit 2; }
out=build/fuzz
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -Isrc -I/usr/include/eigen3)
# The readers and what they parse with (the case file's sections for the manifest).
sources=(src/lossverify/dump/tensor_file.cpp src/lossverify/dump/manifest.cpp src/lossverify/case/case.cpp
         src/lossverify/case/json_reader.cpp src/lossverify/core/dtype.cpp src/lossverify/core/strings.cpp src/lossverify/checks/tolerances.cpp
         src/lossverify/layout/rank_layout.cpp src/lossverify/layout/global_batch.cpp
         src/lossverify/runner/memory_estimate.cpp)
status=0
for target in "${targets[@]}"; do
  binary=$out/fuzz_$target
  echo "fuzz.sh: building $binary"
  "$cxx" "${flags[@]}" "tests/fuzz/fuzz_$target.cpp" "${sources[@]}" -o "$binary"
  corpus=$out/corpus_$target
  mkdir -p "$corpus"
  extra=()
  [ -f "tests/fuzz/$target.dict" ] && extra+=(-dict="tests/fuzz/$target.dict")
  echo "fuzz.sh: running $target for $seconds s"
  start=$(date +%s)
  if ! UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$binary" "$corpus" "tests/fuzz/corpus/$target" \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$out/$target-" "${extra[@]+"${extra[@]}"}" 2>"$out/$target.log"; then
    status=1
    echo "fuzz.sh: $target FOUND A PROBLEM: see $out/$target.log and $out/$target-*" >&2
    grep -E "ERROR|SUMMARY|runtime error|deadly signal|uncaught" "$out/$target.log" | head -20 >&2 || true
  fi
  end=$(date +%s)
  runs=$(grep -Eo "stat::number_of_executed_units: *[0-9]+" "$out/$target.log" | grep -Eo "[0-9]+$" || echo "?")
  cov=$(grep -Eo "cov: [0-9]+" "$out/$target.log" | tail -1 || echo "cov: ?")
  echo "fuzz.sh: $target: $((end - start)) s, $runs inputs, $cov, corpus $(ls "$corpus" | wc -l) files"
done
exit $status
