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
# A crash while a child the plugin forked still holds the host's socket: reported as the crash at once (the host's
# end is watched, not only its socket's EOF), never as a hang after the whole timeout.
lossverify_cli_test(plugin_fault_fork_crash 3 "plugin plugin:.*faulty.* crashed in rank 1: SIGSEGV" --within 20
  -- ${LV} run ${PLUGIN_CASE} --impl "plugin:${FAULTY}?fault=fork-crash@1" --timeout 60)
# A plugin that truncates the shared region (through /proc) cannot: the region is sealed at its size, and the run
# ends with the plugin's verdict (it wrote zeros) instead of SIGBUS in lossverify.
lossverify_cli_test(plugin_truncates_the_region 1 "verdict: FAIL" --within 30
  -- ${LV} run ${PLUGIN_CASE} --impl "plugin:${FAULTY}?fault=truncate-region@0" --no-control)
# A process a plugin starts in a session of its own ends with the command: a caller reading lossverify's output
# through a pipe is not held until it exits.
add_test(NAME cli_plugin_session_child_ends_with_the_command
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/plugin_session_child.sh ${LV} ${FAULTY} ${PLUGIN_CASE})
lossverify_plugin_fault(throw 3 "rank 0: plugin plugin:.*faulty.*: run_rank threw a C\\+\\+ exception through the C ABI: a C\\+\\+ exception escaping" throw@0)
lossverify_plugin_fault(hang 4 "deadlock guard: .*rank\\(s\\) 2 never arrived|in rank 2: no collective call and no result for 2 s" hang@2)
lossverify_plugin_fault(rows 3 "rank 1: plugin plugin:.*: wrote a gradient of 257 x 127 .*, but the rank holds 256 rows x 127" rows@1)
lossverify_plugin_fault(losses 3 "rank 0: plugin plugin:.*: wrote 255 per-row losses" losses@0)
lossverify_plugin_fault(overrun 3 "rank 3: plugin plugin:.*: wrote past the end of its gradient buffer" overrun@3)
lossverify_plugin_fault(unlogged 3 "rank 0: plugin plugin:.*: reduction mean logs a loss, but the plugin set has_logged_loss = 0" unlogged@0)
lossverify_plugin_fault(misuse 3 "rank 1: plugin plugin:.*: allreduce called with group 9" misuse@1)
# The plugin's code runs in a host process: however it ends that process, the run fails (never exit 0), naming
# the plugin, the rank and when (issue 30: each of these exited 0 before).
lossverify_plugin_fault(exit 3 "plugin plugin:.* ended its process in rank 1 in run_rank: the host exited with status 0" exit@1)
lossverify_plugin_fault(exit_all 3 "ended its process in rank [0-3] in run_rank: the host exited with status 0" _exit@all)
lossverify_plugin_fault(quick_exit 3 "ended its process in rank 0 in run_rank" quick_exit@0)
lossverify_plugin_fault(stack_overflow 3 "crashed in rank 2: SIGSEGV" stack-overflow@2)
lossverify_plugin_fault(thread_exit 3 "ended its process in rank 1" thread-exit@1)
lossverify_plugin_fault(thread_crash 3 "crashed in rank 1: SIGSEGV" thread-crash@1)
lossverify_plugin_fault(late_allreduce 3 "rank 1: the plugin called allreduce 1 time\\(s\\) after run_rank returned" late-allreduce@1)
lossverify_plugin_fault(element_mismatch 3 "the ranks of its TP group made different all-reduce calls.*f64" element-mismatch@1)
lossverify_plugin_fault(op_mismatch 3 "the ranks of its TP group made different all-reduce calls.*max" op-mismatch@2)
lossverify_plugin_fault(huge_count 3 "count 1099511627776.*more than a loss all-reduces" huge-count@0)
lossverify_plugin_fault(guard_value 3 "rank 3: plugin plugin:.*: wrote past the end of its gradient buffer" guard-value@3)
lossverify_plugin_fault(underrun 3 "rank 1: plugin plugin:.*: wrote outside its output buffers: the bytes before its gradient buffer" underrun@1)
lossverify_plugin_fault(overrun_far 3 "rank 2: plugin plugin:.*: wrote outside its output buffers, between its gradient" overrun-far@2)
function(lossverify_plugin_load_fault name code regex)
  lossverify_cli_test(plugin_load_${name} ${code} ${regex} --within 30 --absent ${OUT}/plugin_load_${name}.json
    -- ${ARGN} --report ${OUT}/plugin_load_${name}.json)
