#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include <Eigen/Core>

namespace lossverify {

// Input and output dtypes of the sharded implementations. Logits are generated in float64 and
// rounded to one of these; gradients are written in the same dtype as the logits.
enum class DType { fp32, bf16, fp16 };

std::string_view to_string(DType dtype);
std::optional<DType> parse_dtype(std::string_view name);

template <DType D>
struct DTypeTraits;
template <>
struct DTypeTraits<DType::fp32> {
  using storage = float;
};
template <>
struct DTypeTraits<DType::bf16> {
  using storage = Eigen::bfloat16;
};
template <>
struct DTypeTraits<DType::fp16> {
  using storage = Eigen::half;
};

std::size_t dtype_size(DType dtype);

// Round a float64 value to the dtype (round to nearest even, through float32 for the 16-bit types,
// which is the definition used by every backend) and widen it back exactly.
double round_to_dtype(double value, DType dtype);

// Largest finite value of the dtype.
double dtype_max(DType dtype);

// Distance in units in the last place of the dtype between two values representable in it
// (both are rounded first). Infinite or NaN operands give INT64_MAX unless both are the same.
std::int64_t ulp_distance(double a, double b, DType dtype);

// Spacing of the dtype's representable values at |value| (the subnormal spacing below the normal range).
double ulp_size(double value, DType dtype);

// Smallest positive normal value of the dtype.
double smallest_normal(DType dtype);
// The unit roundoff u: half the spacing of 1, the largest relative error of one rounding to nearest (2^-8 bf16,
// 2^-11 fp16, 2^-24 fp32).
double unit_roundoff(DType dtype);

// Call f(std::type_identity<StorageType>{}) for the storage type of a runtime dtype.
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16:
      return f(std::type_identity<Eigen::bfloat16>{});
    case DType::fp16:
      return f(std::type_identity<Eigen::half>{});
    case DType::fp32:
    default:
      return f(std::type_identity<float>{});
  }
}

}  // namespace lossverify
