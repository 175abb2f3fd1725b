# MPI backend tests: run under mpiexec (oversubscribed on small machines), one process per rank.
set(MPIRUN ${MPIEXEC_EXECUTABLE})
set(COMPARE ${CMAKE_CURRENT_SOURCE_DIR}/cli/compare_backends.sh)

function(lossverify_mpi_equality processes case impl)
  add_test(NAME mpi_equals_threads_${case}_${impl}
    COMMAND bash ${COMPARE} ${MPIRUN} ${LV} ${LOSSVERIFY_SYSTEM_PYTHON} ${processes} ${CASES}/${case}.json ${impl}
            ${OUT}/mpi)
  set_tests_properties(mpi_equals_threads_${case}_${impl} PROPERTIES PROCESSORS 2 TIMEOUT 300)
endfunction()

# Every layout dimension, the correct implementation and bugs caught by different checks.
lossverify_mpi_equality(4 uneven-shards-v507-tp4 correct)
lossverify_mpi_equality(4 uneven-shards-v507-tp4 smoothing-partition-vocab)
lossverify_mpi_equality(2 zloss-ignored zloss-on-ignored)
lossverify_mpi_equality(4 cp-zigzag-packed correct)
lossverify_mpi_equality(4 cp-zigzag-packed cp-stats-dp-only)
lossverify_mpi_equality(8 dp-unequal-tokens dp-local-mean)
lossverify_mpi_equality(4 ga-unequal-microbatches correct)
lossverify_mpi_equality(4 ga-unequal-microbatches ga-microbatch-mean)
lossverify_mpi_equality(4 kd-tp4-temperature2 kd-untracked-allreduce)
lossverify_mpi_equality(8 full-4d-layout correct)
lossverify_mpi_equality(8 full-4d-layout cp-roll-after-split)
lossverify_mpi_equality(2 underflow-gap-240 smoothing-log-after-exp)
# The router: its scopes' counts all-reduced over CP and TP under sequence parallelism, across processes.
lossverify_mpi_equality(4 moe-aux-sp-tp2-cp2 correct)
lossverify_mpi_equality(8 moe-per-token-sp-cp2-dp2 moe-aux-per-token-rank-count)
lossverify_mpi_equality(4 moe-global-aux-dp2-ga2 moe-aux-local-counts)

# Faults: a rank that throws, exits or hangs ends the whole job, naming the rank; no report.
lossverify_cli_test(mpi_fault_throw 3 "rank 1: injected fault" --within 30 --absent ${OUT}/mpi_throw.json
  -- ${MPIRUN} -n 4 ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault throw@1 --report ${OUT}/mpi_throw.json)
lossverify_cli_test(mpi_fault_exit 9 "rank 3 exited before the run finished" --within 30 --absent ${OUT}/mpi_exit.json
  -- ${MPIRUN} -n 4 ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault exit@3 --report ${OUT}/mpi_exit.json)
lossverify_cli_test(mpi_fault_hang 4 "deadlock guard: .* rank\\(s\\) 2 never arrived" --within 40
  --absent ${OUT}/mpi_hang.json
  -- ${MPIRUN} -n 4 ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault hang@2 --timeout 2
     --report ${OUT}/mpi_hang.json)
# A process count that does not match the layout: a usage error from every rank, not a hang.
lossverify_cli_test(mpi_wrong_process_count 2 "rank 2 of 3: error: .*4 ranks, but mpiexec started 3 processes"
  --within 30 -- ${MPIRUN} -n 3 ${LV} run ${CASES}/uneven-shards-v507-tp4.json)
lossverify_cli_test(mpi_sweep_needs_threads 2 "--sweep runs several layouts: use the thread launcher" --within 30
  -- ${MPIRUN} -n 2 ${LV} run ${CASES}/zloss-ignored.json --sweep tp=1,2)
lossverify_cli_test(mpi_report 0 "verdict: pass" --present ${OUT}/mpi_report.json --within 60
  -- ${MPIRUN} -n 8 ${LV} run ${CASES}/full-4d-layout.json --report ${OUT}/mpi_report.json)
add_test(NAME mpi_report_schema
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/validate_report.py
          ${PROJECT_SOURCE_DIR}/schema/report.schema.json ${OUT}/mpi_report.json)
