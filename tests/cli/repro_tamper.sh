#!/usr/bin/env bash
# Replays tampered copies of a good bundle: each must exit 2 with a message naming the file and the field,
# and write no report.
# usage: repro_tamper.sh EXPECT_SH LOSSVERIFY PYTHON BUNDLE OUTDIR
set -u
expect=$1 lv=$2 python=$3 bundle=$4 out=$5
mkdir -p "$out"
status=0

# tamper NAME PYTHON_STATEMENT REGEX: apply the statement to the bundle `b`, then replay it.
tamper() {
  local name=$1 statement=$2 regex=$3
  "$python" - "$bundle" "$out/$name.bundle.json" "$statement" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
exec(sys.argv[3])
with open(sys.argv[2], "w") as f:
    json.dump(b, f)
PY
  echo "== $name"
  bash "$expect" 2 "$name\\.bundle\\.json: $regex" --absent "$out/$name.report.json" \
    -- "$lv" replay "$out/$name.bundle.json" --report "$out/$name.report.json" || status=1
}

tamper format 'b["format"] = "lossverify.bundle/9"' '\$\.format: unsupported bundle format'
tamper implementation 'b["implementation"] = "no-such-bug"' '\$\.implementation: unknown implementation'
tamper case_value 'b["case"]["layout"]["tp"] = 0' '\$\.case\.layout\.tp: must be >= 1'
tamper case_missing 'del b["case"]' '\$\.case: required key is missing'
tamper bits_word 'r = b["failing_rows"][0]; r["logits_bits"] = "xyz " + r["logits_bits"].split(" ", 1)[1]' \
  '\$\.failing_rows\[0\]\.logits_bits: word 0 "xyz": expected 8 hex digits'
tamper bits_count 'r = b["failing_rows"][0]; r["logits_bits"] = r["logits_bits"].split(" ", 1)[1]' \
  '\$\.failing_rows\[0\]\.logits_bits: has 299 values, expected vocab = 300'
tamper pinned_row_edited \
  't = b["failing_rows"][0]["token"]; [o["logits"].__setitem__(7, o["logits"][7] + 1.0) for o in b["case"]["inputs"]["overrides"] if o["token"] == t]' \
  '\$\.failing_rows\[0\]\.logits_bits: word 7 \(.*\) disagrees with \$\.case\.inputs\.overrides'
tamper verdict 'b["outcome"]["checks"][0]["verdict"] = "maybe"' '\$\.outcome\.checks\[0\]\.verdict: expected one of'
tamper unknown_key 'b["comment"] = "hi"' '\$\.comment: unknown key'

echo "== truncated"
head -c 300 "$bundle" > "$out/truncated.bundle.json"
bash "$expect" 2 "truncated\\.bundle\\.json: bundle is not valid JSON" -- "$lv" replay "$out/truncated.bundle.json" || status=1
exit $status