endfunction()
lossverify_plugin_load_fault(params_exit 3 "ended its process while loading: the host exited with status 0"
  ${LV} run ${PLUGIN_CASE} --impl "plugin:${FAULTY}?fault=params-exit")
lossverify_plugin_load_fault(params_crash 3 "ended its process while loading: the host was killed by SIGSEGV"
  ${LV} run ${PLUGIN_CASE} --impl "plugin:${FAULTY}?fault=params-crash")
lossverify_plugin_load_fault(ctor_exit 3 "ended its process while loading: the host exited with status 0"
  env LOSSVERIFY_TEST_LOAD_FAULT=ctor-exit ${LV} run ${PLUGIN_CASE} --impl plugin:${FAULTY})
lossverify_plugin_load_fault(entry_crash 3 "ended its process while loading: the host was killed by SIGSEGV"
  env LOSSVERIFY_TEST_LOAD_FAULT=entry-crash ${LV} run ${PLUGIN_CASE} --impl plugin:${FAULTY})
lossverify_plugin_load_fault(gate_entry_exit 3 "ended its process while loading"
  env LOSSVERIFY_TEST_LOAD_FAULT=entry-exit ${LV} gate --impl plugin:${FAULTY} --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden)
lossverify_cli_test(plugin_shrink_exit 3 "ended its process in rank [0-9]+ in run_rank" --absent ${OUT}/plugin_shrunk_exit.json
  -- ${LV} shrink ${CASES}/smoothing-pytorch.json --impl "plugin:${FAULTY}?fault=exit@all" --out ${OUT}/plugin_shrunk_exit.json)


# The example plugins: the CPU one passes the gate as the correct implementation (every case and sweep,
# against golden/) and, with its bug parameter, fails exactly where golden says that bug fails; it runs
# under MPI and reproduces through a bundle. The CUDA one is compiled here and run where a GPU is.
set(CPU_PLUGIN $<TARGET_FILE:lossverify_example_cpu_plugin>)
# A '?' in the library's path is written %3F (the first bare '?' starts the parameters).
add_test(NAME cli_plugin_question_mark_in_path
  COMMAND bash -c "rm -rf '${OUT}/what?dir' && mkdir -p '${OUT}/what?dir' && cp ${CPU_PLUGIN} '${OUT}/what?dir/plugin.so' && \
    bash ${EXPECT} 0 'verdict: pass' -- ${LV} run ${CASES}/underflow-gap-240.json --impl 'plugin:${OUT}/what%3Fdir/plugin.so'")
lossverify_cli_test(plugin_cpu_gate 0 "gate: PASS" -- ${LV} gate --impl plugin:${CPU_PLUGIN}
  --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2)
lossverify_cli_test(plugin_cpu_bug_gate 0 "mutation score: 1/1 bugs caught"
  -- ${LV} gate --impl "plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab" --expect smoothing-partition-vocab
     --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2)
lossverify_cli_test(plugin_cpu_bug_is_not_correct 1 "MISMATCH smoothing-pytorch"
  -- ${LV} gate --impl "plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab" --expect correct
     --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2)
set_tests_properties(cli_plugin_cpu_gate cli_plugin_cpu_bug_gate cli_plugin_cpu_bug_is_not_correct PROPERTIES TIMEOUT 600)
# The policy loss through the ABI (it grew within version 1): the example plugin passes each RL case (thread
# ranks here; the gate above runs them with their sweeps) and, with each of its policy bugs, fails exactly where
# golden says that bug fails, judged by the gate on the RL cases alone.
set(RL_CASES ${OUT}/plugin_rl_cases)
foreach(rl_case rl-grpo-tp2-dp2-ga2 rl-drgrpo-cp2-whiten rl-logprob-entropy-tp4 rl-gspo-cp2-tp2)
  string(MAKE_C_IDENTIFIER "${rl_case}" rl_test_name)
  lossverify_cli_test(plugin_cpu_${rl_test_name} 0 "verdict: pass"
    -- ${LV} run ${CASES}/${rl_case}.json --impl plugin:${CPU_PLUGIN} --threads 2)
