# Native plugins (--impl plugin:PATH): a plugin that cannot be loaded is exit 2 naming it; one that fails,
# writes the wrong sizes or past its buffers, or crashes in one rank is exit 3 naming the plugin and the rank;
# one that hangs raises the deadlock guard (exit 4). Never a hang, never a report.
set(FAULTY $<TARGET_FILE:lossverify_test_faulty_plugin>)
set(PLUGIN_CASE ${CASES}/uneven-shards-v507-tp4.json)

lossverify_cli_test(plugin_missing 2 "--impl plugin:.*no-such.so: no such file"
  -- ${LV} run ${PLUGIN_CASE} --impl plugin:${OUT}/no-such.so)
lossverify_cli_test(plugin_not_regular 2 "is not a regular file" -- ${LV} run ${PLUGIN_CASE} --impl plugin:${OUT})
lossverify_cli_test(plugin_not_a_library 2 "cannot load the library" -- ${LV} run ${PLUGIN_CASE} --impl plugin:${PLUGIN_CASE})
lossverify_cli_test(plugin_no_entry 2 "has no entry point lossverify_plugin"
  -- ${LV} run ${PLUGIN_CASE} --impl plugin:$<TARGET_FILE:lossverify_test_no_entry_plugin>)
lossverify_cli_test(plugin_wrong_abi 2 "plugin ABI version 2, but this lossverify implements version 1"
  -- ${LV} run ${PLUGIN_CASE} --impl plugin:$<TARGET_FILE:lossverify_test_wrong_abi_plugin>)

function(lossverify_plugin_fault name code regex fault)
  lossverify_cli_test(plugin_fault_${name} ${code} ${regex} --within 30 --absent ${OUT}/plugin_${name}.json
    -- ${LV} run ${PLUGIN_CASE} --impl "plugin:${FAULTY}?fault=${fault}" --timeout 2 --report ${OUT}/plugin_${name}.json)
endfunction()
lossverify_plugin_fault(error 3 "rank 2: plugin plugin:.*faulty.*: run_rank returned 7: injected error in rank 2" error@2)
lossverify_plugin_fault(crash 3 "plugin plugin:.*faulty.* crashed in rank 1: SIGSEGV" crash@1)
lossverify_plugin_fault(abort 3 "plugin plugin:.*faulty.* crashed in rank 3: SIGABRT" abort@3)
lossverify_plugin_fault(throw 3 "rank 0: plugin plugin:.*faulty.*: run_rank threw a C\\+\\+ exception through the C ABI: a C\\+\\+ exception escaping" throw@0)
lossverify_plugin_fault(hang 4 "deadlock guard: .*rank\\(s\\) 2 never arrived" hang@2)
lossverify_plugin_fault(rows 3 "rank 1: plugin plugin:.*: wrote a gradient of 257 x 127 .*, but the rank holds 256 rows x 127" rows@1)
lossverify_plugin_fault(losses 3 "rank 0: plugin plugin:.*: wrote 255 per-row losses" losses@0)
lossverify_plugin_fault(overrun 3 "rank 3: plugin plugin:.*: wrote past the end of its gradient buffer" overrun@3)
lossverify_plugin_fault(unlogged 3 "rank 0: plugin plugin:.*: reduction mean logs a loss, but the plugin set has_logged_loss = 0" unlogged@0)
lossverify_plugin_fault(misuse 3 "rank 1: plugin plugin:.*: allreduce called with group 9" misuse@1)

# The example plugins: the CPU one passes the gate as the correct implementation (every case and sweep,
# against golden/) and, with its bug parameter, fails exactly where golden says that bug fails; it runs
# under MPI and reproduces through a bundle. The CUDA one is compiled here and run where a GPU is.
set(CPU_PLUGIN $<TARGET_FILE:lossverify_example_cpu_plugin>)
lossverify_cli_test(plugin_cpu_gate 0 "gate: PASS" -- ${LV} gate --impl plugin:${CPU_PLUGIN}
  --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2)
lossverify_cli_test(plugin_cpu_bug_gate 0 "mutation score: 1/1 bugs caught"
  -- ${LV} gate --impl "plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab" --expect smoothing-partition-vocab
     --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2)
lossverify_cli_test(plugin_cpu_bug_is_not_correct 1 "MISMATCH smoothing-pytorch"
  -- ${LV} gate --impl "plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab" --expect correct
     --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2)
set_tests_properties(cli_plugin_cpu_gate cli_plugin_cpu_bug_gate cli_plugin_cpu_bug_is_not_correct PROPERTIES TIMEOUT 600)
lossverify_cli_test(plugin_bad_parameter 2 "the plugin refuses its parameters \"bug=nope\": unknown parameter"
  -- ${LV} run ${PLUGIN_CASE} --impl "plugin:${CPU_PLUGIN}?bug=nope")
lossverify_cli_test(plugin_host_on_cuda 2 "--backend cuda: the plugin .* computes in host memory"
  -- ${LV} run ${PLUGIN_CASE} --impl plugin:${CPU_PLUGIN} --backend cuda)
set(PLUGIN_REPRO ${OUT}/plugin_repro)
add_test(NAME cli_plugin_bundle_replays
  COMMAND bash -c "rm -rf ${PLUGIN_REPRO} && mkdir -p ${PLUGIN_REPRO} && \
    bash ${EXPECT} 1 'rank_agreement +FAIL' -- ${LV} run ${CASES}/smoothing-pytorch.json \
      --impl 'plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab' --save-inputs failed --save-inputs-dir ${PLUGIN_REPRO} && \
    bash ${EXPECT} 0 '^reproduced: FAIL as recorded' -- ${LV} replay ${PLUGIN_REPRO}/*.bundle.json && \
    bash ${EXPECT} 0 'with --impl correct: pass' -- ${LV} replay ${PLUGIN_REPRO}/*.bundle.json --impl correct")
add_test(NAME cli_plugin_cuda COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cuda_plugin.sh ${LV}
  $<$<TARGET_EXISTS:lossverify_example_cuda_plugin>:$<TARGET_FILE:lossverify_example_cuda_plugin>> ${CASES})
set_tests_properties(cli_plugin_cuda PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
lossverify_cli_test(plugin_shrink 0 "layout      tp=4 cp=1 dp=1 ga=1 -> tp=2" --present ${OUT}/plugin_shrunk.json
  -- ${LV} shrink ${CASES}/smoothing-pytorch.json --impl "plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab"
     --out ${OUT}/plugin_shrunk.json --threads 1)
