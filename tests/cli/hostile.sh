#!/usr/bin/env bash
# The hostile-input suite: one function per defect an adversarial audit found (tests/cli/hostile_tests.cmake
# runs each as its own CTest). Each prints what it saw and exits non-zero when lossverify misbehaves.
#   usage: hostile.sh NAME LOSSVERIFY CASES_DIR WORK_DIR [MPIEXEC]
set -u
name=$1 LV=$2 CASES=$3 WORK=$4/$1 MPIEXEC=${5:-mpiexec}
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 2
CE=$CASES/smoothing-pytorch.json
KD=$CASES/kd-tp4-temperature2.json
status=0
fail() { echo "FAIL: $*"; status=1; }

# expect CODE REGEX command...: runs it (60 s at most), checks the exit code and that the output matches.
expect() {
  local code=$1 regex=$2
  shift 2
  local output
  output=$(timeout --kill-after=5 60 "$@" 2>&1 </dev/null)
  local got=$?
  [ "$got" -eq "$code" ] || fail "exit $got, expected $code: $*"
  if [ -n "$regex" ] && ! grep -Eq -- "$regex" <<<"$output"; then fail "output does not match '$regex': $*"; fi
  [ $status -eq 0 ] || printf '%s\n' "--- output:" "$output"
}

# expect, for a command under mpiexec whose ranks all exit before MPI_Init: MPICH's mpiexec now and then dies
# of SIGPIPE then (exit 141 and no output; seen twice in CI, once in about 235 runs here). lossverify's answer is
# the same each time, so a run that mpiexec lost that way is repeated, at most twice.
expect_early_exit_under_mpiexec() {
  local code=$1 regex=$2
  shift 2
  local output got attempt
  for attempt in 1 2 3; do
    output=$(timeout --kill-after=5 60 "$@" 2>&1 </dev/null)
    got=$?
    [ "$got" -ne 141 ] && break
  done
  [ "$got" -eq "$code" ] || fail "exit $got, expected $code: $*"
  if [ -n "$regex" ] && ! grep -Eq -- "$regex" <<<"$output"; then fail "output does not match '$regex': $*"; fi
  [ $status -eq 0 ] || printf '%s\n' "--- output:" "$output"
}

# quick SECONDS command...: the command must finish within SECONDS (refused before any work).
quick() {
  local limit=$1
  shift
  local start=$SECONDS
  "$@"
  [ $((SECONDS - start)) -le "$limit" ] || fail "took $((SECONDS - start)) s, more than $limit: refused only after the work"
}

# No temporary file may be left behind in the work folder.
no_leftovers() {
  local left
  left=$(find . -name '.lossverify-*' -o -name '*.tmp.*')
  [ -z "$left" ] || fail "temporary files left behind: $left"
}

case $name in
# --- output files ---------------------------------------------------------------------------------------
report_dev_null)  # the device stays a device
  # As root, a copy of /dev/null made here, so that a regression replaces the copy and not the system's
  # device; otherwise /dev/null itself, which a non-root writer could not replace anyway.
  device=/dev/null
  if [ "$(id -u)" -eq 0 ] && mknod null c 1 3; then device=$PWD/null; fi
  expect 0 "" "$LV" run "$CE" -q --report "$device"
  [ -c "$device" ] || fail "$device is no longer a character device" ;;
report_dev_full)  # a stream that fails reports the failure
  device=/dev/full
  if [ "$(id -u)" -eq 0 ] && mknod full c 1 7; then device=$PWD/full; fi
  expect 3 "$device: cannot write report: No space left on device" "$LV" run "$CE" -q --report "$device"
  [ -c "$device" ] || fail "$device is no longer a character device" ;;
report_fifo)  # a FIFO with a reader gets the report as a stream; one without a reader fails, without hanging
  mkfifo pipe
  # The reader opens the FIFO without blocking (so it is a reader before lossverify opens it), says so, and
  # reads until the writer closes.
  python3 - <<'PY' &
