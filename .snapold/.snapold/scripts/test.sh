#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (doctest unit tests and CLI tests) through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --preset release
