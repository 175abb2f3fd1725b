#!/usr/bin/env bash
# The example CUDA plugin: with a GPU, the gate holds it to golden/ as the correct implementation (its LM head on the
# head cases of cross-entropy among them) and, with its bug parameters, as no-max-shift and head-dh-shard-partial;
# without a GPU (or a build without CUDA) the test is skipped (77) saying why.
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
# Its LM head (cuda_lm_head.cuh): on the head cases of cross-entropy, dh left unsummed over TP fails where golden says.
head_cases=$(mktemp -d)
cp "$cases"/head-*.json "$head_cases"/
"$lv" gate --impl "plugin:$plugin?bug=head-dh-shard-partial" --expect head-dh-shard-partial --cases "$head_cases" \
  --golden "$golden" --quiet || { echo "FAIL: gate of the CUDA plugin with bug=head-dh-shard-partial"; status=1; }
rm -rf "$head_cases"
[ $status -eq 0 ] && echo "GPU present: the CUDA plugin passes the gate, correct, with bug=no-max-shift and with" \
  "bug=head-dh-shard-partial"
exit $status