set_tests_properties(mpi_report_schema PROPERTIES DEPENDS cli_mpi_report)
set_tests_properties(cli_mpi_fault_hang cli_mpi_report PROPERTIES PROCESSORS 2)

# The example CPU plugin on MPI processes: bitwise the thread ranks' checks, correct and with its bug.
foreach(params "" "?bug=smoothing-partition-vocab")
  string(MAKE_C_IDENTIFIER "plugin${params}" plugin_test_name)
  add_test(NAME mpi_equals_threads_${plugin_test_name}
    COMMAND bash ${COMPARE} ${MPIRUN} ${LV} ${LOSSVERIFY_SYSTEM_PYTHON} 8 ${CASES}/full-4d-layout.json
            "plugin:$<TARGET_FILE:lossverify_example_cpu_plugin>${params}" ${OUT}/mpi)
  set_tests_properties(mpi_equals_threads_${plugin_test_name} PROPERTIES PROCESSORS 2 TIMEOUT 300)
endforeach()
# The policy loss through the example plugin: MPI processes give bitwise the thread ranks' checks (tp 2 x dp 2).
foreach(params "" "?bug=rl-kl-no-grad")
  string(MAKE_C_IDENTIFIER "plugin_policy${params}" plugin_test_name)
  add_test(NAME mpi_equals_threads_${plugin_test_name}
    COMMAND bash ${COMPARE} ${MPIRUN} ${LV} ${LOSSVERIFY_SYSTEM_PYTHON} 4 ${CASES}/rl-grpo-tp2-dp2-ga2.json
            "plugin:$<TARGET_FILE:lossverify_example_cpu_plugin>${params}" ${OUT}/mpi)
  set_tests_properties(mpi_equals_threads_${plugin_test_name} PROPERTIES PROCESSORS 2 TIMEOUT 300)
endforeach()
# A plugin that crashes in one process names itself and the rank; mpiexec ends the job with a nonzero code
# (3, the crashed rank's, or 9, a rank it killed: whichever it reports first).
add_test(NAME cli_mpi_plugin_crash
  COMMAND bash -c "out=$(timeout 30 ${MPIRUN} -n 4 ${LV} run ${CASES}/uneven-shards-v507-tp4.json \
    --impl 'plugin:$<TARGET_FILE:lossverify_test_faulty_plugin>?fault=crash@2' --timeout 5 2>&1); code=$?; \
    echo \"$out\"; [ $code -eq 3 ] || [ $code -eq 9 ] || exit 1; \
    grep -q 'plugin plugin:.*faulty.* crashed in rank 2: SIGSEGV' <<<\"$out\"")
# Under mpiexec too, a plugin that ends its process is never a pass, and one that hangs before any collective
# ends the job with exit 4 within the timeout (issue 30: both hung or exited 0 before).
add_test(NAME cli_mpi_plugin_exit_is_not_a_pass
  COMMAND bash -c "out=$(timeout 60 ${MPIRUN} -n 2 ${LV} run ${CASES}/uneven-shards-v507-tp4.json --tp 2 \
    --impl 'plugin:$<TARGET_FILE:lossverify_test_faulty_plugin>?fault=exit@0' --timeout 5 2>&1 </dev/null); code=$?; \
    echo \"$out\"; [ $code -eq 3 ] && grep -q 'ended its process in rank 0 in run_rank' <<<\"$out\"")
foreach(ranks 1 2)
  math(EXPR hung "${ranks} - 1")
  add_test(NAME cli_mpi_plugin_hang_${ranks}_ranks
    COMMAND bash -c "start=$(date +%s); out=$(timeout 60 ${MPIRUN} -n ${ranks} ${LV} run ${CASES}/uneven-shards-v507-tp4.json \
      --tp ${ranks} --impl 'plugin:$<TARGET_FILE:lossverify_test_faulty_plugin>?fault=hang@${hung}' --timeout 2 2>&1 </dev/null); \
      code=$?; echo \"$out\"; [ $code -eq 4 ] && [ $(( $(date +%s) - start )) -lt 30 ] && \
      grep -q 'in rank ${hung}: no collective call and no result for 2 s' <<<\"$out\"")
endforeach()
set_tests_properties(cli_mpi_plugin_exit_is_not_a_pass cli_mpi_plugin_hang_1_ranks cli_mpi_plugin_hang_2_ranks
                     PROPERTIES PROCESSORS 2 TIMEOUT 120)
