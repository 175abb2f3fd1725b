#!/usr/bin/env bash
# summary.py --check on drift: a page whose first failing margin was changed fails with exit 1 and a diff that
# names both lines, and a results file with a malformed row fails with exit 2 naming the file and the field.
# usage: frameworks_summary_drift.sh PYTHON WORKDIR
set -euo pipefail
python=$1
work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
summary=$root/scripts/frameworks/summary.py
rm -rf "$work" && mkdir -p "$work"

# 1. One margin changed on a copy of the page.
cp "$root/docs/frameworks.md" "$work/page.md"
read -r index < <("$python" - "$work/page.md" <<'PY'
import re, sys
path = sys.argv[1]
lines = open(path).read().split("\n")
index = next(i for i, l in enumerate(lines) if re.search(r"\| FAIL \| [a-z_]+ [0-9.e+]+", l))
changed = re.sub(r"(\| FAIL \| [a-z_]+ )([0-9.e+]+)", lambda m: m.group(1) + m.group(2) + "7", lines[index], count=1)
print(index)
open(sys.argv[1], "w").write("\n".join(lines[:index] + [changed] + lines[index + 1:]))
PY
)
original=$(sed -n "$((index + 1))p" "$root/docs/frameworks.md")
drifted=$(sed -n "$((index + 1))p" "$work/page.md")
[ "$original" != "$drifted" ] || { echo "the copy was not changed"; exit 1; }
set +e
"$python" "$summary" --check --page "$work/page.md" > "$work/diff.txt" 2> "$work/stderr.txt"
rc=$?
set -e
cat "$work/diff.txt" "$work/stderr.txt"
[ "$rc" = 1 ] || { echo "expected exit 1 on a drifted page, got $rc"; exit 1; }
grep -qxF -- "-$drifted" "$work/diff.txt" || { echo "the diff does not name the drifted line"; exit 1; }
grep -qxF -- "+$original" "$work/diff.txt" || { echo "the diff does not give the data's line"; exit 1; }

# 2. A malformed row in a copy of the results: exit 2, naming the file and the field.
cp -r "$root/scripts/frameworks/results" "$work/results"
file=$(ls "$work/results"/*.json | head -1)
"$python" - "$file" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
row = next(b["results"]["rows"][0] for s in data["sections"] for b in s["blocks"] if "results" in b)
row["verdict"] = "passed"
json.dump(data, open(sys.argv[1], "w"), indent=1)
PY
set +e
"$python" "$summary" --check --results "$work/results" > "$work/malformed.txt" 2>&1
rc=$?
set -e
cat "$work/malformed.txt"
[ "$rc" = 2 ] || { echo "expected exit 2 on a malformed results file, got $rc"; exit 1; }
grep -q "$(basename "$file"): /sections/[0-9]*/blocks/[0-9]*/results/rows/0" "$work/malformed.txt" ||
  { echo "the error does not name the file and the row"; exit 1; }
echo "drift and malformed data both caught"
