# The Python package (python/lossverify): its unittest modules, each one CTest test, run by Debian's python3
# (the one that sees python3-torch) against this build's lossverify. They must run, not skip: without torch
# the suite fails saying how to install it.
set(PYTHON_DIR ${PROJECT_SOURCE_DIR}/python)
execute_process(COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -c "import torch" RESULT_VARIABLE torch_missing
                OUTPUT_QUIET ERROR_QUIET)
if(torch_missing)
  add_test(NAME python_torch_missing
    COMMAND bash -c "echo '${LOSSVERIFY_SYSTEM_PYTHON} cannot import torch: run scripts/install-deps.sh (Debian python3-torch)'; exit 1")
  return()
endif()
foreach(module test_safetensors test_report test_inputs test_dump test_harness test_hardening test_cli test_torchrun test_policy
               test_pytest_plugin test_control test_golden_correct test_golden_bugs)
  add_test(NAME python_${module}
    COMMAND ${LOSSVERIFY_SYSTEM_PYTHON} -m unittest discover -s tests -p ${module}.py -v
    WORKING_DIRECTORY ${PYTHON_DIR})
  set_tests_properties(python_${module} PROPERTIES TIMEOUT 900
    ENVIRONMENT "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONPATH=${PYTHON_DIR};PYTHONDONTWRITEBYTECODE=1")
endforeach()
# `pip install ./python` in a venv that sees the system's setuptools, wheel and torch builds the executable into
# the package (CMake on this checkout, in the test's own folder); the installed harness then runs with no build
# tree, no LOSSVERIFY_BIN and no lossverify on PATH, and `pip wheel` gives a platform wheel that carries it.
# It compiles the tool once more (6.8 minutes in a 2-core CI run, beside other tests), and never uses LOSSVERIFY_PIP_BINARY.
add_test(NAME python_pip_install_venv
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/python_pip_install_venv.sh ${CMAKE_CURRENT_BINARY_DIR}/pip_install_venv
    ${PROJECT_SOURCE_DIR} ${LOSSVERIFY_SYSTEM_PYTHON})
set_tests_properties(python_pip_install_venv PROPERTIES TIMEOUT 1800 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
# The framework judge (scripts/frameworks) on the one framework every machine has, PyTorch: the per-token
# kernel passes, and the DDP loop's failure on unequal ranks is attributed to dp-local-mean.
add_test(NAME python_framework_judge
  COMMAND bash -c "torch_dir=$(${LOSSVERIFY_SYSTEM_PYTHON} -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
    ${LOSSVERIFY_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/frameworks/judge.py torch_native $torch_dir \
      --only dp-unequal-tokens --json ${CMAKE_CURRENT_BINARY_DIR}/framework_judge.json && \
    ${LOSSVERIFY_SYSTEM_PYTHON} -c \"import json, sys; runs = json.load(open(sys.argv[1]))['runs']; \
      verdicts = {r['function'].split(':')[1]: (r['verdict'], r.get('explained_by')) for r in runs}; print(verdicts); \
      assert verdicts == {'per_token': ('pass', None), 'ddp_microbatch_mean': ('fail', 'dp-local-mean')}\" \
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
      assert verdicts == {'per_token': ('pass', None), 'ddp_microbatch_mean': ('fail', 'dp-local-mean')}\" \
      ${CMAKE_CURRENT_BINARY_DIR}/framework_judge_repro.json")
set_tests_properties(python_framework_judge_reproducer PROPERTIES TIMEOUT 300
  ENVIRONMENT "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONDONTWRITEBYTECODE=1")
# judge.py --explain re-attributes a saved judgement without re-running it: the reproducer's saved rows get
# dp-local-mean back, and a row whose margins were doubled (a framework the entry does not describe) gets none.
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
      for p in sys.argv[1:]]; print(got); assert got == ['dp-local-mean', None]\" \
      $work/plain-explained.json $work/doubled-explained.json")
set_tests_properties(python_framework_judge_explain PROPERTIES TIMEOUT 300
  ENVIRONMENT "LOSSVERIFY_BIN=$<TARGET_FILE:lossverify>;PYTHONDONTWRITEBYTECODE=1")
