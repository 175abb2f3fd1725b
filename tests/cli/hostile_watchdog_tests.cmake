# Hostile-input suite: see tests/CMakeLists.txt.
# The thread ranks' deadlock guard (docs/ranks.md): it times only waits inside collectives, so ranks that
# compute longer than --timeout are not hung, and it names the rank at the root of a wait, not the ranks
# stuck behind it.
function(lossverify_hostile_watchdog_test name code regex)
  add_test(NAME hostile_watchdog_${name} COMMAND bash ${EXPECT} ${code} ${regex} ${ARGN})
endfunction()

# The two tests below compute three to four times longer than their timeout of 2 s. With 0.5 s they failed when the
# 2-core machine ran other work beside the suite (a rank's thread descheduled past the timeout between beats);
# 2 s keeps the point, a rank computing longer than the timeout is not hung, with room for a busy machine.
# Rank 0 of dp = 2 computes 4000 rows of 32000 columns (about 6 s) while rank 1, with 8 rows, waits for it.
lossverify_hostile_watchdog_test(computing_is_not_hanging 0 "verdict: pass" --within 120
  -- ${LV} run ${CASES}/cp-zigzag-packed.json --set layout.tp=1 --set layout.cp=1 --set layout.dp=2
     --set shape.vocab=32000 --set "batch.sequence_lengths=[4000,8]" --threads 2 --timeout 2)
# The audit's case: eight TP ranks whose kernels and checks run longer than the timeout between collectives.
lossverify_hostile_watchdog_test(realistic_tp8_timeout_1 0 "verdict: pass" --within 120
  -- ${LV} run ${CASES}/realistic-bf16-n2048-v32000-tp8.json --timeout 1)
# One rank never waits, and it beats while it computes, so it is not accused however long it computes (the
# audit's 32768 x 32000 case at the default timeout, made small: about 8 s).
lossverify_hostile_watchdog_test(one_rank_computing 0 "verdict: pass" --within 120
  -- ${LV} run ${CASES}/realistic-bf16-n2048-v32000-tp8.json --tp 1 --threads 1 --timeout 2)

# A hung rank: every one of `runs` runs exits 4 naming exactly that rank (the old guard named a rank
# waiting behind it in a third to half of the runs). The script has no semicolons: CMake would split
# the argument there.
set(WATCHDOG_REPEAT [=[
runs=$1 rank=$2
shift 2
for i in $(seq "$runs")
do
  output=$("$@" 2>&1)
  code=$?
  line=$(grep -o 'deadlock guard: .*' <<<"$output")
  echo "run $i: exit $code: $line"
  if [ "$code" -ne 4 ] || ! grep -Eq "rank\(s\) $rank never arrived$" <<<"$line"
  then
    exit 1
  fi
done
echo "every run named rank $rank"
]=])
function(lossverify_hostile_watchdog_root name runs rank)
  lossverify_hostile_watchdog_test(${name} 0 "every run named rank ${rank}" --within 120
    -- bash -c "${WATCHDOG_REPEAT}" watchdog ${runs} ${rank} ${ARGN})
endfunction()
# CP x TP: rank 3 waits for rank 1 in their CP group, and its TP peer rank 2 waits for rank 3.
lossverify_hostile_watchdog_root(root_cp 5 1
  ${LV} run ${CASES}/cp-zigzag-packed.json --inject-fault hang@1 --timeout 0.5)
# DP x TP: ranks 0, 4 and 6 wait for rank 2 in their DP group, and their TP peers 1, 5 and 7 wait for them.
lossverify_hostile_watchdog_root(root_dp 6 2
  ${LV} run ${CASES}/dp-unequal-tokens.json --inject-fault hang@2 --timeout 0.5)

# A single rank that hangs outside every collective: no wait reveals it, so the guard fires once no rank has
# made progress for the timeout.
lossverify_hostile_watchdog_test(one_rank_hangs 4 "no rank made progress for 0.5 s. rank\\(s\\) 0 never reached a collective"
  --within 20 -- ${LV} run ${CASES}/smoothing-pytorch.json --tp 1 --inject-fault hang@0 --timeout 0.5)
