#!/usr/bin/env bash
# The gate fails, naming the cell, when a golden outcome disagrees, and leaves golden/ untouched.
# usage: gate_drift.sh LOSSVERIFY CASES_DIR GOLDEN_DIR WORK_DIR
set -eu
lv=$1 cases=$2 golden=$3 work=$4
rm -rf "$work" && mkdir -p "$work/cases" "$work/golden"
for c in smoothing-pytorch underflow-gap-240; do
  cp "$cases/$c.json" "$work/cases/" && cp "$golden/$c.json" "$work/golden/"
done
# Pretend the golden file expected the correct implementation to fail on smoothing-pytorch.
python3 - "$work/golden/smoothing-pytorch.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["outcomes"]["correct"] = {"verdict": "fail", "failing_checks": ["grad"]}
json.dump(doc, open(sys.argv[1], "w"), indent=2)
PY
before=$(sha256sum "$work/golden/"*.json)
set +e
output=$("$lv" gate --cases "$work/cases" --golden "$work/golden" 2>&1)
code=$?
set -e
after=$(sha256sum "$work/golden/"*.json)
fail=0
[ "$code" -eq 1 ] || { echo "FAIL: exit code $code, expected 1"; fail=1; }
grep -q "MISMATCH smoothing-pytorch --impl correct" <<<"$output" || { echo "FAIL: mismatch not named"; fail=1; }
grep -q "gate: FAIL" <<<"$output" || { echo "FAIL: no gate: FAIL line"; fail=1; }
[ "$before" = "$after" ] || { echo "FAIL: golden files were rewritten"; fail=1; }
# A case without any golden file is a mismatch too, never a silent pass.
rm "$work/golden/underflow-gap-240.json"
set +e
output2=$("$lv" gate --cases "$work/cases" --golden "$work/golden" 2>&1)
code2=$?
set -e
[ "$code2" -eq 1 ] || { echo "FAIL: missing golden gave exit $code2"; fail=1; }
grep -q "no golden outcome for this cell" <<<"$output2" || { echo "FAIL: missing golden not reported"; fail=1; }
[ $fail -eq 0 ] && echo "gate drift detected as expected" || { echo "$output"; echo "$output2"; }
exit $fail