import os, select, time
fd = os.open("pipe", os.O_RDONLY | os.O_NONBLOCK)
open("reader-ready", "w").close()
data, deadline = b"", time.monotonic() + 60
while time.monotonic() < deadline:
    select.select([fd], [], [], 1)
    chunk = os.read(fd, 65536)
    if chunk:
        data += chunk
    elif data:
        break  # the writer closed
    else:
        time.sleep(0.01)  # no writer yet
open("received.json", "wb").write(data)
PY
  for _ in $(seq 100); do [ -e reader-ready ] && break; sleep 0.05; done
  expect 0 "" "$LV" run "$CE" -q --report pipe
  wait
  python3 -c "import json,sys; json.load(open('received.json'))" || fail "the FIFO did not carry a JSON report"
  [ -p pipe ] || fail "the FIFO was replaced"
  expect 3 "a FIFO with no reader" "$LV" run "$CE" -q --report pipe ;;
report_symlink)  # a symbolic link is followed: its target is written, the link stays
  echo old >target.json
  ln -s target.json link.json
  expect 0 "" "$LV" run "$CE" -q --report link.json
  [ -L link.json ] || fail "the symbolic link was replaced"
  grep -q '"verdict"' target.json || fail "the link's target holds no report"
  no_leftovers ;;
report_folder)  # a folder is refused before the run
  mkdir folder
  quick 5 expect 2 "--report folder: is a folder, not a file" "$LV" run "$CE" -q --report folder ;;