endforeach()
foreach(rl_bug rl-kl-no-grad rl-temperature-one-side rl-gspo-cp-local-ratio)
  string(MAKE_C_IDENTIFIER "${rl_bug}" rl_test_name)
  add_test(NAME cli_plugin_cpu_bug_gate_${rl_test_name}
    COMMAND bash -c "rm -rf ${RL_CASES}_${rl_test_name} && mkdir -p ${RL_CASES}_${rl_test_name} && \
      cp ${CASES}/rl-*.json ${RL_CASES}_${rl_test_name}/ && \
      bash ${EXPECT} 0 'mutation score: 1/1 bugs caught' -- ${LV} gate --impl 'plugin:${CPU_PLUGIN}?bug=${rl_bug}' \
        --expect ${rl_bug} --cases ${RL_CASES}_${rl_test_name} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2")
  set_tests_properties(cli_plugin_cpu_bug_gate_${rl_test_name} PROPERTIES TIMEOUT 600)
endforeach()
# The router through the ABI (a kind named by string, whole rows, lv_rank_inputs.sequence_parallel): the example
# router plugin passes the gate as the correct implementation on every router case and its sweep (sp x tp x cp x dp
# x ga), and with each of its bugs fails exactly where golden says that bug fails; a router whose logged statistics
# the ABI cannot carry (more than 3 layers) is refused before any work, naming it.
set(ROUTER_PLUGIN $<TARGET_FILE:lossverify_example_router_plugin>)
set(ROUTER_CASES ${OUT}/plugin_router_cases)
foreach(router_impl correct moe-aux-local-counts moe-aux-tp-sum)
  string(MAKE_C_IDENTIFIER "${router_impl}" router_test_name)
  if(router_impl STREQUAL correct)
    set(router_param "")
    set(router_expect "gate: PASS")
  else()
    set(router_param "?bug=${router_impl}")
    set(router_expect "mutation score: 1/1 bugs caught")
  endif()
  add_test(NAME cli_plugin_router_gate_${router_test_name}
    COMMAND bash -c "rm -rf ${ROUTER_CASES}_${router_test_name} && mkdir -p ${ROUTER_CASES}_${router_test_name} && \
      cp ${CASES}/moe-*.json ${ROUTER_CASES}_${router_test_name}/ && \
      bash ${EXPECT} 0 '${router_expect}' -- ${LV} gate --impl 'plugin:${ROUTER_PLUGIN}${router_param}' \
        --expect ${router_impl} --cases ${ROUTER_CASES}_${router_test_name} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2")
  set_tests_properties(cli_plugin_router_gate_${router_test_name} PROPERTIES TIMEOUT 600)
endforeach()
# The LM head through the ABI (LV_SUPPORTS_LM_HEAD, lv_rank_inputs.head_*): the example CPU plugin passes the gate as
# the correct implementation on every head case and its sweep (sequence parallelism too), and with
# bug=head-dh-shard-partial fails exactly where golden says that bug fails; a plugin built before the head (the v1
# plugin) is refused a head case before any work, naming the capability, and the gate records it as not run.
set(HEAD_CASES ${OUT}/plugin_head_cases)
foreach(head_impl correct head-dh-shard-partial)
  string(MAKE_C_IDENTIFIER "${head_impl}" head_test_name)
  if(head_impl STREQUAL correct)
    set(head_param "")
    set(head_expect "gate: PASS")
  else()
    set(head_param "?bug=${head_impl}")
    set(head_expect "mutation score: 1/1 bugs caught")
  endif()
  add_test(NAME cli_plugin_head_gate_${head_test_name}
    COMMAND bash -c "rm -rf ${HEAD_CASES}_${head_test_name} && mkdir -p ${HEAD_CASES}_${head_test_name} && \
      cp ${CASES}/head-*.json ${HEAD_CASES}_${head_test_name}/ && \
      bash ${EXPECT} 0 '${head_expect}' -- ${LV} gate --impl 'plugin:${CPU_PLUGIN}${head_param}' \
        --expect ${head_impl} --cases ${HEAD_CASES}_${head_test_name} --golden ${PROJECT_SOURCE_DIR}/golden --threads 2")
  set_tests_properties(cli_plugin_head_gate_${head_test_name} PROPERTIES TIMEOUT 600)
