#!/usr/bin/env bash
# Outputs of one command are compared by the file they land in: `./r.json`, `sub/../r.json` or a symbolic link
# naming --report's file is refused (exit 2) before any work, in run, check-dump and gate; a --plot too; and a
# --report named like a reproducer bundle keeps its name while the bundle takes the next number.
set -u
lv=$1 cases=$2 golden=$3 out=$4
rm -rf "$out"; mkdir -p "$out/sub"; cd "$out" || exit 1
status=0
refused() {  # refused DESCRIPTION COMMAND...
  local what=$1; shift
  local text; text=$("$@" 2>&1); local rc=$?
  if [[ $rc != 2 || $text != *"is the same file as"* ]]; then echo "FAIL: $what: exit $rc: $text"; status=1; fi
  if [[ -e r.json || -e g.json ]]; then echo "FAIL: $what: a file was written"; status=1; fi
}
c=$cases/smoothing-pytorch.json
refused "./ spelling" "$lv" run "$c" --report r.json --junit ./r.json
refused "sub/.. spelling" "$lv" run "$c" --report r.json --junit sub/../r.json
ln -s r.json link.json
refused "symbolic link" "$lv" run "$c" --report r.json --junit link.json
refused "--plot" "$lv" run "$c" --report r.svg --plot ./r.svg
refused "gate" "$lv" gate --cases "$cases" --golden "$golden" --report g.json --junit "$out/g.json"
# check-dump: the same rule before the manifest is read (a missing manifest would be exit 2 for another reason).
"$lv" export-inputs "$c" --out dump > /dev/null || { echo "FAIL: export-inputs"; status=1; }
text=$("$lv" check-dump dump/inputs.json --report r.json --junit ./sub/../r.json 2>&1)
[[ $? == 2 && $text == *"is the same file as --report"* ]] || { echo "FAIL: check-dump: $text"; status=1; }
# A --report named like the bundle: the report keeps its name, the bundle takes .2.
bundle=smoothing-pytorch.smoothing-partition-vocab.bundle.json
"$lv" run "$c" --impl smoothing-partition-vocab --save-inputs failed --save-inputs-dir . --report "$bundle" -q
grep -q '"schema_version"' "$bundle" || { echo "FAIL: the report was replaced by the bundle"; status=1; }
grep -q 'lossverify.bundle' smoothing-pytorch.smoothing-partition-vocab.2.bundle.json ||
  { echo "FAIL: no bundle beside the report"; status=1; }
[[ $status == 0 ]] && echo "every spelling of one file refused; the bundle took .2 beside a report of its name"
exit $status
