#!/usr/bin/env bash
# Configures and builds the release preset (warnings are errors) in build/release.
#   build.sh          everything: the tool, the tests, the benchmarks and the example plugins, with the CUDA
#                     backend wherever the CUDA toolkit is (CI compiles it without a GPU)
#   build.sh --gate   the tool alone, as the gate needs it (tests not configured); the CUDA backend only where a GPU is present or
#                     LOSSVERIFY_CUDA=ON asks for it (LOSSVERIFY_CUDA=OFF leaves it out of either build)
# The toolkit is found through /usr/local/cuda when nvcc is not on PATH. ccache is used where installed.
set -euo pipefail
cd "$(dirname "$0")/.."
gate=0
case "${1:-}" in
  --gate) gate=1 ;;
  "") ;;
  *) echo "build.sh: unknown option $1 (expected --gate or nothing)" >&2; exit 2 ;;
esac
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

cuda="${LOSSVERIFY_CUDA:-}"
if [ -z "$cuda" ]; then
  cuda=ON
  if [ "$gate" = 1 ] && ! { nvidia-smi -L >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; }; then cuda=OFF; fi
fi
launcher=""
if command -v ccache >/dev/null; then launcher=ccache; fi

tests=ON
if [ "$gate" = 1 ]; then tests=OFF; fi  # adding the tests later recompiles nothing already built
cmake --preset release -DLOSSVERIFY_WITH_CUDA="$cuda" -DLOSSVERIFY_BUILD_TESTS="$tests" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$launcher" -DCMAKE_CUDA_COMPILER_LAUNCHER="$launcher"
if [ "$gate" = 1 ]; then
  cmake --build --preset release --parallel "$(nproc)" --target lossverify
else
  cmake --build --preset release --parallel "$(nproc)"
fi
