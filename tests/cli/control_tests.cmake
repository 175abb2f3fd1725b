# The control band (docs/checks.md): its column on a bf16 case (the correct run on its float32 control, a bug
# above both), --no-control, check-dump's column on a dump's own inputs, and --junit with each check's control
# margins as properties.
set(CONTROL_DUMPS ${PROJECT_SOURCE_DIR}/tests/data/dumps)
lossverify_cli_test(control_column_correct_bf16 0 "grad +pass +0\\.5 +0\\.5 / [0-9.]+ +[0-9]"
  -- ${LV} run ${CASES}/smoothing-megatron.json --threads 2)
lossverify_cli_test(control_column_bug_above 1 "grad +FAIL +[0-9.e+]+ +0\\.5 / [0-9.]+ above"
  -- ${LV} run ${CASES}/smoothing-megatron.json --impl smoothing-partition-vocab --threads 2)
lossverify_cli_test(control_note_within 1 "note: grad fails within the control band: computing in bf16"
  -- ${LV} run ${CASES}/rl-gspo-cp2-tp2.json --impl rl-logprob-16bit --threads 2)
lossverify_cli_test(control_column_fp32 0 "loss +pass +[0-9.e-]+ +[0-9.e-]+ +[0-9]"
  -- ${LV} run ${CASES}/smoothing-pytorch.json --threads 2)
add_test(NAME cli_control_off
  COMMAND bash -c "out=$(\"$0\" run \"$1\" --threads 2 --no-control) && echo \"$out\" && ! grep -q control <<< \"$out\""
          ${LV} ${CASES}/smoothing-megatron.json)
lossverify_cli_test(control_check_dump 1 "grad +FAIL +[0-9.e+]+ +0\\.5 / [0-9.]+ above"
  -- ${LV} check-dump ${CONTROL_DUMPS}/torch-vocab-parallel-ce-tp2-dp2-bf16-smoothing-partition-vocab/manifest.json)
lossverify_cli_test(control_impl_refused_on_cuda 2 "correct-16bit: the 16-bit control runs on the CPU backend only"
  -- ${LV} run ${CASES}/smoothing-megatron.json --impl correct-16bit --backend cuda)
lossverify_cli_test(junit_same_as_report 2 "--junit .*: is the same file as --report"
  --absent ${OUT}/same.json -- ${LV} run ${CASES}/smoothing-pytorch.json --report ${OUT}/same.json --junit ${OUT}/same.json)
# The same file by another spelling: ./, sub/.., a symbolic link, a --plot; check-dump and gate as run.
add_test(NAME cli_outputs_compared_by_the_file_they_land_in
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/distinct_outputs.sh ${LV} ${CASES} ${PROJECT_SOURCE_DIR}/golden
          ${OUT}/distinct_outputs)
lossverify_cli_test(control_junit_run 1 "JUnit written to"
  -- ${LV} run ${CASES}/smoothing-megatron.json --impl smoothing-partition-vocab --threads 2
     --report ${OUT}/control.json --junit ${OUT}/control.xml)
lossverify_cli_test(control_junit_dump 0 "JUnit written to"
  -- ${LV} check-dump ${CONTROL_DUMPS}/torch-vocab-parallel-ce-tp2-dp2-bf16/manifest.json
     --report ${OUT}/control_dump.json --junit ${OUT}/control_dump.xml)
add_test(NAME cli_control_junit_properties
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "
import sys, xml.etree.ElementTree as E
run = E.parse(sys.argv[1]).getroot()
cases = {c.get('name'): c for c in run.iter('testcase')}
props = {p.get('name'): p.get('value') for p in cases['grad'].iter('property')}
assert set(props) == {'margin', 'control.float32', 'control.bf16', 'control.reading'}, props
assert props['control.reading'] == 'above' and float(props['margin']) > 10 * float(props['control.bf16']), props
assert cases['grad'].find('failure') is not None and cases['stats'].find('failure') is None
dump = E.parse(sys.argv[2]).getroot()
assert dump.get('failures') == '0' and int(dump.get('tests')) == 6, dump.attrib
print('ok', props)" ${OUT}/control.xml ${OUT}/control_dump.xml)
set_tests_properties(cli_control_junit_properties PROPERTIES DEPENDS "cli_control_junit_run;cli_control_junit_dump")
add_test(NAME cli_control_report_schema
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/validate_report.py
          ${PROJECT_SOURCE_DIR}/schema/report.schema.json ${OUT}/control.json ${OUT}/control_dump.json)
set_tests_properties(cli_control_report_schema PROPERTIES DEPENDS "cli_control_junit_run;cli_control_junit_dump")
