#include "lossverify/case/tolerances.hpp"

#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify {

ToleranceEntry default_tolerance(std::string_view quantity, DType input_dtype) {
  // Losses are computed in float32 from exact inputs whatever the input dtype: a few float32 roundings
  // of log S, x_l - M and the smoothing sum, relative to values of order log V.
  if (quantity == "loss" || quantity == "rank_agreement") {
    return {{1e-5, 1e-5}, "float32 compute: a few roundings of log S, x_l - M and sum(x - M)"};
  }
  if (quantity == "reduced_loss") {
    return {{1e-5, 2e-5}, "float32 compute plus a float32 pairwise sum over tokens"};
  }
  if (quantity == "grad") {
    switch (input_dtype) {
      case DType::bf16:
      case DType::fp16:
        return {{1e-6, 0.0, 1},
                "1 ulp of the dtype at the exact value (correct rounding is within 0.5); atol covers "
                "cancellation in p - q"};
      case DType::fp32:
        return {{1e-6, 1e-5}, "float32 exp(x - lse): relative error ~2^-24 |x - lse| where p is not negligible"};
    }
  }
  if (quantity == "row_sum") {
    // rtol multiplies sum_v |g_v|: the worst case of independent output roundings of every element.
    switch (input_dtype) {
      case DType::bf16:
        return {{1e-5, 0.0078125}, "twice the worst case: each element rounds by at most 2^-8 relative in bf16"};
      case DType::fp16:
        return {{1e-5, 0.0009765625}, "twice the worst case: each element rounds by at most 2^-11 relative in fp16"};
      case DType::fp32:
        return {{1e-5, 1e-5}, "float32 compute error of p_v times sum |g_v|"};
    }
  }
  if (quantity == "invariance") {
    // Two layouts each within the grad tolerance of the reference are within twice of each other.
    switch (input_dtype) {
      case DType::bf16:
      case DType::fp16:
        return {{2e-6, 0.0, 2}, "twice the grad tolerance: two correctly rounded outputs differ by at most 1 ulp"};
      case DType::fp32:
        return {{2e-6, 2e-5}, "twice the grad tolerance"};
    }
  }
  if (quantity == "token_value") {
    return {{1e-5, 1e-5}, "float32 compute: a few roundings of log S, x_y / T - M and the shifted entropy sum"};
  }
  if (quantity == "statistic") {
    return {{1e-5, 2e-5}, "float32 compute plus a float32 sum over the step's tokens"};
  }
  return {{0.0, 0.0}, "unknown quantity"};
}

bool tolerance_applies(const Case& c, std::string_view quantity) {
  if (quantity == "token_value") return !kind_of(c.loss).token_quantities().empty();
  if (quantity == "statistic") return !kind_of(c.loss).logged_statistics(c.loss).empty();
  return true;
}

Tolerance effective_tolerance(const Case& c, std::string_view quantity) {
  const auto it = c.tolerance_overrides.find(std::string(quantity));
  if (it != c.tolerance_overrides.end()) return it->second;
  return default_tolerance(quantity, c.inputs.dtype).tolerance;
}

}  // namespace lossverify
