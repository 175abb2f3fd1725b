# Reproducing and seeing a failure: run --save-inputs / --plot, replay, shrink. Included from
# tests/CMakeLists.txt after cli_tests.cmake (uses LV, EXPECT, CASES, OUT, LOSSVERIFY_SYSTEM_PYTHON and
# lossverify_cli_test from there).
set(REPRO ${OUT}/repro)
file(MAKE_DIRECTORY ${REPRO} ${REPRO}/pass ${REPRO}/sweep ${REPRO}/always)
set(CP_BUNDLE ${REPRO}/cp-zigzag-packed.cp-roll-after-split.bundle.json)

# A catalogued bug: the failing run writes its bundle (next to --save-inputs-dir), a plot and the report.
lossverify_cli_test(repro_save_inputs 1 "reproducer bundle written to .*cp-zigzag-packed\\.cp-roll-after-split\\.bundle\\.json"
  --present ${CP_BUNDLE} --present ${REPRO}/cp.html --present ${REPRO}/cp.report.json
  -- ${LV} run ${CASES}/cp-zigzag-packed.json --impl cp-roll-after-split --save-inputs failed
     --save-inputs-dir ${REPRO} --plot ${REPRO}/cp.html --report ${REPRO}/cp.report.json --threads 2)
set_tests_properties(cli_repro_save_inputs PROPERTIES FIXTURES_SETUP repro_bundle)

# Replay reproduces it (exit 0); with the fix it passes and says so (the run's own exit code).
lossverify_cli_test(repro_replay 0 "reproduced: FAIL as recorded: loss, grad, stats fail with their worst elements where recorded"
  -- ${LV} replay ${CP_BUNDLE} --threads 2)
lossverify_cli_test(repro_replay_with_fix 0 "with --impl correct: pass.*recorded with cp-roll-after-split: FAIL"
  -- ${LV} replay ${CP_BUNDLE} --impl correct --threads 2)
# A bundle whose implementation was swapped for the correct one: the recorded failures do not come back.
add_test(NAME cli_repro_replay_did_not_reproduce
  COMMAND bash -c "${LOSSVERIFY_SYSTEM_PYTHON} -c \"import json,sys; b=json.load(open(sys.argv[1])); b['implementation']='correct'; json.dump(b, open(sys.argv[2],'w'))\" ${CP_BUNDLE} ${REPRO}/swapped.bundle.json && bash ${EXPECT} 1 '^  check loss was fail, now pass \\(margin' -- ${LV} replay ${REPRO}/swapped.bundle.json --threads 2")
# Malformed bundles: exit 2, the file and the JSON field named, no report.
add_test(NAME cli_repro_tampered_bundles
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/repro_tamper.sh ${EXPECT} ${LV} ${LOSSVERIFY_SYSTEM_PYTHON} ${CP_BUNDLE}
          ${REPRO}/tampered)
# The plot: well-formed XHTML with inline SVG; tp=2 x cp=2 ranks, every gradient shard off.
add_test(NAME cli_repro_plot_wellformed
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/check_plot.py ${REPRO}/cp.html 4 4)
add_test(NAME cli_repro_report_schema
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/validate_report.py
          ${PROJECT_SOURCE_DIR}/schema/report.schema.json ${REPRO}/cp.report.json)
set_tests_properties(cli_repro_replay cli_repro_replay_with_fix cli_repro_replay_did_not_reproduce
  cli_repro_tampered_bundles cli_repro_plot_wellformed cli_repro_report_schema PROPERTIES FIXTURES_REQUIRED repro_bundle)

# A plot of the one-rank-group-off bug as SVG: dp-local-mean on DP ranks of unequal counts, 8 ranks.
lossverify_cli_test(repro_plot_svg 1 "plot written to .*dp\\.svg" --present ${REPRO}/dp.svg
  -- ${LV} run ${CASES}/dp-unequal-tokens.json --impl dp-local-mean --plot ${REPRO}/dp.svg --threads 2)