report_is_input)  # a report never overwrites what the command reads
  cp "$CE" case.json
  cp case.json original.json
  expect 2 "--report case.json: is case.json, which this command reads" "$LV" run case.json -q --report case.json
  ln -s case.json alias.json
  expect 2 "which this command reads" "$LV" run case.json -q --report alias.json
  expect 2 "--out case.json: is case.json, which this command reads" \
    "$LV" shrink case.json --impl smoothing-partition-vocab --out case.json --max-trials 2
  cmp -s case.json original.json || fail "the case file was changed"
  "$LV" run case.json -q --impl smoothing-partition-vocab --save-inputs failed --save-inputs-dir .
  bundle=$(ls ./*.bundle.json | head -1)
  cp "$bundle" bundle.orig
  expect 2 "which this command reads" "$LV" replay "$bundle" --report "$bundle"
  expect 2 "which this command reads" "$LV" replay "$bundle" --plot "$bundle.svg" --report "$bundle"
  cmp -s "$bundle" bundle.orig || fail "the bundle was changed"
  cp -r "$CASES/../tests/data/dumps/torch-ce-cp2-zigzag" dump
  cp dump/manifest.json manifest.orig
  expect 2 "--report dump/manifest.json: is dump/manifest.json, which this command reads" \
    "$LV" check-dump dump/manifest.json --report dump/manifest.json
  cmp -s dump/manifest.json manifest.orig || fail "the manifest was changed" ;;
report_long_name)  # a name of 250 characters works (the temporary file's name does not grow from it)
  long=$(printf 'r%.0s' $(seq 1 245)).json
  expect 0 "" "$LV" run "$CE" -q --report "$long"
  [ -s "$long" ] || fail "no report under the 250-character name"
  long=$(printf 'r%.0s' $(seq 1 260)).json
  quick 5 expect 2 "--report r+\.json: " "$LV" run "$CE" -q --report "$long"
  no_leftovers ;;
outputs_checked_first)  # every output path is checked before the work: exit 2, not 3 after a whole run
  quick 5 expect 2 "--report missing/r.json: folder missing does not exist" "$LV" run "$CE" -q --report missing/r.json
  quick 5 expect 2 "--plot missing/p.svg: folder missing does not exist" "$LV" run "$CE" -q --plot missing/p.svg
  quick 5 expect 2 "--save-inputs-dir missing: not an existing folder" "$LV" run "$CE" -q --save-inputs-dir missing
  quick 5 expect 2 "--out missing/s.json: folder missing does not exist" \
    "$LV" shrink "$CE" --impl smoothing-partition-vocab --out missing/s.json
  quick 5 expect 2 "--report missing/b.json" "$LV" bench --report missing/b.json
  root=$(cd "$CASES/.." && pwd)
  (cd "$root" && quick 10 expect 2 "--junit .*missing/j.xml: folder .*missing does not exist" \
    "$LV" gate --junit "$WORK/missing/j.xml")
  (cd "$root" && quick 10 expect 2 "--report .*missing/g.json" "$LV" gate --report "$WORK/missing/g.json") ;;
# --- case files and --set -----------------------------------------------------------------------------
case_number_overflow)  # 1e400 is a usage error naming the file, in a case file and in --set
  sed 's/"tokens": 512/"tokens": 1e400/' "$CE" >big.json
  expect 2 "big.json: case file is not valid JSON: .*1e400" "$LV" run big.json
  expect 2 "--set loss.label_smoothing=1e400: 1e400 is outside the range of a double" \
    "$LV" run "$CE" --set loss.label_smoothing=1e400 ;;
case_duplicate_key)  # a key given twice is an error, not "the last one wins"
  sed 's/"vocab": 1000/"vocab": 1000, "vocab": 999/' "$CE" >twice.json
  expect 2 "twice.json: case file repeats the key \"vocab\"" "$LV" run twice.json ;;
case_sequence_overflow)  # sequence lengths whose sum overflows
  python3 - "$CE" <<'PY'
import json, sys
case = json.load(open(sys.argv[1]))
case["shape"].pop("tokens")
case["batch"] = {"sequence_lengths": [2**62, 2**62, 2**62, 2**62, 5]}
json.dump(case, open("overflow.json", "w"))
case["batch"] = {"sequence_lengths": [2**41]}
json.dump(case, open("huge.json", "w"))
PY
  quick 5 expect 2 "overflow.json: \\\$\.batch\.sequence_lengths: the sequences hold more than 2\^40 tokens" \
    "$LV" run overflow.json
  quick 5 expect 2 "more than 2\^40 tokens" "$LV" run huge.json ;;
case_not_regular)  # a FIFO as a case file is refused at once
  mkfifo fifo.json
  quick 5 expect 2 "fifo.json: cannot open case file: not a regular file" "$LV" run fifo.json ;;
# --- sweeps ---------------------------------------------------------------------------------------------
sweep_rank_overflow)  # 4096^3 ranks: refused, not SIGFPE
  quick 5 expect 2 "sweep layout tp4096-cp4096-dp4096-ga1: tp \* cp \* dp exceeds 65536 ranks" \
    "$LV" run "$CE" --sweep tp=4096 cp=4096 dp=4096 ;;
sweep_checked_first)  # an impossible layout later in the list is found before the first one runs
  quick 5 expect 2 "sweep layout tp2000-cp1-dp1-ga1: .*exceeds the vocabulary size 1000" \
    "$LV" run "$CE" --sweep tp=1,2,2000
  if grep -q "layouts done" <<<"$("$LV" run "$CE" --sweep tp=1,2,2000 2>&1)"; then fail "a layout ran"; fi ;;
sweep_cap)  # at most 256 layouts in one command
  quick 5 expect 2 "the sweep has 272 layouts; at most 256" \
    "$LV" run "$CE" --sweep tp=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 cp=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 ;;
sweep_progress)  # a long sweep reports each finished layout on stderr; stdout keeps the summary
  "$LV" run "$CASES/cp-zigzag-packed.json" --sweep tp=1,2,3 cp=1,2 --threads 2 >out.txt 2>err.txt \
    || fail "the sweep failed"
  [ "$(grep -c "layouts done" err.txt)" -eq 6 ] || fail "expected 6 progress lines on stderr: $(cat err.txt)"
  grep -q "invariance: pass" out.txt || fail "no invariance line on stdout"
  "$LV" run "$CASES/cp-zigzag-packed.json" --sweep tp=1,2,3 cp=1,2 --threads 2 -q 2>err.txt
  [ ! -s err.txt ] || fail "--quiet printed progress" ;;
sweep_case_after_layouts)  # --sweep tp=1,2 cp=1,2 CASE.json: the case is not swallowed
  expect 0 "sweep of 4 layouts" "$LV" run --sweep tp=1,2 cp=1,2 "$CE" --threads 2 ;;
sweep_alone)  # --sweep alone uses the case's own sweep; a case without one is told so
  expect 0 "cp-zigzag-packed: sweep of 9 layouts" "$LV" run --sweep "$CASES/cp-zigzag-packed.json" --threads 2 \
    --report sweep.json
  python3 -c "import json; r=json.load(open('sweep.json')); assert len(r['sweeps'][0]['layouts']) == 9" \
    || fail "the report does not hold the case's 9 layouts"
  expect 2 "--sweep without layouts uses the case's \"sweep\", and it has none" "$LV" run "$CE" --sweep ;;
sweep_memory)  # the invariance check keeps two snapshots, not one per layout: 8 layouts peak as 2 do
  for layouts in 2,2 2,2,2,2,2,2,2,2; do  # one layout eight times: the same cost each
    "$LV" run "$CE" --set shape.tokens=4096 --set shape.vocab=4096 --sweep tp=$layouts --threads 2 -q \
      --report "sweep-$layouts.json" 2>/dev/null || fail "sweep tp=$layouts failed"
  done
  python3 - <<'PY' || fail "peak memory grows with the number of layouts"
import json
peak = {n: max(r["resources"]["peak_rss_bytes"] for r in json.load(open(f"sweep-{n}.json"))["runs"])
        for n in ("2,2", "2,2,2,2,2,2,2,2")}
growth = peak["2,2,2,2,2,2,2,2"] - peak["2,2"]
# Each layout's snapshot holds 4096 x 4096 float32 gradients (67 MB): keeping all 8 would add 400 MB.
print("peak RSS, 2 layouts:", round(peak["2,2"] / 1e6), "MB; 8 layouts:", round(peak["2,2,2,2,2,2,2,2"] / 1e6), "MB")
assert growth < 50e6
PY
  ;;
# --- options --------------------------------------------------------------------------------------------
threads_bound)
  expect 2 "--threads: Value 100000 not in range 0 to 1024" "$LV" run "$CE" --threads 100000
  expect 2 "--threads" "$LV" gate --threads 100000 ;;
timeout_values)
  expect 2 "--timeout: must be a number of seconds in \[0.01, 86400\], got nan" "$LV" run "$CE" --timeout nan
  expect 2 "--timeout: must be a number of seconds in \[0.01, 86400\], got 1e-7" "$LV" run "$CE" --timeout 1e-7
  expect 2 "--timeout: must be a number of seconds" "$LV" run "$CE" --timeout inf ;;
bench_shape)
  expect 2 "--shape 1,x: expected N,V \(two integers\)" "$LV" bench --shape 1,x
  expect 2 "--shape 12: expected N,V" "$LV" bench --shape 12 ;;
memory_estimate)  # a layout that cannot fit is refused up front, with the figures
  quick 5 expect 2 "N=1073741824 V=1048576 at tp=4 cp=1 dp=1 needs about .* GB .*but this machine has .* GB available" \
    "$LV" run "$CE" --set shape.tokens=1073741824 --set shape.vocab=1048576 ;;
# --- values beyond the exact range ----------------------------------------------------------------------
value_ranges)  # refused beyond each edge; the correct implementation passes at each edge
  expect 2 "temperature: must be in \(0, 1e6\]" "$LV" run "$KD" --set loss.temperature=1e300
  expect 2 "softcap: must be 0 \(off\) or in \[1e-6, 1e6\]" "$LV" run "$CE" --set loss.softcap=1e-300
  expect 2 "z_loss_weight: must be in \[0, 10\]" "$LV" run "$CE" --set loss.z_loss_weight=1e300
  expect 2 "generated logits reach .* beyond 1000000" "$LV" run "$CE" --set inputs.mean=3e38
  expect 2 "upstream_weights: 1e\+308 is beyond" "$LV" run "$CE" --set loss.reduction=none \
    --set 'loss.upstream_weights={"distribution":"uniform","low":1e308,"high":1e308}'
  expect 2 "logits / temperature reach .* beyond 200" "$LV" run "$KD" --set loss.temperature=0.13
  # KD's upper edge for these inputs (scale 3 student and teacher): where atol T^2 reaches a tenth of T^2 KL
  expect 2 "temperature: 301.0 is beyond 300.0, where the loss's float32 floor" "$LV" run "$KD" --set loss.temperature=301
  for dtype in fp32 bf16 fp16; do
    expect 0 "" "$LV" run "$KD" -q --set inputs.dtype=$dtype --set loss.temperature=0.1375
    expect 0 "" "$LV" run "$KD" -q --set inputs.dtype=$dtype --set loss.temperature=300
    for softcap in 1e-6 1 30 1e6; do
      expect 0 "" "$LV" run "$CE" -q --set inputs.dtype=$dtype --set loss.softcap=$softcap --set loss.z_loss_weight=10 \
        --set loss.label_smoothing=0.1
    done
    weight=$([ $dtype = fp16 ] && echo 32752 || echo 1e6)
    expect 0 "" "$LV" run "$CE" -q --set inputs.dtype=$dtype --set loss.reduction=none \
      --set "loss.upstream_weights={\"distribution\":\"uniform\",\"low\":-$weight,\"high\":$weight}"
  done
  expect 0 "" "$LV" run "$CE" -q --set inputs.mean=999990 --set inputs.scale=1 --set loss.z_loss_weight=10
  expect 0 "" "$LV" run "$CE" -q --set inputs.dtype=bf16 --set inputs.mean=-999990 --set inputs.scale=1 ;;
# --- names that are not text ----------------------------------------------------------------------------
utf8_case_path)  # a case path that is not UTF-8: the run passes and the report is valid JSON
  name=$(printf 'case-\xff\xfe.json')
  cp "$CE" "$name"
  expect 0 "" "$LV" run "$name" -q --report report.json --save-inputs always --save-inputs-dir .
  python3 -c "import json; json.load(open('report.json', encoding='utf-8'))" || fail "the report is not valid UTF-8 JSON"
  expect 2 "--set name=.*\\\\xFF: not UTF-8 text" "$LV" run "$CE" --set "name=$(printf 'x\xff')" ;;
utf8_case_path_mpi)  # the same under MPI processes: the run passes, the report and the bundle are valid JSON
  name=$(printf 'case-\xff\xfe.json')
  cp "$CASES/uneven-shards-v507-tp4.json" "$name"
  expect 0 "" "$MPIEXEC" -n 4 "$LV" run "$name" -q --report report.json
  expect 1 "" "$MPIEXEC" -n 4 "$LV" run "$name" -q --impl smoothing-partition-vocab --save-inputs-dir . --report bug.json
  for file in report.json bug.json ./*.bundle.json; do
    python3 -c "import json,sys; json.load(open(sys.argv[1], encoding='utf-8'))" "$file" || fail "$file is not valid JSON"
  done ;;
control_characters)  # a case name with a terminal escape sequence is printed escaped
  python3 - "$CE" <<'PY'
import json, sys
case = json.load(open(sys.argv[1]))
case["name"] = "evil\u001b[2J\u001b[31mname\nnext line"
json.dump(case, open("evil.json", "w"))
PY
  output=$("$LV" run evil.json 2>&1)
  if grep -q $'\x1b' <<<"$output"; then fail "an escape character reached the terminal"; fi
  grep -q 'case evil\\x1B\[2J\\x1B\[31mname\\nnext line' <<<"$output" || fail "the name is not shown escaped: $output" ;;
# --- rough edges ----------------------------------------------------------------------------------------
kd_bug_on_cross_entropy)
  expect 2 "--impl kd-no-t2 is a bug of kd losses, and this case is cross_entropy: not applicable" \
    "$LV" run "$CE" --impl kd-no-t2 ;;
seam_refusals)  # layout.sp and a stage are refused by name where they do not apply
  expect 2 "layout.sp: applies to a kind whose rows are whole on every rank" "$LV" run "$CE" --set layout.sp=true
  expect 2 "stage.kind: expected a registered stage \(lm_head\), got \"lm_tail\"" "$LV" run "$CE" \
    --set 'stage={"kind":"lm_tail"}'
  expect 2 "clip_low: applies to policy only, not cross_entropy" "$LV" run "$CE" --set loss.clip_low=0.1
  expect 2 "sp applies to a kind whose rows are whole on every rank" "$LV" run "$CE" --sweep sp=0,1
  expect 2 "\"2\" is not false, true, 0 or 1" "$LV" run "$CE" --sweep sp=2 ;;
unknown_command)
  expect 2 "unknown command \"lst\"; did you mean \"list\"\?" "$LV" lst
  expect 2 "unknown command \"frobnicate\" \(see lossverify --help\)" "$LV" frobnicate ;;
list_losses)
  expect 0 "kd  .*temperature" "$LV" list
  expect 0 "softcap" "$LV" list
  "$LV" list --json | python3 -c "import json,sys; d=json.load(sys.stdin); assert {l['name'] for l in d['losses']} == {'cross_entropy','kd','policy','router'}" \
    || fail "list --json does not name every loss" ;;
policy_export_inputs)  # a policy case's export carries the inputs its objective reads, and nothing it does not
  expect 0 "exported 4 rank" "$LV" export-inputs "$CASES/rl-grpo-tp2-dp2-ga2.json" --out grpo
  expect 0 "exported 4 rank" "$LV" export-inputs "$CASES/rl-logprob-entropy-tp4.json" --out logprob
  python3 - grpo/inputs.json logprob/inputs.json <<'PY' || fail "the policy inputs are not exported as the objective needs"
import json, sys
policy = {"old_logprob", "ref_logprob", "advantages"}
grpo, logprob = (json.load(open(p)) for p in sys.argv[1:])
assert all(policy <= set(r["tensors"]) for r in grpo["ranks"]), grpo["ranks"][0]["tensors"]
assert not any(policy & set(r["tensors"]) for r in logprob["ranks"]), logprob["ranks"][0]["tensors"]
PY
  ;;
help_exit_codes)  # each subcommand's help lists its own exit codes
  expect 0 "exit codes: 0 reproduced, 1 did not reproduce" "$LV" replay --help
  expect 0 "exit codes: 0 the minimized case was written" "$LV" shrink --help
  expect 0 "exit codes: 0 every outcome matches golden" "$LV" gate --help
  expect 0 "exit codes: 0 written" "$LV" export-inputs --help
  if "$LV" shrink --help | grep -q "4 timeout"; then fail "shrink's help lists run's exit codes"; fi
  if "$LV" bench --help | grep -Eq "\{cpu"; then fail "bench --help offers --backend cpu"; fi ;;
launcher_without_mpiexec)
  expect 2 "--launcher mpi: this (process was not started by mpiexec|build has no MPI)" "$LV" run "$CE" --launcher mpi ;;
launcher_threads_under_mpiexec)  # every process would run the whole job
  expect_early_exit_under_mpiexec 2 "--launcher threads under mpiexec with 2 processes would run the whole job in every process" \
    "$MPIEXEC" -n 2 "$LV" run "$CE" --launcher threads ;;
mpi_fault_values)  # a bad --inject-fault is a usage error on every rank, not std::terminate
  expect 2 "rank 0 of 4: error: --inject-fault bogus: expected" \
    "$MPIEXEC" -n 4 "$LV" run "$CASES/uneven-shards-v507-tp4.json" --inject-fault bogus
  expect 2 "--inject-fault: rank 9 outside \[0, 4\)" \
    "$MPIEXEC" -n 4 "$LV" run "$CASES/uneven-shards-v507-tp4.json" --inject-fault throw@9 ;;
gate_outside_root)
  mkdir elsewhere && cd elsewhere || exit 2
  quick 5 expect 2 "--cases cases: no such folder here: run the gate from the repository root, or give --cases DIR --golden DIR" \
    "$LV" gate ;;
*)
  echo "hostile.sh: unknown test $name" >&2
  exit 2 ;;
esac
exit $status
