#include <doctest/doctest.h>

#include <cmath>

#include "lossverify/core/dtype.hpp"

using namespace lossverify;

TEST_CASE("round_to_dtype_rounds_to_nearest_even_in_each_dtype") {
  CHECK(round_to_dtype(1.0 + 0x1p-30, DType::fp32) == 1.0);
  CHECK(round_to_dtype(1.0 + 0x1p-8, DType::bf16) == 1.0);           // tie -> even
  CHECK(round_to_dtype(1.0 + 3 * 0x1p-8, DType::bf16) == 1.0 + 0x1p-6);  // tie -> even (up)
  CHECK(round_to_dtype(1.0 + 0x1p-11, DType::fp16) == 1.0);
  CHECK(round_to_dtype(70000.0, DType::fp16) == INFINITY);
  CHECK(dtype_max(DType::fp16) == 65504.0);
}

TEST_CASE("ulp_distance_counts_representable_steps_across_zero") {
  CHECK(ulp_distance(1.0, 1.0 + 0x1p-7, DType::bf16) == 1);
  CHECK(ulp_distance(1.0, 1.0 + 0x1p-10, DType::fp16) == 1);
  CHECK(ulp_distance(1.0, 1.0 + 0x1p-23, DType::fp32) == 1);
  CHECK(ulp_distance(0.0, -0.0, DType::fp32) == 0);
  CHECK(ulp_distance(0x1p-149, -0x1p-149, DType::fp32) == 2);
  CHECK(ulp_distance(NAN, 1.0, DType::bf16) == INT64_MAX);
}

TEST_CASE("subnormals_are_recognised_in_the_dtype_they_are_stored_in") {
  CHECK(is_subnormal_in(1e-6, DType::fp16));
  CHECK_FALSE(is_subnormal_in(1e-6, DType::fp32));
  CHECK(is_subnormal_in(1e-39, DType::fp32));
  CHECK(is_subnormal_in(1e-39, DType::bf16));
  CHECK_FALSE(is_subnormal_in(0.0, DType::fp32));
}
