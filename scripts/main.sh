#!/usr/bin/env bash
# The main job: install what is missing, build, and run the gate: every shipped case with the correct
# implementation and every catalogued bug on CPU thread ranks, compared with golden/. Prints the matrix
# and writes lossverify-gate.json and lossverify-gate.xml (JUnit). Exit code 0 only if all match golden.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --gate
bash scripts/build.sh --gate
./build/release/cli/lossverify gate --report lossverify-gate.json --junit lossverify-gate.xml "$@"
