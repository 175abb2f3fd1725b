#!/usr/bin/env bash
# Installs what is missing, builds, and runs the tests through CTest (docs/development.md, "Test tiers").
#   scripts/test.sh          every test: the README's test command, which .ci/run calls
#   scripts/test.sh --fast   every test but those labelled `slow`: the gate (every catalogued bug caught against
#                            golden) and every test program built are kept
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
case "${1:-}" in
  "") ;;
  --fast) tier=(--label-exclude slow) ;;
  *) echo "usage: scripts/test.sh [--fast]" >&2; exit 2 ;;
esac
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --preset release "${tier[@]}"
