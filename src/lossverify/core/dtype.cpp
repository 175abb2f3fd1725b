#include "lossverify/core/dtype.hpp"
#include "lossverify/core/element_rule.hpp"

#include <bit>
#include <cmath>
#include <limits>

namespace lossverify {

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::fp32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::fp16:
      return "fp16";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  if (name == "fp32") return DType::fp32;
  if (name == "bf16") return DType::bf16;
  if (name == "fp16") return DType::fp16;
  return std::nullopt;
}

std::size_t dtype_size(DType dtype) { return dtype == DType::fp32 ? 4 : 2; }

double round_to_dtype(double value, DType dtype) {
  const float as_float = static_cast<float>(value);
  switch (dtype) {
    case DType::bf16:
      return static_cast<double>(static_cast<float>(Eigen::bfloat16(as_float)));
    case DType::fp16:
      return static_cast<double>(static_cast<float>(Eigen::half(as_float)));
    case DType::fp32:
    default:
      return static_cast<double>(as_float);
  }
}

double dtype_max(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return static_cast<double>(static_cast<float>(Eigen::NumTraits<Eigen::bfloat16>::highest()));
    case DType::fp16:
      return 65504.0;
    case DType::fp32:
    default:
      return static_cast<double>(std::numeric_limits<float>::max());
  }
}

namespace {

// Sign-magnitude bits mapped to a line where adjacent representable values differ by one.
std::int64_t ordered_bits(double value, DType dtype) {
  std::uint32_t magnitude = 0;
  bool negative = std::signbit(value);
  const float as_float = static_cast<float>(value);
  switch (dtype) {
    case DType::bf16:
      magnitude = std::bit_cast<std::uint16_t>(Eigen::bfloat16(as_float)) & 0x7fffu;
      break;
    case DType::fp16:
      magnitude = std::bit_cast<std::uint16_t>(Eigen::half(as_float)) & 0x7fffu;
      break;
    case DType::fp32:
      magnitude = std::bit_cast<std::uint32_t>(as_float) & 0x7fffffffu;
      break;
  }
  return negative ? -static_cast<std::int64_t>(magnitude) : static_cast<std::int64_t>(magnitude);
}

}  // namespace

std::int64_t ulp_distance(double a, double b, DType dtype) {
  const double ra = round_to_dtype(a, dtype);
  const double rb = round_to_dtype(b, dtype);
  if (std::isnan(ra) || std::isnan(rb) || std::isinf(ra) || std::isinf(rb)) {
    return (ra == rb) ? 0 : std::numeric_limits<std::int64_t>::max();
  }
  const std::int64_t d = ordered_bits(ra, dtype) - ordered_bits(rb, dtype);
  return d < 0 ? -d : d;
}

double ulp_size(double value, DType dtype) {
  const element_rule::Format format = dtype == DType::bf16   ? element_rule::bf16_format()
                                      : dtype == DType::fp16 ? element_rule::fp16_format()
                                                             : element_rule::fp32_format();
  return element_rule::spacing(value, format);
}

double smallest_normal(DType dtype) { return dtype == DType::fp16 ? 0x1p-14 : 0x1p-126; }

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return 0x1p-8;
    case DType::fp16:
      return 0x1p-11;
    case DType::fp32:
      break;
  }
  return 0x1p-24;
}

}  // namespace lossverify
