#!/usr/bin/env bash
# Judges frameworks on a GPU machine in one call: builds the lossverify binary (bench/device_run.sh) and runs
# judge.py once per JOB, with the machine's python3 (torch 2, Triton). A JOB is "NAME ADAPTER CHECKOUT [judge.py
# options]"; its JSON, Markdown and log go to $OUT/frameworks/NAME.{json,md,log}.
# usage: bash scripts/frameworks/device_judge.sh "te-2707 transformer_engine .device/frameworks/te-2707 --commit 0b638b92 --device cuda --backend gloo" ...
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/lossverify-out}/frameworks
mkdir -p "$out"
# LOSSVERIFY_BIN set to a built binary: no build here.
if [[ ! -x ${LOSSVERIFY_BIN:-} ]]; then
  BUILD_TARGETS=lossverify bash bench/device_run.sh none > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  LOSSVERIFY_BIN=$PWD/${BUILD_DIR:-build/dev}/cli/lossverify
fi
export LOSSVERIFY_BIN NCCL_NVLS_ENABLE=0
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
for job in "$@"; do
  read -r name adapter checkout options <<< "$job"
  echo "== $name $(date +%T)"
  # shellcheck disable=SC2086  # the options are words
  python3 scripts/frameworks/judge.py "$adapter" "$checkout" $options --json "$out/$name.json" \
    --markdown "$out/$name.md" > "$out/$name.log" 2>&1
  echo "exit $?; $(grep -c ' pass ' "$out/$name.log") pass, $(grep -c ' fail ' "$out/$name.log") fail, $(grep -c ' error ' "$out/$name.log") error"
  grep -E ' (fail|error) ' "$out/$name.log" | head -20
  python3 - "$out/$name.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["runs"] if r.get("detail")]
if rows:  # the first error's whole message (a rank's traceback)
    print(rows[0]["detail"][-2500:])
PY
done
