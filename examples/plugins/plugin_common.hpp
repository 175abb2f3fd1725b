// What both example plugins need besides their kernels: the bug parameter, the collectives table wrapped
// so that a failure unwinds to run_rank, and the training loop's side of a rank (docs/spec.md §5, "framework
// model"): which rows count, the valid-token count over DP x CP, each row's weight in the logged loss and
// in the backward pass, and the logged loss. Host code, C++17 (nvcc compiles it too). Where the
// collectives' data lives is the caller's business: it passes "sum over DP x CP" as a function.
#pragma once

#include <lossverify/plugin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lossverify_example {

// ---- Parameters ---------------------------------------------------------------------------------

// params is "" or '&'-separated items, each one of `known` (e.g. "bug=no-max-shift"). Returns the items
// given; every other item is named in the error.
inline std::vector<std::string_view> parse_bug_parameters(std::string_view params,
                                                          std::initializer_list<std::string_view> known) {
  std::vector<std::string_view> given;
  std::string unknown;
  while (!params.empty()) {
    const std::size_t end = params.find('&');
    const std::string_view item = params.substr(0, end);
    params = end == std::string_view::npos ? std::string_view{} : params.substr(end + 1);
    if (std::find(known.begin(), known.end(), item) != known.end()) {
      given.push_back(item);
    } else if (!item.empty()) {
      unknown += (unknown.empty() ? "'" : ", '") + std::string(item) + "'";
    }
  }
  if (!unknown.empty()) {
    std::string names;
    for (const std::string_view name : known) names += (names.empty() ? "" : ", ") + std::string(name);
    throw std::invalid_argument("unknown parameter(s) " + unknown + "; this plugin knows only " + names);
  }
  return given;
}

// Whether `item` is among the parameters given.
inline bool has_parameter(const std::vector<std::string_view>& given, std::string_view item) {
  return std::find(given.begin(), given.end(), item) != given.end();
}

// A plugin whose one parameter is `known`: whether it was given.
inline bool parse_bug_parameter(std::string_view params, std::string_view known) {
  return has_parameter(parse_bug_parameters(params, {known}), known);
}

// The body of lv_plugin.check_params for a plugin whose parameters are `known`: lossverify calls it at load
// time, so a bad parameter is a usage error before any rank runs.
inline int check_bug_parameters(const char* params, std::initializer_list<std::string_view> known, char* error,
                                std::size_t error_size) {
  try {
    parse_bug_parameters(params == nullptr ? "" : params, known);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  }
}

inline int check_bug_parameter(const char* params, std::string_view known, char* error, std::size_t error_size) {
  return check_bug_parameters(params, {known}, error, error_size);
}

// No exception may cross the C ABI: every failure becomes run_rank's nonzero return and its message.
template <class Run>
int run_guarded(lv_rank_outputs& out, Run&& run) {
  try {
    run();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(out.error, sizeof out.error, "%s", e.what());
  } catch (...) {
    std::snprintf(out.error, sizeof out.error, "unknown exception");
  }
  return 1;
}

// ---- Collectives --------------------------------------------------------------------------------

inline const char* group_name(lv_group group) {
  switch (group) {
    case LV_GROUP_TP:
      return "TP";
    case LV_GROUP_CP:
      return "CP";
    case LV_GROUP_DP:
      return "DP";
    case LV_GROUP_DP_CP:
      return "DP x CP";
  }
  return "?";
}

template <class T>
constexpr lv_element element_of();
template <>
constexpr lv_element element_of<float>() {
  return LV_ELEMENT_F32;
}
template <>
constexpr lv_element element_of<double>() {
  return LV_ELEMENT_F64;
}
template <>
constexpr lv_element element_of<std::int64_t>() {
  return LV_ELEMENT_I64;
}

// A failed all-reduce means the run is failing elsewhere: unwind to run_rank, which reports it.
class Collectives {
 public:
  explicit Collectives(const lv_collectives& table) : table_(table) {}

  // data lives in the plugin's declared memory.
  template <class T>
  void allreduce(lv_group group, T* data, std::int64_t count, lv_reduce_op op) const {
    if (table_.allreduce(table_.context, group, data, count, element_of<T>(), op) != 0) {
      throw std::runtime_error(std::string("all-reduce over the ") + group_name(group) +
                               " group failed (the run is failing on another rank)");
    }
  }

 private:
  const lv_collectives& table_;
};

// ---- The framework model ------------------------------------------------------------------------

// The per-row inputs the framework side reads, in host memory.
struct HostRows {
  const std::int64_t* labels;
  const std::uint8_t* loss_mask;
  const double* upstream_weights;
};

struct RowPlan {
  bool valid = false;         // loss_mask 1 and (cross-entropy) a real label: gets a loss and a gradient
  float forward_weight = 0;   // the row's weight in the logged objective L
  float backward_weight = 0;  // scale of the row's gradient in the objective this rank back-propagates
};