endforeach()
lossverify_cli_test(plugin_v1_refuses_head 2
  "does not implement a case with the stage lm_head in front of its kind \\(its lv_plugin.losses lacks LV_SUPPORTS_LM_HEAD\\)"
  --absent ${OUT}/plugin_v1_head.json
  -- ${LV} run ${CASES}/head-ce-tp2-dp2-ga2.json --impl plugin:$<TARGET_FILE:lossverify_test_v1_cross_entropy_plugin>
     --report ${OUT}/plugin_v1_head.json)
set(V1_HEAD_CASES ${OUT}/plugin_v1_head_cases)
add_test(NAME cli_plugin_gate_skips_head_without_the_capability
  COMMAND bash -c "rm -rf ${V1_HEAD_CASES} && mkdir -p ${V1_HEAD_CASES} && cp ${CASES}/head-*.json ${V1_HEAD_CASES}/ && \
    bash ${EXPECT} 1 'NOTHING RAN' -- ${LV} gate --impl plugin:$<TARGET_FILE:lossverify_test_v1_cross_entropy_plugin> \
      --cases ${V1_HEAD_CASES} --golden ${PROJECT_SOURCE_DIR}/golden")
lossverify_cli_test(plugin_router_too_many_layers 2
  "does not implement a case that logs 10 statistics \\(the ABI carries 8: a router of at most 3 layers\\)"
  -- ${LV} run ${CASES}/moe-aux-sp-tp2-cp2.json --set loss.layers=4 --impl plugin:${ROUTER_PLUGIN})
# GSPO's sequence ratio (LV_SUPPORTS_POLICY_SEQUENCE_RATIO, lv_rank_inputs.policy_ratio): the example plugin passes
# the case's sweep (CP 1 and 2, where the ratio's CP all-reduces matter). A plugin that computes the policy loss but
# does not declare the bit (the faulty plugin) is refused before any work, naming the setting; the gate records it
# as not run, and a gate that ran nothing else fails (it checked nothing).
lossverify_cli_test(plugin_cpu_gspo_sweep 0 "invariance: pass"
  -- ${LV} run ${CASES}/rl-gspo-cp2-tp2.json --impl plugin:${CPU_PLUGIN} --sweep --threads 2)
set_tests_properties(cli_plugin_cpu_gspo_sweep PROPERTIES TIMEOUT 600)
lossverify_cli_test(plugin_refuses_sequence_ratio 2
  "the plugin plugin:.*faulty.* does not implement the policy setting ratio sequence .*LV_SUPPORTS_POLICY_SEQUENCE_RATIO"
  --absent ${OUT}/plugin_no_sequence_ratio.json
  -- ${LV} run ${CASES}/rl-gspo-cp2-tp2.json --impl plugin:${FAULTY} --report ${OUT}/plugin_no_sequence_ratio.json)
set(GSPO_CASES ${OUT}/plugin_gspo_cases)
add_test(NAME cli_plugin_gate_skips_sequence_ratio
  COMMAND bash -c "rm -rf ${GSPO_CASES} && mkdir -p ${GSPO_CASES} && cp ${CASES}/rl-gspo-cp2-tp2.json ${GSPO_CASES}/ && \
    bash ${EXPECT} 1 'NOTHING RAN' -- ${LV} gate --impl plugin:${FAULTY} --cases ${GSPO_CASES} \
      --golden ${PROJECT_SOURCE_DIR}/golden")
# A plugin built before the policy loss (against the frozen version 1 header in tests/plugins/v1/) still loads
# and passes cross-entropy, on thread ranks, over a CP sweep and under both smoothing conventions; a policy case is
# refused before any work, naming the plugin and the loss, as for any plugin that does not declare the kind.
set(V1_PLUGIN $<TARGET_FILE:lossverify_test_v1_cross_entropy_plugin>)
lossverify_cli_test(plugin_v1_cross_entropy 0 "verdict: pass"
  -- ${LV} run ${CASES}/dp-unequal-tokens.json --impl plugin:${V1_PLUGIN} --threads 2)
lossverify_cli_test(plugin_v1_cross_entropy_cp_sweep 0 "invariance: pass"
  -- ${LV} run ${CASES}/cp-zigzag-packed.json --impl plugin:${V1_PLUGIN} --sweep cp=1,2 tp=1,2 --threads 2)
