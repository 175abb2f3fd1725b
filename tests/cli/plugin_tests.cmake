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
