# CLI tests through CTest: exit codes, messages, reports, faults. Each runs the real binary.
set(LV $<TARGET_FILE:lossverify>)
set(EXPECT ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect.sh)
set(CASES ${PROJECT_SOURCE_DIR}/cases)
set(OUT ${CMAKE_CURRENT_BINARY_DIR}/cli_out)
file(MAKE_DIRECTORY ${OUT})

function(lossverify_cli_test name code regex)
  add_test(NAME cli_${name} COMMAND bash ${EXPECT} ${code} ${regex} ${ARGN})
endfunction()

lossverify_cli_test(version 0 "lossverify [0-9]+\\.[0-9]+\\.[0-9]+ \\(git" -- ${LV} --version)
lossverify_cli_test(help 0 "exit codes: 0 all checks pass" -- ${LV} --help)
lossverify_cli_test(no_command 2 "A subcommand is required" -- ${LV})
lossverify_cli_test(list 0 "source: Megatron-LM tensor_parallel/cross_entropy.py" -- ${LV} list)
lossverify_cli_test(list_json 0 "\"caught_by\"" -- ${LV} list --json)
lossverify_cli_test(unknown_option 2 "frobnicate" -- ${LV} run ${CASES}/smoothing-pytorch.json --frobnicate)
lossverify_cli_test(missing_case_file 2 "does not exist" -- ${LV} run ${CASES}/no-such-case.json)
lossverify_cli_test(unknown_impl 2 "--impl no-such-bug: unknown implementation"
  --absent ${OUT}/unknown_impl.json -- ${LV} run ${CASES}/smoothing-pytorch.json --impl no-such-bug --report ${OUT}/unknown_impl.json)
lossverify_cli_test(bad_set 2 "expected key=value" -- ${LV} run ${CASES}/smoothing-pytorch.json --set nonsense)

