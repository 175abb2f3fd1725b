// The CUDA test runner: without a usable GPU it says why and exits 77, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"

int main(int argc, char** argv) {
  try {
    lossverify::cuda::require_device(0);
  } catch (const lossverify::Error& e) {
    std::printf("skipped: CUDA tests need a GPU: %s\n", e.what());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