set_tests_properties(cli_repro_plot_svg PROPERTIES FIXTURES_SETUP repro_svg)
add_test(NAME cli_repro_plot_svg_wellformed
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/cli/check_plot.py ${REPRO}/dp.svg 8 8)
set_tests_properties(cli_repro_plot_svg_wellformed PROPERTIES FIXTURES_REQUIRED repro_svg)

# --save-inputs failed writes nothing for a passing run; always does, and that bundle replays as a pass.
lossverify_cli_test(repro_save_failed_skips_passing_runs 0 "verdict: pass"
  --absent ${REPRO}/pass/cp-zigzag-packed.correct.bundle.json
  -- ${LV} run ${CASES}/cp-zigzag-packed.json --save-inputs failed --save-inputs-dir ${REPRO}/pass --threads 2)
lossverify_cli_test(repro_save_always 0 "reproducer bundle written to"
  --present ${REPRO}/always/cp-zigzag-packed.correct.bundle.json
  -- ${LV} run ${CASES}/cp-zigzag-packed.json --save-inputs always --report ${REPRO}/always/report.json --threads 2)
set_tests_properties(cli_repro_save_always PROPERTIES FIXTURES_SETUP repro_always)
lossverify_cli_test(repro_replay_pass 0 "reproduced: pass as recorded"
  -- ${LV} replay ${REPRO}/always/cp-zigzag-packed.correct.bundle.json --threads 2)
set_tests_properties(cli_repro_replay_pass PROPERTIES FIXTURES_REQUIRED repro_always)

# Sweeps: one bundle per failing layout, named by its layout.
lossverify_cli_test(repro_sweep_bundles 1 "invariance: FAIL"
  --present ${REPRO}/sweep/dp-unequal-tokens.dp-local-mean.tp2-cp1-dp4-ga1.bundle.json
  --absent ${REPRO}/sweep/dp-unequal-tokens.dp-local-mean.tp2-cp1-dp1-ga1.bundle.json
  -- ${LV} run ${CASES}/dp-unequal-tokens.json --impl dp-local-mean --sweep dp=1,4 --save-inputs-dir ${REPRO}/sweep
     --threads 2)

# Bad arguments: exit 2 before anything runs, nothing written.
lossverify_cli_test(repro_plot_bad_extension 2 "--plot .*plot\\.png: expected a file ending in \\.svg, \\.html or \\.htm"
  --absent ${REPRO}/bad_plot.json
  -- ${LV} run ${CASES}/smoothing-pytorch.json --plot ${REPRO}/plot.png --report ${REPRO}/bad_plot.json)
lossverify_cli_test(repro_save_dir_missing 2 "--save-inputs-dir .*no-such-dir: not an existing folder"
  --absent ${REPRO}/bad_dir.json
  -- ${LV} run ${CASES}/smoothing-pytorch.json --save-inputs-dir ${REPRO}/no-such-dir --report ${REPRO}/bad_dir.json)
lossverify_cli_test(repro_save_inputs_bad_value 2 "--save-inputs: sometimes not in"
  -- ${LV} run ${CASES}/smoothing-pytorch.json --save-inputs sometimes)
lossverify_cli_test(repro_replay_missing_bundle 2 "does not exist" -- ${LV} replay ${REPRO}/no-such.bundle.json)
lossverify_cli_test(repro_replay_not_a_bundle 2 "smoothing-pytorch\\.json: \\$\\.format: required key is missing"
  -- ${LV} replay ${CASES}/smoothing-pytorch.json)

# shrink: smaller, and the minimized case still fails the same check when run.
lossverify_cli_test(shrink_catalogued_bug 0 "minimized case written to .*shrunk\\.json" --present ${REPRO}/shrunk.json
  -- ${LV} shrink ${CASES}/smoothing-pytorch.json --impl smoothing-partition-vocab --check rank_agreement
     --out ${REPRO}/shrunk.json --threads 2)
set_tests_properties(cli_shrink_catalogued_bug PROPERTIES FIXTURES_SETUP shrunk_case)
lossverify_cli_test(shrink_output_still_fails 1 "rank_agreement +FAIL"
  -- ${LV} run ${REPRO}/shrunk.json --impl smoothing-partition-vocab --threads 2)
