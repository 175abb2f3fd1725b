#!/usr/bin/env bash
# The main job: install what is missing, build, run every shipped case on CPU thread ranks, print the
# summary table and write lossverify-report.json. Exit code: 0 all pass, 1 a check failed (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
./build/release/cli/lossverify run cases/*.json --report lossverify-report.json "$@"