# Every shipped case passes with the correct implementation.
file(GLOB shipped_cases ${PROJECT_SOURCE_DIR}/cases/*.json)
foreach(case_file ${shipped_cases})
  get_filename_component(case_name ${case_file} NAME_WE)
  lossverify_cli_test(pass_${case_name} 0 "verdict: pass" -- ${LV} run ${case_file} --threads 2)
endforeach()

# The catalogued bugs fail with the expected checks; exit code 1.
lossverify_cli_test(bug_partition_vocab 1 "rank_agreement +FAIL"
  -- ${LV} run ${CASES}/smoothing-pytorch.json --impl smoothing-partition-vocab)
lossverify_cli_test(bug_partition_vocab_invisible_at_tp1 0 "verdict: pass"
  -- ${LV} run ${CASES}/smoothing-pytorch.json --impl smoothing-partition-vocab --tp 1)
lossverify_cli_test(bug_partition_vocab_invisible_without_smoothing 0 "verdict: pass"
  -- ${LV} run ${CASES}/smoothing-pytorch.json --impl smoothing-partition-vocab --set loss.label_smoothing=0)
lossverify_cli_test(bug_log_after_exp 1 "finite +FAIL"
  -- ${LV} run ${CASES}/underflow-gap-240.json --impl smoothing-log-after-exp)

# Faults: a throwing rank (exit 3) and a hanging rank (exit 4) end the run quickly, with no report.
lossverify_cli_test(fault_throw 3 "rank 1: injected fault" --within 20 --absent ${OUT}/fault_throw.json
  -- ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault throw@1 --report ${OUT}/fault_throw.json)
lossverify_cli_test(fault_hang 4 "deadlock guard: .* rank\\(s\\) 2 never arrived" --within 20
  --absent ${OUT}/fault_hang.json
  -- ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault hang@2 --timeout 1 --report ${OUT}/fault_hang.json)
# The same faults after the groups are set up (where a GPU run's NCCL groups exist): the others stop.
lossverify_cli_test(fault_late_throw 3 "rank 1: injected fault: this rank threw after its groups" --within 20
  --absent ${OUT}/fault_late_throw.json
  -- ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault late-throw@1 --report ${OUT}/fault_late_throw.json)
lossverify_cli_test(fault_late_hang 4 "deadlock guard: .* rank\\(s\\) 2 never arrived" --within 20
  --absent ${OUT}/fault_late_hang.json
  -- ${LV} run ${CASES}/uneven-shards-v507-tp4.json --inject-fault late-hang@2 --timeout 1 --report ${OUT}/fault_late_hang.json)

# Malformed case files: exit 2, a message naming file and JSON path, and no report.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/cli/bad_cases.txt)
file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/cli/bad_cases.txt bad_case_lines REGEX "^[^#]")
foreach(line ${bad_case_lines})
  string(FIND "${line}" "|" bar)
  string(SUBSTRING "${line}" 0 ${bar} file)
  math(EXPR after "${bar} + 1")
  string(SUBSTRING "${line}" ${after} -1 regex)
  get_filename_component(name ${file} NAME_WE)
  lossverify_cli_test(bad_case_${name} 2 "${regex}" --absent ${OUT}/bad_${name}.json
    -- ${LV} run ${CMAKE_CURRENT_SOURCE_DIR}/data/bad_cases/${file} --report ${OUT}/bad_${name}.json)
endforeach()
# One bad file among good ones: nothing runs, no report.
lossverify_cli_test(bad_case_among_good 2 "unknown_top_key.json: \\$\\.lyout" --absent ${OUT}/mixed.json
  -- ${LV} run ${CASES}/smoothing-pytorch.json ${CMAKE_CURRENT_SOURCE_DIR}/data/bad_cases/unknown_top_key.json
     --report ${OUT}/mixed.json)

# Reports: written for passing and failing runs, valid against the versioned schema.
find_program(LOSSVERIFY_SYSTEM_PYTHON python3 PATHS /usr/bin NO_DEFAULT_PATH)
list(LENGTH shipped_cases shipped_count)
lossverify_cli_test(report_all_cases 0 "${shipped_count} passed, 0 failed" --present ${OUT}/all.json
  -- ${LV} run ${shipped_cases} --report ${OUT}/all.json --threads 2)
lossverify_cli_test(report_failing_run 1 "verdict: FAIL" --present ${OUT}/failing.json
  -- ${LV} run ${CASES}/underflow-gap-240.json ${CASES}/smoothing-pytorch.json --impl smoothing-log-after-exp
     --report ${OUT}/failing.json)
lossverify_cli_test(report_partition_vocab 1 "verdict: FAIL" --present ${OUT}/partition.json
  -- ${LV} run ${CASES}/uneven-shards-v507-tp4.json --impl smoothing-partition-vocab --report ${OUT}/partition.json)
# Sweeps: every layout passes and the invariance check holds; a layout-dependent bug breaks invariance.
lossverify_cli_test(sweep_correct 0 "invariance: pass" --present ${OUT}/sweep.json
  -- ${LV} run ${CASES}/full-4d-layout.json --sweep tp=1,2 cp=1,2 dp=1,3 --report ${OUT}/sweep.json)
lossverify_cli_test(sweep_catches_dp_local_mean 1 "invariance: FAIL"
  -- ${LV} run ${CASES}/dp-unequal-tokens.json --impl dp-local-mean --sweep dp=1,2,4)
lossverify_cli_test(sweep_bad_argument 2 "--sweep tp=1,x: \"x\" is not a count"
  -- ${LV} run ${CASES}/full-4d-layout.json --sweep tp=1,x)

# The gate: every shipped case x every implementation matches golden/, JSON report and JUnit XML.
lossverify_cli_test(gate 0 "gate: PASS" --present ${OUT}/gate.json --present ${OUT}/gate.xml
  -- ${LV} gate --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --report ${OUT}/gate.json
     --junit ${OUT}/gate.xml)
set_tests_properties(cli_gate PROPERTIES TIMEOUT 600 COST 100)  # long tests first (python_tests.cmake)
# The gate on a GPU (skipped where none is), and what it refuses on any machine.
add_test(NAME cli_gate_cuda COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cuda_gate.sh ${LV} ${CASES} ${OUT}/gate_cuda)
set_tests_properties(cli_gate_cuda PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
lossverify_cli_test(gate_gpus_without_cuda 2 "--gpus needs --backend cuda"
  -- ${LV} gate --gpus 2 --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden)
lossverify_cli_test(gate_cuda_update_golden 2 "golden outcomes are written from the CPU backend"
  -- bash -c "rm -rf ${OUT}/golden_cuda && cp -r ${PROJECT_SOURCE_DIR}/golden ${OUT}/golden_cuda && \
               ${LV} gate --backend cuda --update-golden --cases ${CASES} --golden ${OUT}/golden_cuda")
# Replay parity: every run of the gate's order in one process gives the report it gives alone in a fresh one
# (the correct cells and every sweep layout), on the CPU and, where two GPUs are, over them (skipped elsewhere).
add_test(NAME cli_replay_parity_cpu
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/replay_parity.py ${LV} ${OUT}/replay_cpu
          --backend cpu --jobs 2 --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden)
add_test(NAME cli_replay_parity_cuda_2gpus
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/replay_parity.py ${LV} ${OUT}/replay_cuda
          --backend cuda --gpus 2 --jobs 4 --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden)
set_tests_properties(cli_replay_parity_cpu cli_replay_parity_cuda_2gpus PROPERTIES TIMEOUT 900 COST 100)
set_tests_properties(cli_replay_parity_cuda_2gpus PROPERTIES SKIP_RETURN_CODE 77)
lossverify_cli_test(gate_run_reports 0 "gate: PASS" --present ${OUT}/gate_runs/rl-grpo-tp2-dp2-ga2__correct.json
  --present ${OUT}/gate_runs/rl-grpo-tp2-dp2-ga2__sweep.json
  -- bash -c "rm -rf ${OUT}/gate_runs && ${LV} gate --impl correct --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden \
              --run-reports ${OUT}/gate_runs")
# A gate whose every cell is skipped (a cross-entropy bug over a KD case alone) ran nothing: it does not pass.
lossverify_cli_test(gate_nothing_ran 1 "NOTHING RAN: every cell was skipped"
  -- bash -c "rm -rf ${OUT}/kd_only && mkdir -p ${OUT}/kd_only && cp ${CASES}/kd-tp4-temperature2.json ${OUT}/kd_only/ && \
              ${LV} gate --impl smoothing-partition-vocab --cases ${OUT}/kd_only --golden ${PROJECT_SOURCE_DIR}/golden")
lossverify_cli_test(gate_run_reports_not_empty 2 "--run-reports .*: the folder is not empty"
  -- ${LV} gate --cases ${CASES} --golden ${PROJECT_SOURCE_DIR}/golden --run-reports ${CASES})
# A golden outcome that disagrees makes the gate fail, naming the cell; nothing is rewritten silently.
add_test(NAME cli_gate_detects_golden_drift
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/gate_drift.sh ${LV} ${PROJECT_SOURCE_DIR}/cases
          ${PROJECT_SOURCE_DIR}/golden ${OUT}/drift)

add_test(NAME cli_report_schema
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/validate_report.py
          ${PROJECT_SOURCE_DIR}/schema/report.schema.json ${OUT}/all.json ${OUT}/failing.json ${OUT}/partition.json
          ${OUT}/sweep.json ${OUT}/gate.json)
set_tests_properties(cli_report_schema PROPERTIES
  DEPENDS "cli_report_all_cases;cli_report_failing_run;cli_report_partition_vocab;cli_sweep_correct;cli_gate")
add_test(NAME cli_junit_wellformed
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); assert r.tag == 'testsuites' and int(r.get('tests')) > 0 and r.get('failures') == '0', r.attrib; print('ok', r.attrib)" ${OUT}/gate.xml)
set_tests_properties(cli_junit_wellformed PROPERTIES DEPENDS cli_gate)

if(LOSSVERIFY_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  include(${CMAKE_CURRENT_SOURCE_DIR}/cli/mpi_tests.cmake)
endif()

add_test(NAME cli_cuda_backend COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cuda_cli.sh ${LV} ${CASES}/smoothing-pytorch.json)

# 512 thread ranks (tp=8, cp=4, dp=16, ga=2) on a small case: splits, collectives and verification scale.
lossverify_cli_test(r512_thread_ranks 0 "tp=8 cp=4 dp=16 ga=2.*|verdict: pass" --within 120
  -- ${LV} run ${PROJECT_SOURCE_DIR}/bench/cases/r512-tp8-cp4-dp16.json --threads 2)

# export-inputs: writes every rank's file and the index; a bad layout or a folder in use is exit 2, untouched.
lossverify_cli_test(export_inputs 0 "exported 8 rank\\(s\\) of case cp-zigzag-packed.*tp=2 cp=2 dp=2"
  --present ${OUT}/export/inputs.json --present ${OUT}/export/rank7.safetensors
  -- bash -c "rm -rf ${OUT}/export && ${LV} export-inputs ${CASES}/cp-zigzag-packed.json --dp 2 --out ${OUT}/export")
# An LM head case: h per row, W and b of the rank's shard in place of the logits (docs/dumps.md).
lossverify_cli_test(export_inputs_head 0 "rank 0 holds h, W, b, labels, loss_mask"
  --present ${OUT}/export_head/rank7.safetensors
  -- bash -c "rm -rf ${OUT}/export_head && ${LV} export-inputs ${CASES}/head-ce-bias-upstream-tp4-cp2.json --out ${OUT}/export_head >/dev/null && python3 -c 'print(\"rank 0 holds\", \", \".join(__import__(\"json\").load(open(__import__(\"sys\").argv[1]))[\"ranks\"][0][\"tensors\"]))' ${OUT}/export_head/inputs.json")
lossverify_cli_test(export_inputs_tp_above_vocab 2 "layout.tp.*300" --absent ${OUT}/export_wide/inputs.json
  -- ${LV} export-inputs ${CASES}/cp-zigzag-packed.json --tp 301 --out ${OUT}/export_wide)
lossverify_cli_test(export_inputs_folder_in_use 2 "not empty .*nothing was written"
  -- bash -c "mkdir -p ${OUT}/export_busy && touch ${OUT}/export_busy/mine && ${LV} export-inputs ${CASES}/cp-zigzag-packed.json --out ${OUT}/export_busy")
# --rank: one process of a distributed launch regenerates its own rank's file, bit for bit the full export's,
# and the same index; a rank outside the layout is exit 2 with nothing written.
lossverify_cli_test(export_inputs_one_rank 0 "exported rank 5 of 8 rank\\(s\\)"
  --present ${OUT}/export_rank5/rank5.safetensors --absent ${OUT}/export_rank5/rank0.safetensors
  -- bash -c "rm -rf ${OUT}/export_rank5 && ${LV} export-inputs ${CASES}/cp-zigzag-packed.json --dp 2 --rank 5 --out ${OUT}/export_rank5 && \
              cmp ${OUT}/export_rank5/rank5.safetensors ${OUT}/export/rank5.safetensors && \
              cmp ${OUT}/export_rank5/inputs.json ${OUT}/export/inputs.json")
set_tests_properties(cli_export_inputs_one_rank PROPERTIES DEPENDS cli_export_inputs)
lossverify_cli_test(export_inputs_rank_outside 2 "--rank 8: outside the layout's 8 ranks" --absent ${OUT}/export_rank8
  -- ${LV} export-inputs ${CASES}/cp-zigzag-packed.json --dp 2 --rank 8 --out ${OUT}/export_rank8)
# export-inputs refuses a case whose largest rank cannot fit in memory before it writes anything (issue 30: it
# ended in std::bad_alloc, exit 3).
lossverify_cli_test(export_inputs_too_big 2 "needs (about|at least) .* MiB for (the largest rank's|a rank's) shard"
  --absent ${OUT}/export_big
  -- ${LV} export-inputs ${CASES}/smoothing-pytorch.json --set shape.tokens=400000 --set shape.vocab=400000 --out ${OUT}/export_big)
# ... and at once, before its inputs are set up (their per-token arrays took 17 to 27 s for N = 1e8), as run does.
lossverify_cli_test(export_inputs_too_big_refused_at_once 2 "needs at least .* MiB for a rank's shard" --within 5
  --absent ${OUT}/export_huge
  -- ${LV} export-inputs ${CASES}/smoothing-pytorch.json --set shape.tokens=100000000 --set shape.vocab=200000
     --out ${OUT}/export_huge)
# run takes the whole layout on the command line, as export-inputs and the Python package do.
lossverify_cli_test(run_layout_options 0 "tp=2 cp=1 dp=2 ga=2\\]  impl correct"
  -- ${LV} run ${CASES}/full-4d-layout.json --tp 2 --cp 1 --dp 2 --ga 2 --threads 2)
# bench --gpus splits the vocabulary over the GPUs itself: --tp beside it is a usage error (no GPU needed).
lossverify_cli_test(bench_gpus_with_tp 2 "leave --tp out" -- ${LV} bench --gpus 2 --tp 2)

# docs/catalogue.md's bug table is `lossverify list --json`, rendered (scripts/catalogue_table.py); the
# check fails on a table that drifted (a copy with one source changed).
add_test(NAME docs_catalogue_matches_list
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/catalogue_table.py $<TARGET_FILE:lossverify>
          --check ${PROJECT_SOURCE_DIR}/docs/catalogue.md)
add_test(NAME docs_catalogue_check_catches_drift
  COMMAND bash -c "sed 's/TransformerEngine issue #2476/TransformerEngine issue #9999/' \
    ${PROJECT_SOURCE_DIR}/docs/catalogue.md > ${CMAKE_CURRENT_BINARY_DIR}/catalogue-drifted.md && \
    ! ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/catalogue_table.py $<TARGET_FILE:lossverify> \
      --check ${CMAKE_CURRENT_BINARY_DIR}/catalogue-drifted.md")

# The Python package's copy of the kinds' settings tables is `lossverify list --json` (scripts/kind_settings.py);
# the check fails on a copy with one fallback changed.
add_test(NAME python_kind_settings_match_list
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/kind_settings.py $<TARGET_FILE:lossverify> --check)
add_test(NAME python_kind_settings_check_catches_drift
  COMMAND bash -c "sed 's/\"default\": 0.2,/\"default\": 0.3,/' \
    ${PROJECT_SOURCE_DIR}/python/lossverify/kind_settings.json > ${CMAKE_CURRENT_BINARY_DIR}/kind-settings-drifted.json && \
    ! cmp -s ${PROJECT_SOURCE_DIR}/python/lossverify/kind_settings.json ${CMAKE_CURRENT_BINARY_DIR}/kind-settings-drifted.json && \
    ! ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/kind_settings.py $<TARGET_FILE:lossverify> \
      --check ${CMAKE_CURRENT_BINARY_DIR}/kind-settings-drifted.json")

# The seams of src/lossverify hold (scripts/check_layering.sh), and the check fails on a copy of checks/
# that includes a backend header.
add_test(NAME layering_seams_hold COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/check_layering.sh)
add_test(NAME layering_check_catches_a_violation
  COMMAND bash -c "rm -rf ${CMAKE_CURRENT_BINARY_DIR}/layering && mkdir -p ${CMAKE_CURRENT_BINARY_DIR}/layering && \
    cp -r ${PROJECT_SOURCE_DIR}/src/lossverify/checks ${CMAKE_CURRENT_BINARY_DIR}/layering/ && \
    echo '#include \"lossverify/impl/cpu/sharded_loss.hpp\"' >> ${CMAKE_CURRENT_BINARY_DIR}/layering/checks/checks.cpp && \
    ! bash ${PROJECT_SOURCE_DIR}/scripts/check_layering.sh ${CMAKE_CURRENT_BINARY_DIR}/layering")
# ... and on a copy of kinds/ whose cross-entropy reference includes its kernel math.
add_test(NAME layering_check_catches_a_kind_reference_on_its_kernels
  COMMAND bash -c "rm -rf ${CMAKE_CURRENT_BINARY_DIR}/layering-kinds && mkdir -p ${CMAKE_CURRENT_BINARY_DIR}/layering-kinds && \
    cp -r ${PROJECT_SOURCE_DIR}/src/lossverify/kinds ${CMAKE_CURRENT_BINARY_DIR}/layering-kinds/ && \
    bash ${PROJECT_SOURCE_DIR}/scripts/check_layering.sh ${CMAKE_CURRENT_BINARY_DIR}/layering-kinds && \
    echo '#include \"lossverify/kinds/cross_entropy/cross_entropy_math.hpp\"' >> \
      ${CMAKE_CURRENT_BINARY_DIR}/layering-kinds/kinds/cross_entropy/cross_entropy_reference.cpp && \
    ! bash ${PROJECT_SOURCE_DIR}/scripts/check_layering.sh ${CMAKE_CURRENT_BINARY_DIR}/layering-kinds")

# ... and on a copy of runner/ that includes a kind's own header instead of reaching it through kind_api/.
add_test(NAME layering_check_catches_an_include_into_the_kinds
  COMMAND bash -c "rm -rf ${CMAKE_CURRENT_BINARY_DIR}/layering-up && mkdir -p ${CMAKE_CURRENT_BINARY_DIR}/layering-up && \
    cp -r ${PROJECT_SOURCE_DIR}/src/lossverify/runner ${CMAKE_CURRENT_BINARY_DIR}/layering-up/ && \
    bash ${PROJECT_SOURCE_DIR}/scripts/check_layering.sh ${CMAKE_CURRENT_BINARY_DIR}/layering-up && \
    echo '#include \"lossverify/kinds/policy/policy_parts.hpp\"' >> ${CMAKE_CURRENT_BINARY_DIR}/layering-up/runner/run_case.cpp && \
    ! bash ${PROJECT_SOURCE_DIR}/scripts/check_layering.sh ${CMAKE_CURRENT_BINARY_DIR}/layering-up")

# The tree follows .clang-format (scripts/check_format.sh), and the check fails on a mis-formatted copy.
add_test(NAME format_follows_clang_format COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/check_format.sh
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
add_test(NAME format_check_catches_a_violation
  COMMAND bash -c "mkdir -p ${CMAKE_CURRENT_BINARY_DIR}/format && \
    sed 's/^  \\(const auto byte\\)/      \\1/' ${PROJECT_SOURCE_DIR}/src/lossverify/core/strings.cpp \
      > ${CMAKE_CURRENT_BINARY_DIR}/format/strings.cpp && \
    ! cmp -s ${PROJECT_SOURCE_DIR}/src/lossverify/core/strings.cpp ${CMAKE_CURRENT_BINARY_DIR}/format/strings.cpp && \
    ! bash ${PROJECT_SOURCE_DIR}/scripts/check_format.sh ${CMAKE_CURRENT_BINARY_DIR}/format/strings.cpp")
