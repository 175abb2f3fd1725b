# The Python package (python/lossverify): its unittest modules, each one CTest test, run by Debian's python3
# (the one that sees python3-torch) against this build's lossverify. They must run, not skip: without torch
# the suite fails saying how to install it.
set(PYTHON_DIR ${PROJECT_SOURCE_DIR}/python)
# docs/frameworks.md is generated from scripts/frameworks/results/ (no torch needed): the page agrees with the data,
# every results file is valid against schema/framework-results.schema.json, and a drifted page or a malformed
# results file is caught.
add_test(NAME python_frameworks_summary
  COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/summary.py --check)
add_test(NAME python_frameworks_summary_drift
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/frameworks_summary_drift.sh ${LOSSVERIFY_SYSTEM_PYTHON}
    ${CMAKE_CURRENT_BINARY_DIR}/frameworks_summary_drift)
set_tests_properties(python_frameworks_summary python_frameworks_summary_drift PROPERTIES TIMEOUT 120
  ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
execute_process(COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "import torch" RESULT_VARIABLE torch_missing
                OUTPUT_QUIET ERROR_QUIET)
if(torch_missing)
  add_test(NAME python_torch_missing
    COMMAND bash -c "echo '${LOSSVERIFY_SYSTEM_PYTHON} cannot import torch: run scripts/install-deps.sh (Debian python3-torch)'; exit 1")
  return()
endif()
set(python_env "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONPATH=${PYTHON_DIR};PYTHONDONTWRITEBYTECODE=1")
foreach(module test_safetensors test_report test_inputs test_dump test_harness test_hardening test_cli test_torchrun test_policy test_router
               test_pytest_plugin test_control test_head)
  add_test(NAME python_${module}
    COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -m unittest discover -s tests -p ${module}.py -v
    WORKING_DIRECTORY ${PYTHON_DIR})
  set_tests_properties(python_${module} PROPERTIES TIMEOUT 900 ENVIRONMENT "${python_env}")
  if(module MATCHES "^test_(hardening|torchrun|policy|head)$")
    set_property(TEST python_${module} PROPERTY COST 60)  # long tests first (see python_pip_install_from_source)
  endif()
endforeach()
# The golden suites, one CTest entry per shipped case (LOSSVERIFY_GOLDEN_CASE), so they spread over the cores and
# one case reruns alone: `ctest -R python_golden_bugs_cp-zigzag-packed`. A case added to cases/ gets its entries
# at the next configure. A case of a kind the package does not check (one outside lossverify.kinds' known kinds, asked
# here so that the list lives in one place) has none. A case with an LM head runs the package's head
# (lossverify.torch.implementations.head).
execute_process(COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "from lossverify.kinds import known_kinds; print(';'.join(known_kinds()), end='')"
                WORKING_DIRECTORY ${PYTHON_DIR} OUTPUT_VARIABLE python_kinds RESULT_VARIABLE python_kinds_failed)
if(python_kinds_failed OR NOT python_kinds)
  message(FATAL_ERROR "lossverify: cannot list the Python package's loss kinds (python/lossverify/kinds.py)")
endif()
# The cases themselves come from tests/support.py's all_case_names() (the package's kinds, and the head cases its
# head runs); the glob only makes a new case file reconfigure.
file(GLOB shipped_cases CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/cases/*.json)
execute_process(COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "import sys; sys.path[:0] = ['.', 'tests']; import support; print(';'.join(support.all_case_names()), end='')"
                WORKING_DIRECTORY ${PYTHON_DIR} OUTPUT_VARIABLE python_cases RESULT_VARIABLE python_cases_failed)
if(python_cases_failed OR NOT python_cases)
  message(FATAL_ERROR "lossverify: cannot list the Python package's golden cases (python/tests/support.py)")
endif()
foreach(case_name ${python_cases})
  foreach(suite correct bugs)
    add_test(NAME python_golden_${suite}_${case_name}
      COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -m unittest discover -s tests -p test_golden_${suite}.py -v
      WORKING_DIRECTORY ${PYTHON_DIR})
    set_tests_properties(python_golden_${suite}_${case_name} PROPERTIES TIMEOUT 900 LABELS golden
      ENVIRONMENT "${python_env};LOSSVERIFY_GOLDEN_CASE=${case_name}")
    # The fast tier keeps the bug suites (every catalogued bug's PyTorch version caught as golden says) but that of
    # the 65M-logit case (48 s; the gate holds its cells), three of the seven router cases and three of the six LM head
    # cases (the cases kept fail every router and head bug between them; the slow tier runs them all).
    if(suite STREQUAL correct OR
       case_name MATCHES "^(realistic-|moe-aux-replicated-|moe-routed-|moe-pooled-|head-ce-sp-|head-kd-|head-policy-)")
      set_property(TEST python_golden_${suite}_${case_name} APPEND PROPERTY LABELS slow)
    endif()
    if(case_name MATCHES "^realistic-")
      set_property(TEST python_golden_${suite}_${case_name} PROPERTY COST 100)
    endif()
  endforeach()
endforeach()
# `pip install ./python` in a venv that sees the system's setuptools, wheel and torch puts the executable into the
# package; the installed harness then runs with no build tree, no LOSSVERIFY_BIN and no lossverify on PATH, and
# `pip wheel` gives a platform wheel that carries it. python_pip_install_prebuilt packages this build's executable
# (LOSSVERIFY_PIP_BINARY: seconds); python_pip_install_from_source compiles the tool once more with CMake on this
# checkout, in the test's own folder (about 4 minutes on 2 cores), as a user's install does: the slow tier.
add_test(NAME python_pip_install_prebuilt
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/python_pip_install_venv.sh ${CMAKE_CURRENT_BINARY_DIR}/pip_install_prebuilt
    ${PROJECT_SOURCE_DIR} ${LOSSVERIFY_SYSTEM_PYTHON} $<TARGET_FILE:lossverify>)
set_tests_properties(python_pip_install_prebuilt PROPERTIES TIMEOUT 600
  ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
add_test(NAME python_pip_install_from_source
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/python_pip_install_venv.sh ${CMAKE_CURRENT_BINARY_DIR}/pip_install_venv
    ${PROJECT_SOURCE_DIR} ${LOSSVERIFY_SYSTEM_PYTHON})
# COST: the longest tests start first (a fresh clone has no timings of its own), so that none runs alone at the end
# (this one did: 400 s of the full tier's 26 minutes on 2 cores).
set_tests_properties(python_pip_install_from_source PROPERTIES TIMEOUT 1800 LABELS slow COST 400
  ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
# The framework judge (scripts/frameworks) on the one framework every machine has, PyTorch: the per-token
# kernel passes, and the DDP loop's failure on unequal ranks is attributed to dp-local-mean.
add_test(NAME python_framework_judge
  COMMAND bash -c "torch_dir=$(${LOSSVERIFY_SYSTEM_PYTHON} -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
    ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/judge.py torch_native $torch_dir \
      --only dp-unequal-tokens --json ${CMAKE_CURRENT_BINARY_DIR}/framework_judge.json && \
    ${LOSSVERIFY_SYSTEM_PYTHON} -c \"import json, sys; runs = json.load(open(sys.argv[1]))['runs']; \
      verdicts = {r['function'].split(':')[1]: (r['verdict'], r.get('explained_by')) for r in runs}; print(verdicts); \
      assert verdicts == {'per_token': ('pass', None), 'ddp_microbatch_mean': ('fail', 'dp-local-mean or microbatch-local-mean')}\" \
      ${CMAKE_CURRENT_BINARY_DIR}/framework_judge.json")
set_tests_properties(python_framework_judge PROPERTIES TIMEOUT 300
  ENVIRONMENT "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONDONTWRITEBYTECODE=1")
# The judge's --case path on a minimal reproducer: the DDP loop still fails there as dp-local-mean, and the
# per-token kernel passes.
add_test(NAME python_framework_judge_reproducer
  COMMAND bash -c "torch_dir=$(${LOSSVERIFY_SYSTEM_PYTHON} -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
    ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/judge.py torch_native $torch_dir \
      --function ddp_microbatch_mean --function per_token \
      --case ${PROJECT_SOURCE_DIR}/scripts/frameworks/repros/dp-local-mean.json \
      --json ${CMAKE_CURRENT_BINARY_DIR}/framework_judge_repro.json && \
    ${LOSSVERIFY_SYSTEM_PYTHON} -c \"import json, sys; runs = json.load(open(sys.argv[1]))['runs']; \
      verdicts = {r['function'].split(':')[1]: (r['verdict'], r.get('explained_by')) for r in runs}; print(verdicts); \
      assert verdicts == {'per_token': ('pass', None), 'ddp_microbatch_mean': ('fail', 'dp-local-mean or microbatch-local-mean')}\" \
      ${CMAKE_CURRENT_BINARY_DIR}/framework_judge_repro.json")
set_tests_properties(python_framework_judge_reproducer PROPERTIES TIMEOUT 300
  ENVIRONMENT "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONDONTWRITEBYTECODE=1" LABELS slow)
# judge.py --explain re-attributes a saved judgement without re-running it: the reproducer's saved rows get
# dp-local-mean back (and microbatch-local-mean, the same at ga 1), and a row whose margins were doubled (a framework the entry does not describe) gets none.
add_test(NAME python_framework_judge_explain
  COMMAND bash -c "torch_dir=$(${LOSSVERIFY_SYSTEM_PYTHON} -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
    work=${CMAKE_CURRENT_BINARY_DIR}/framework_judge_explain && rm -rf $work && mkdir -p $work && \
    ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/judge.py torch_native $torch_dir \
      --function ddp_microbatch_mean --case ${PROJECT_SOURCE_DIR}/scripts/frameworks/repros/dp-local-mean.json \
      --json $work/saved.json > /dev/null && \
    ${LOSSVERIFY_SYSTEM_PYTHON} -c \"import json, sys; d = json.load(open(sys.argv[1])); r = d['runs'][0]; \
      r.pop('explained_by'); json.dump(d, open(sys.argv[2], 'w')); \
      r['margins'] = {k: 2 * v for k, v in r['margins'].items()}; json.dump(d, open(sys.argv[3], 'w'))\" \
      $work/saved.json $work/plain.json $work/doubled.json && \
    ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/judge.py torch_native $torch_dir \
      --explain $work/plain.json --json $work/plain-explained.json && \
    ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/judge.py torch_native $torch_dir \
      --explain $work/doubled.json --json $work/doubled-explained.json && \
    ${LOSSVERIFY_SYSTEM_PYTHON} -c \"import json, sys; got = [json.load(open(p))['runs'][0]['explained_by'] \
      for p in sys.argv[1:]]; print(got); assert got == ['dp-local-mean or microbatch-local-mean', None]\" \
      $work/plain-explained.json $work/doubled-explained.json")
set_tests_properties(python_framework_judge_explain PROPERTIES TIMEOUT 300
  ENVIRONMENT "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONDONTWRITEBYTECODE=1" LABELS slow)
