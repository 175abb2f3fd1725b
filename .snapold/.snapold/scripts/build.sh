#!/usr/bin/env bash
# Configures and builds the release preset (warnings are errors). CUDA is found via /usr/local/cuda if present.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake --preset release
cmake --build --preset release --parallel "$(nproc)"