add_test(NAME cli_shrink_output_is_smaller
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); n=lambda c: c['shape'].get('tokens', sum(c.get('batch', {}).get('sequence_lengths', [0]))) * c['shape']['vocab']; print(n(a), '->', n(b)); sys.exit(0 if 100 * n(b) <= n(a) else 1)"
          ${CASES}/smoothing-pytorch.json ${REPRO}/shrunk.json)
set_tests_properties(cli_shrink_output_still_fails cli_shrink_output_is_smaller PROPERTIES FIXTURES_REQUIRED shrunk_case)
# A head case (an LM head under sequence parallelism): its bundle records h of each failing token and replays to the
# same verdict; shrink takes it to one token, two columns, H = 1 and tp = 2 without sp, still failing dh.
set(HEAD_REPRO ${REPRO}/head)
add_test(NAME cli_repro_head_bundle_replays_and_shrinks
  COMMAND bash -c "rm -rf ${HEAD_REPRO} && mkdir -p ${HEAD_REPRO} && \
    bash ${EXPECT} 1 'dh +FAIL' -- ${LV} run ${CASES}/head-ce-sp-tp4-cp2-ga2.json --impl head-dh-shard-partial \
      --save-inputs failed --save-inputs-dir ${HEAD_REPRO} --threads 2 && \
    grep -q stage_input_bits ${HEAD_REPRO}/*.bundle.json && \
    bash ${EXPECT} 0 '^reproduced: FAIL as recorded: dh fails' -- ${LV} replay ${HEAD_REPRO}/*.bundle.json --threads 2 && \
    bash ${EXPECT} 0 'layout      tp=4 sp cp=2 dp=1 ga=2 -> tp=2 cp=1 dp=1 ga=1' -- ${LV} shrink \
      ${CASES}/head-ce-sp-tp4-cp2-ga2.json --impl head-dh-shard-partial --out ${HEAD_REPRO}/shrunk.json --threads 2 && \
    bash ${EXPECT} 1 'dh +FAIL' -- ${LV} run ${HEAD_REPRO}/shrunk.json --impl head-dh-shard-partial")
lossverify_cli_test(shrink_nothing_to_shrink 2 "nothing to shrink: .*smoothing-pytorch\\.json passes with --impl correct"
  --absent ${REPRO}/nothing.json
  -- ${LV} shrink ${CASES}/smoothing-pytorch.json --impl correct --out ${REPRO}/nothing.json --threads 2)
lossverify_cli_test(shrink_budget 0 "budget exhausted" --present ${REPRO}/budget.json
  -- ${LV} shrink ${CASES}/cp-zigzag-packed.json --impl cp-roll-after-split --max-trials 3 --out ${REPRO}/budget.json
     --threads 2)

# Under MPI (one process per rank) the bundle records the launcher; thread ranks replay it bit for bit.
if(LOSSVERIFY_HAVE_MPI AND MPIEXEC_EXECUTABLE)
  file(MAKE_DIRECTORY ${REPRO}/mpi)
  lossverify_cli_test(repro_mpi_save_inputs 1 "reproducer bundle written to"
    --present ${REPRO}/mpi/cp-zigzag-packed.cp-roll-after-split.bundle.json
    -- ${MPIEXEC_EXECUTABLE} -n 4 ${LV} run ${CASES}/cp-zigzag-packed.json --impl cp-roll-after-split
       --save-inputs failed --save-inputs-dir ${REPRO}/mpi)
  set_tests_properties(cli_repro_mpi_save_inputs PROPERTIES FIXTURES_SETUP repro_mpi PROCESSORS 2)
  lossverify_cli_test(repro_mpi_replay_on_threads 0 "reproduced: FAIL as recorded"
    -- ${LV} replay ${REPRO}/mpi/cp-zigzag-packed.cp-roll-after-split.bundle.json --threads 2)
  set_tests_properties(cli_repro_mpi_replay_on_threads PROPERTIES FIXTURES_REQUIRED repro_mpi)
endif()
