#!/usr/bin/env bash
# The example CUDA plugin: with a GPU, the gate holds it to golden/ as the correct implementation and, with
# its bug parameter, as no-max-shift; without a GPU (or a build without CUDA) the test is skipped (77) saying why.
set -u
lv=$1 plugin=${2:-} cases=${3:-}
if [ -z "$plugin" ] || [ -z "$cases" ]; then
  echo "skipped: this build has no CUDA toolkit, so the example CUDA plugin was not built"; exit 77
fi
if ! "$lv" --version | grep -q "CUDA GPUs visible now: [1-9]"; then
  echo "skipped: no CUDA GPU visible (the plugin $plugin was compiled; run this test where a GPU is)"; exit 77
fi
golden=$(dirname "$cases")/golden
status=0
"$lv" gate --impl "plugin:$plugin" --cases "$cases" --golden "$golden" --quiet || { echo "FAIL: gate of the CUDA plugin"; status=1; }
"$lv" gate --impl "plugin:$plugin?bug=no-max-shift" --expect no-max-shift --cases "$cases" --golden "$golden" --quiet ||
  { echo "FAIL: gate of the CUDA plugin with bug=no-max-shift"; status=1; }
[ $status -eq 0 ] && echo "GPU present: the CUDA plugin passes the gate, correct and with bug=no-max-shift"
exit $status
