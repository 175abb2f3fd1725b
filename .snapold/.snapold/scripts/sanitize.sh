#!/usr/bin/env bash
# The whole test suite under AddressSanitizer and UndefinedBehaviorSanitizer (CPU backends: threads and
# MPI; the CUDA backend is left out of this build). Any sanitizer report fails the test that raised it.
# Takes tens of minutes on 2 cores; not part of CI. Extra arguments go to ctest (e.g. -R dump).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset sanitize
cmake --build --preset sanitize
ctest --preset sanitize "$@"
