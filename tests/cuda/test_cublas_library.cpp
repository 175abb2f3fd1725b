// cuBLAS loaded at its first use (cuda/cublas_library.hpp), checked where the toolkit is installed and no GPU is
// needed: the library opens, every entry the LM head calls is bound, and the entries are cuBLAS's own.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

#include "lossverify/cuda/cublas_library.hpp"

using lossverify::cuda::cublas_library;
using lossverify::cuda::CublasLibrary;

TEST_CASE("cublas_is_loaded_at_its_first_use_with_every_entry_the_head_calls") {
  const CublasLibrary& l = cublas_library();
  CHECK(bool(l.create));
  CHECK(bool(l.destroy));
  CHECK(bool(l.set_stream));
  CHECK(bool(l.dgemm));
  CHECK(bool(l.gemm_ex));
  REQUIRE(bool(l.status_string));
  // The library's own strings: a call through the bound entry reaches cuBLAS.
  const std::string success = l.status_string(CUBLAS_STATUS_SUCCESS);
  const std::string invalid = l.status_string(CUBLAS_STATUS_INVALID_VALUE);
  CHECK(!success.empty());
  CHECK(!invalid.empty());
  CHECK(success != invalid);
  CHECK(&cublas_library() == &l);  // loaded once
}
