#include <doctest/doctest.h>

#include <cmath>

#include "lossverify/core/dtype.hpp"

using namespace lossverify;

TEST_CASE("round_to_dtype_rounds_to_nearest_even_in_each_dtype") {
  CHECK(round_to_dtype(1.0 + 0x1p-30, DType::fp32) == 1.0);
  CHECK(round_to_dtype(1.0 + 0x1p-8, DType::bf16) == 1.0);               // tie -> even
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

TEST_CASE("smallest_normal_is_the_dtype_normal_range_bound") {
  CHECK(smallest_normal(DType::fp16) == 0x1p-14);
  CHECK(smallest_normal(DType::bf16) == 0x1p-126);
  CHECK(smallest_normal(DType::fp32) == 0x1p-126);
}

TEST_CASE("ulp_size_is_the_dtype_spacing_including_at_zero_and_in_the_subnormal_range") {
  CHECK(ulp_size(1.0, DType::bf16) == 0x1p-7);
  CHECK(ulp_size(1.99, DType::bf16) == 0x1p-7);
  CHECK(ulp_size(-3.0, DType::fp16) == 0x1p-9);
  CHECK(ulp_size(1.0, DType::fp32) == 0x1p-23);
  // Zero and values below the normal range: the subnormal spacing, never a large one (a spacing of
  // 2^-8 at zero once hid nonzero gradients where the reference is exactly zero).
  CHECK(ulp_size(0.0, DType::bf16) == 0x1p-133);
  CHECK(ulp_size(0.0, DType::fp16) == 0x1p-24);
  CHECK(ulp_size(0.0, DType::fp32) == 0x1p-149);
  CHECK(ulp_size(1e-6, DType::fp16) == 0x1p-24);
  CHECK(ulp_size(1e-300, DType::fp32) == 0x1p-149);
}