lossverify_cli_test(plugin_v1_smoothing_pytorch 0 "verdict: pass"
  -- ${LV} run ${CASES}/smoothing-pytorch.json --impl plugin:${V1_PLUGIN} --threads 2)
lossverify_cli_test(plugin_v1_refuses_policy 2 "the plugin plugin:.*v1_cross_entropy.* does not compute policy losses"
  --absent ${OUT}/plugin_v1_policy.json
  -- ${LV} run ${CASES}/rl-grpo-tp2-dp2-ga2.json --impl plugin:${V1_PLUGIN} --report ${OUT}/plugin_v1_policy.json)
# The policy kind's outputs: per-row values and logged statistics of the wrong sizes, or written past their
# buffer, are exit 3 naming the plugin and the rank.
function(lossverify_plugin_policy_fault name regex fault)
  lossverify_cli_test(plugin_policy_fault_${name} 3 ${regex} --within 30 --absent ${OUT}/plugin_policy_${name}.json
    -- ${LV} run ${CASES}/rl-grpo-tp2-dp2-ga2.json --impl "plugin:${FAULTY}?fault=${fault}" --timeout 2
       --report ${OUT}/plugin_policy_${name}.json)
endfunction()
lossverify_plugin_policy_fault(values "rank 1: plugin plugin:.*: wrote [0-9]+ x 2 per-row values" values@1)
lossverify_plugin_policy_fault(statistics "rank 2: plugin plugin:.*: wrote 3 logged statistics" statistics@2)
lossverify_plugin_policy_fault(values_overrun "rank 0: plugin plugin:.*: wrote past the end of its per-row value buffer"
  values-overrun@0)
lossverify_plugin_policy_fault(values_far "rank 3: plugin plugin:.*: wrote past the end of its per-row value buffer"
  values-far@3)
# The head's outputs (LV_SUPPORTS_LM_HEAD): a wrong count, or a write past one, is exit 3 naming the plugin and the rank.
function(lossverify_plugin_head_fault name regex fault)
  lossverify_cli_test(plugin_head_fault_${name} 3 ${regex} --within 30 --absent ${OUT}/plugin_head_${name}.json
    -- ${LV} run ${CASES}/head-ce-sp-tp4-cp2-ga2.json --impl "plugin:${FAULTY}?fault=${fault}" --timeout 2
       --report ${OUT}/plugin_head_${name}.json)
endfunction()
lossverify_plugin_head_fault(count
  "rank 1: plugin plugin:.*: wrote [0-9]+ dh elements \\(head_dh_count\\), but the rank's head has [0-9]+ \\(head_dh_rows x head_hidden\\)"
  head-count@1)
lossverify_plugin_head_fault(overrun "rank 2: plugin plugin:.*: wrote past the end of its head dW buffer" head-overrun@2)
lossverify_cli_test(plugin_bad_parameter 2 "the plugin refuses its parameters \"bug=nope\": unknown parameter"
  -- ${LV} run ${PLUGIN_CASE} --impl "plugin:${CPU_PLUGIN}?bug=nope")
lossverify_cli_test(plugin_host_on_cuda 2 "--backend cuda: the plugin .* computes in host memory"
  -- ${LV} run ${PLUGIN_CASE} --impl plugin:${CPU_PLUGIN} --backend cuda)
set(PLUGIN_REPRO ${OUT}/plugin_repro)
add_test(NAME cli_plugin_bundle_replays
  COMMAND bash -c "rm -rf ${PLUGIN_REPRO} && mkdir -p ${PLUGIN_REPRO} && \
    bash ${EXPECT} 1 'rank_agreement +FAIL' -- ${LV} run ${CASES}/smoothing-pytorch.json \
      --impl 'plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab' --save-inputs failed --save-inputs-dir ${PLUGIN_REPRO} && \
    bash ${EXPECT} 0 '^reproduced: FAIL as recorded' -- ${LV} replay ${PLUGIN_REPRO}/*.bundle.json \
      --impl 'plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab' && \
    bash ${EXPECT} 0 'with --impl correct: pass' -- ${LV} replay ${PLUGIN_REPRO}/*.bundle.json --impl correct")