struct BatchPlan {
  std::vector<RowPlan> rows;
  std::int64_t valid_tokens = 0;  // N_v: valid rows of every micro-batch, summed over DP x CP
};

inline bool row_is_valid(const lv_rank_inputs& in, const HostRows& host, std::int64_t i) {
  if (host.loss_mask[i] == 0) return false;
  return in.loss.kind == LV_LOSS_KD || host.labels[i] != in.loss.ignore_index;
}

// What the framework multiplies this rank's gradient by: 1/(DP CP) under grad_reduce avg, 1/GA under
// ga_reduce mean. The rank back-propagates forward weight / factor, so the combined gradient is dL/dx.
inline double framework_factor(const lv_rank_inputs& in) {
  double factor = 1.0;
  if (in.framework.grad_reduce_avg != 0) factor /= static_cast<double>(in.dp_size) * in.cp_size;
  if (in.framework.ga_reduce_mean != 0) factor /= in.ga;
  return factor;
}

// Counts this rank's valid rows as a training loop does before the step (global_valid_tokens is the
// loader's figure, not ours to copy); sum_over_dp_cp(std::int64_t) all-reduces the count.
template <class SumOverDpCp>
BatchPlan plan_batch(const lv_rank_inputs& in, const HostRows& host, SumOverDpCp sum_over_dp_cp) {
  BatchPlan plan;
  plan.rows.resize(static_cast<std::size_t>(in.rows));
  std::int64_t local_valid = 0;
  for (std::int64_t i = 0; i < in.rows; ++i) {
    plan.rows[static_cast<std::size_t>(i)].valid = row_is_valid(in, host, i);
    local_valid += plan.rows[static_cast<std::size_t>(i)].valid;
  }
  plan.valid_tokens = sum_over_dp_cp(local_valid);

  const double factor = framework_factor(in);
  for (std::int64_t i = 0; i < in.rows; ++i) {
    RowPlan& row = plan.rows[static_cast<std::size_t>(i)];
    if (!row.valid) continue;
    double forward = 1.0;  // reduction sum
    if (in.loss.reduction == LV_REDUCTION_MEAN) forward = 1.0 / static_cast<double>(plan.valid_tokens);
    if (in.loss.reduction == LV_REDUCTION_NONE) forward = host.upstream_weights[i];
    row.forward_weight = static_cast<float>(forward);
    row.backward_weight = static_cast<float>(forward / factor);
  }
  return plan;
}

// Pairwise float32 sum, the error growing with log n as in a framework's tensor sum.
inline float pairwise_sum(const float* x, std::size_t n) {
  if (n <= 8) {
    float sum = 0.0f;
    for (std::size_t i = 0; i < n; ++i) sum += x[i];
    return sum;
  }
  const std::size_t half = n / 2;
  return pairwise_sum(x, half) + pairwise_sum(x + half, n - half);
}

// L = sum_t forward_weight_t loss_t over this rank's rows (token_loss in host memory), then
// sum_over_dp_cp(float): every rank logs the same value.
template <class SumOverDpCp>
float logged_loss(const BatchPlan& plan, const float* token_loss, SumOverDpCp sum_over_dp_cp) {
  std::vector<float> weighted(plan.rows.size(), 0.0f);
  for (std::size_t i = 0; i < plan.rows.size(); ++i) weighted[i] = plan.rows[i].forward_weight * token_loss[i];
  return sum_over_dp_cp(pairwise_sum(weighted.data(), weighted.size()));
}

// ---- Label smoothing ----------------------------------------------------------------------------

// Target distribution q of docs/spec.md §3: on_target at the label, off_target elsewhere, for a vocabulary of
// `vocab` columns (the global V; the shard width V_p under the partition-vocab bug).
struct TargetWeights {
  float on_target;
  float off_target;
};

inline TargetWeights target_weights(const lv_loss_config& loss, double vocab) {
  const double alpha = loss.label_smoothing;
  if (loss.smoothing_convention == LV_SMOOTHING_MEGATRON) {
    return {static_cast<float>(1.0 - alpha), static_cast<float>(alpha / (vocab - 1.0))};
  }
  return {static_cast<float>(1.0 - alpha + alpha / vocab), static_cast<float>(alpha / vocab)};
}

// What run_rank checks before anything else: structures at least as large as this plugin was built
// against (lossverify's only grow at the end), and micro-batches that span the rows.
inline void check_rank_inputs(const lv_rank_inputs& in, const lv_rank_outputs& out) {
  if (in.struct_size < sizeof(lv_rank_inputs) || out.struct_size < sizeof(lv_rank_outputs)) {
    throw std::invalid_argument(
        "lossverify passed smaller lv_rank_inputs/lv_rank_outputs than this plugin was built with");
  }
  if (in.ga < 1 || in.micro_batch_begin[0] != 0 || in.micro_batch_begin[in.ga] != in.rows) {
    throw std::invalid_argument("micro_batch_begin does not span the rank's rows");
  }
}

}  // namespace lossverify_example