# A head case through the plugin: its bundle replays with the same plugin and bug to the same verdict.
set(PLUGIN_HEAD_REPRO ${OUT}/plugin_head_repro)
add_test(NAME cli_plugin_head_bundle_replays
  COMMAND bash -c "rm -rf ${PLUGIN_HEAD_REPRO} && mkdir -p ${PLUGIN_HEAD_REPRO} && \
    bash ${EXPECT} 1 'dh +FAIL' -- ${LV} run ${CASES}/head-kd-tp4-cp2-ga2.json \
      --impl 'plugin:${CPU_PLUGIN}?bug=head-dh-shard-partial' --save-inputs failed --save-inputs-dir ${PLUGIN_HEAD_REPRO} && \
    bash ${EXPECT} 0 '^reproduced: FAIL as recorded' -- ${LV} replay ${PLUGIN_HEAD_REPRO}/*.bundle.json \
      --impl 'plugin:${CPU_PLUGIN}?bug=head-dh-shard-partial' && \
    bash ${EXPECT} 0 'with --impl correct: pass' -- ${LV} replay ${PLUGIN_HEAD_REPRO}/*.bundle.json --impl correct")
# A bundle is data: replay never loads the library it names unless the command line names it too (issue 30: an
# edited bundle ran any library, even under --impl correct). The library here would crash if it were loaded.
set(TAMPERED ${OUT}/plugin_tampered)
add_test(NAME cli_replay_never_loads_the_bundles_library
  COMMAND bash -c "rm -rf ${TAMPERED} && mkdir -p ${TAMPERED} && \
    ${LV} run ${CASES}/smoothing-pytorch.json --impl smoothing-partition-vocab --save-inputs failed --save-inputs-dir ${TAMPERED} -q; \
    bundle=$(ls ${TAMPERED}/*.bundle.json) && \
    sed -i 's|\"implementation\": \"smoothing-partition-vocab\"|\"implementation\": \"plugin:${FAULTY}?fault=params-exit\"|' $bundle && \
    grep -q params-exit $bundle && \
    bash ${EXPECT} 2 'a bundle never loads a library by itself' -- ${LV} replay $bundle && \
    env LOSSVERIFY_TEST_LOAD_FAULT=ctor-crash bash ${EXPECT} 0 'with --impl correct: pass' -- ${LV} replay $bundle --impl correct")
add_test(NAME cli_plugin_cuda COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cuda_plugin.sh ${LV}
  $<$<TARGET_EXISTS:lossverify_example_cuda_plugin>:$<TARGET_FILE:lossverify_example_cuda_plugin>> ${CASES})
set_tests_properties(cli_plugin_cuda PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
# Without a GPU, a plugin that computes in device memory is a usage error naming why, before any work (issue
# 30: exit 3, "internal error"). Where a GPU is visible there is nothing to test (77).
if(TARGET lossverify_example_cuda_plugin)
  add_test(NAME cli_plugin_cuda_without_a_gpu
    COMMAND bash -c "if ${LV} --version | grep -q 'CUDA GPUs visible now: [1-9]'; then echo 'a GPU is visible'; exit 77; fi; \
      bash ${EXPECT} 2 'the plugin computes in CUDA device memory, and this machine cannot run it' \
        -- ${LV} run ${PLUGIN_CASE} --impl plugin:$<TARGET_FILE:lossverify_example_cuda_plugin>")
  set_tests_properties(cli_plugin_cuda_without_a_gpu PROPERTIES SKIP_RETURN_CODE 77)
endif()
lossverify_cli_test(plugin_shrink 0 "layout      tp=4 cp=1 dp=1 ga=1 -> tp=2" --present ${OUT}/plugin_shrunk.json
  -- ${LV} shrink ${CASES}/smoothing-pytorch.json --impl "plugin:${CPU_PLUGIN}?bug=smoothing-partition-vocab"
     --out ${OUT}/plugin_shrunk.json --threads 1)
# gate --timeout, as run's (issue 30: the gate had none, so a hanging plugin held it for each case's 120 s).
lossverify_cli_test(plugin_gate_timeout 4 "timeout: .*no collective call and no result for 1 s" --within 60
  -- ${LV} gate --impl "plugin:${FAULTY}?fault=hang@0" --timeout 1 --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden)
