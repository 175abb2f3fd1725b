// Example lossverify plugin, host memory: one rank's vocabulary-parallel cross-entropy (and forward-KL
// knowledge distillation) over all its micro-batches, written from docs/spec.md §3 and §5; the RL policy
// loss of the same library is in cpu_policy.cpp, and the LM head in front of cross-entropy and KD in cpu_lm_head.hpp.
//
//   lossverify run CASE.json --impl plugin:./libcpu_cross_entropy.so
//   lossverify run CASE.json --impl plugin:./libcpu_cross_entropy.so?bug=smoothing-partition-vocab
//   lossverify run CASE.json --impl plugin:./libcpu_cross_entropy.so?bug=rl-kl-no-grad  (or rl-temperature-one-side)
//   lossverify run cases/head-ce-tp2-dp2-ga2.json --impl plugin:./libcpu_cross_entropy.so?bug=head-dh-shard-partial
//
// Per micro-batch and row: M = all-reduce max of the local maxima, then one packed all-reduce sum of
// S = sum exp(x - M), x_l - M (the label's owner contributes it) and Z = sum (x - M); the loss follows
// without ever taking log p, and the gradient of the local columns needs no further communication.
// The framework side (valid-token count over DP x CP, the weights of the logged loss and of the
// backward pass) is computed here too, as a training loop would, through the provided collectives.
#include <lossverify/plugin.h>

#include "cpu_elements.hpp"
#include "cpu_lm_head.hpp"
#include "cpu_policy.hpp"
#include "plugin_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace lossverify_example;
using namespace lossverify_example::cpu;

// ---- Parameters ---------------------------------------------------------------------------------

constexpr std::string_view kSmoothingPartitionVocab = "bug=smoothing-partition-vocab";
constexpr std::string_view kKlNoGrad = "bug=rl-kl-no-grad";
constexpr std::string_view kTemperatureOneSide = "bug=rl-temperature-one-side";
constexpr std::string_view kGspoCpLocalRatio = "bug=rl-gspo-cp-local-ratio";
constexpr std::string_view kHeadDhShardPartial = "bug=head-dh-shard-partial";
constexpr std::initializer_list<std::string_view> kParameters = {
    kSmoothingPartitionVocab, kKlNoGrad, kTemperatureOneSide, kGspoCpLocalRatio, kHeadDhShardPartial};

struct Options {
  // Megatron-LM's vocab-parallel smoothing before PR #5522: the smoothing constants use the shard width V_p
  // and the mean log-probability is the shard's own, in the forward and the backward.
  bool smoothing_partition_vocab = false;
  PolicyBugs policy;
  HeadBugs head;
};

Options parse_options(const char* params) {
  const std::vector<std::string_view> given = parse_bug_parameters(params == nullptr ? "" : params, kParameters);
  Options options;
  options.smoothing_partition_vocab = has_parameter(given, kSmoothingPartitionVocab);
  options.policy.kl_no_grad = has_parameter(given, kKlNoGrad);
  options.policy.temperature_one_side = has_parameter(given, kTemperatureOneSide);
  options.policy.gspo_cp_local_ratio = has_parameter(given, kGspoCpLocalRatio);
  options.head.dh_shard_partial = has_parameter(given, kHeadDhShardPartial);
  return options;
}

// ---- Shared per-row helpers ---------------------------------------------------------------------

// ---- Cross-entropy ------------------------------------------------------------------------------

// The logit as the loss sees it (c tanh(x / c) under a softcap) and its derivative with respect to x.
struct Logit {
  float value;
  float slope;
};

Logit capped(float x, float cap) {
  if (cap <= 0.0f) return {x, 1.0f};
  const float t = std::tanh(x / cap);
  return {cap * t, 1.0f - t * t};
}

// What every row of a micro-batch shares.
struct CrossEntropySetup {
  float softcap;
  float z_loss_weight;
  TargetWeights q;
  bool shard_local_mean;  // the partition-vocab bug: Z is the shard's own sum, not the TP sum
};

CrossEntropySetup cross_entropy_setup(const lv_rank_inputs& in, const Options& options, std::int64_t shard_width) {
  const bool bug = options.smoothing_partition_vocab;
  const double smoothing_vocab = static_cast<double>(bug ? shard_width : in.vocab_size);
  return {static_cast<float>(in.loss.softcap), static_cast<float>(in.loss.z_loss_weight),
          target_weights(in.loss, smoothing_vocab), bug};
}

// Per row after the collectives: M, log S, x_l - M and the Z the loss uses.
struct RowStats {
  float max;
  float log_sum;
  float target_shifted;
  float sum_shifted;
  float lse() const { return max + log_sum; }
};

// Step 1: M = all-reduce max over TP of the local maxima (-inf on rows that do not count).
template <class T>
std::vector<float> row_maxima(Matrix<T> logits, RowRange range, const BatchPlan& plan, const CrossEntropySetup& setup,
                              const Collectives& comm) {
  std::vector<float> maxima(static_cast<std::size_t>(range.size()), kNegInf);
  for (std::int64_t i = 0; i < range.size(); ++i) {
    if (!plan.rows[static_cast<std::size_t>(range.begin + i)].valid) continue;
    const T* x = logits.row(range.begin + i);
    float max = kNegInf;
    for (std::int64_t v = 0; v < logits.width; ++v) max = std::fmax(max, capped(widen(x[v]), setup.softcap).value);
    maxima[static_cast<std::size_t>(i)] = max;
  }
  allreduce(comm, LV_GROUP_TP, maxima, LV_REDUCE_MAX);
  return maxima;
}

// Step 2: one packed all-reduce sum over TP of [S | x_l - M | Z] per row.
template <class T>
std::vector<RowStats> cross_entropy_stats(const lv_rank_inputs& in, Matrix<T> logits, RowRange range,
                                          const BatchPlan& plan, const CrossEntropySetup& setup,
                                          const Collectives& comm) {
  const std::vector<float> maxima = row_maxima(logits, range, plan, setup, comm);
  const auto n = static_cast<std::size_t>(range.size());
  std::vector<float> packed(3 * n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t row = range.begin + static_cast<std::int64_t>(i);
    if (!plan.rows[static_cast<std::size_t>(row)].valid) continue;
    const T* x = logits.row(row);
    CompensatedSum sum_exp, sum_shifted;
    for (std::int64_t v = 0; v < logits.width; ++v) {
      const float shifted = capped(widen(x[v]), setup.softcap).value - maxima[i];
      sum_exp.add(std::exp(shifted));
      sum_shifted.add(shifted);
    }
    packed[i] = sum_exp.value();
    const std::int64_t target = in.labels[row] - in.vocab_begin;
    if (target >= 0 && target < logits.width) packed[n + i] = capped(widen(x[target]), setup.softcap).value - maxima[i];
    packed[2 * n + i] = sum_shifted.value();
  }
  std::vector<float> local_sum_shifted;  // the partition-vocab bug's Z: this shard's own, before the sum
  if (setup.shard_local_mean) local_sum_shifted.assign(packed.begin() + 2 * n, packed.end());
  allreduce(comm, LV_GROUP_TP, packed, LV_REDUCE_SUM);

  std::vector<RowStats> stats(n, RowStats{kNegInf, 0.0f, 0.0f, 0.0f});
  for (std::size_t i = 0; i < n; ++i) {
    if (!plan.rows[static_cast<std::size_t>(range.begin) + i].valid) continue;
    const float sum_shifted = setup.shard_local_mean ? local_sum_shifted[i] : packed[2 * n + i];
    stats[i] = {maxima[i], std::log(packed[i]), packed[n + i], sum_shifted};
  }
  return stats;
}

// Step 3: l = lse - sum_v q_v x_v + w_z lse^2 = log S - [q_off Z + (q_on - q_off)(x_l - M)] + w_z lse^2,
// since sum_v q_v = 1 lets M cancel; log p is never taken.
float cross_entropy_loss(const RowStats& s, const CrossEntropySetup& setup) {
  const TargetWeights q = setup.q;
  const float smoothing_term = q.off_target * s.sum_shifted + (q.on_target - q.off_target) * s.target_shifted;
  const float lse = s.lse();
  return s.log_sum - smoothing_term + setup.z_loss_weight * lse * lse;
}

// Step 4: dl/dx_v = [p_v (1 + 2 w_z lse) - q_v] times the softcap's slope, times the row's backward weight.
template <class T>
void cross_entropy_grad_row(const T* x, T* grad, std::int64_t width, std::int64_t target, const RowStats& s,
                            const CrossEntropySetup& setup, float backward_weight) {
  const float lse = s.lse();
  const float z_factor = 1.0f + 2.0f * setup.z_loss_weight * lse;
  for (std::int64_t v = 0; v < width; ++v) {
    const Logit logit = capped(widen(x[v]), setup.softcap);
    const float p = std::exp((logit.value - s.max) - s.log_sum);
    const float q = v == target ? setup.q.on_target : setup.q.off_target;
    grad[v] = narrow<T>(backward_weight * ((p * z_factor - q) * logit.slope));
  }
}

template <class T>
void cross_entropy_micro_batch(const lv_rank_inputs& in, lv_rank_outputs& out, RowRange range, const BatchPlan& plan,
                               const Options& options, const Collectives& comm) {
  const std::int64_t width = in.vocab_end - in.vocab_begin;
  const Matrix<T> logits{static_cast<const T*>(in.logits), width};
  const CrossEntropySetup setup = cross_entropy_setup(in, options, width);
  const std::vector<RowStats> stats = cross_entropy_stats(in, logits, range, plan, setup, comm);
  T* grad = static_cast<T*>(out.grad);
  for (std::int64_t i = 0; i < range.size(); ++i) {
    const std::int64_t row = range.begin + i;
    const RowPlan& row_plan = plan.rows[static_cast<std::size_t>(row)];
    if (!row_plan.valid) continue;
    const RowStats& s = stats[static_cast<std::size_t>(i)];
    out.token_loss[row] = cross_entropy_loss(s, setup);
    cross_entropy_grad_row(logits.row(row), grad + row * width, width, in.labels[row] - in.vocab_begin, s, setup,
                           row_plan.backward_weight);
  }
}

// ---- Knowledge distillation ---------------------------------------------------------------------
// Forward KL(P || Q) with P = softmax(y / T) the teacher's, Q = softmax(x / T) the student's.

struct KdRowStats {
  float lse_student;  // log sum exp(x / T)
  float lse_teacher;  // log sum exp(y / T)
  float divergence;   // KL(P || Q), unscaled
};

// With a = x/T, b = y/T: KL = W / S_b + (M_a - M_b) + log(S_a / S_b), W = sum_v exp(b_v - M_b)(b_v - a_v).
// No log P or log Q is taken, and student = teacher gives W = 0 and KL = 0 exactly.
template <class T>
std::vector<KdRowStats> kd_stats(Matrix<T> student, Matrix<T> teacher, RowRange range, const BatchPlan& plan,
                                 float inverse_t, const Collectives& comm) {
  const auto n = static_cast<std::size_t>(range.size());
  auto a_of = [&](std::int64_t row, std::int64_t v) { return widen(student.row(row)[v]) * inverse_t; };
  auto b_of = [&](std::int64_t row, std::int64_t v) { return widen(teacher.row(row)[v]) * inverse_t; };
  auto counts = [&](std::size_t i) { return plan.rows[static_cast<std::size_t>(range.begin) + i].valid; };

  std::vector<float> maxima(2 * n, kNegInf);  // [M_a | M_b]
  for (std::size_t i = 0; i < n; ++i) {
    if (!counts(i)) continue;
    const std::int64_t row = range.begin + static_cast<std::int64_t>(i);
    for (std::int64_t v = 0; v < student.width; ++v) {
      maxima[i] = std::fmax(maxima[i], a_of(row, v));
      maxima[n + i] = std::fmax(maxima[n + i], b_of(row, v));
    }
  }
  allreduce(comm, LV_GROUP_TP, maxima, LV_REDUCE_MAX);

  std::vector<float> packed(3 * n, 0.0f);  // [S_a | S_b | W]
  for (std::size_t i = 0; i < n; ++i) {
    if (!counts(i)) continue;
    const std::int64_t row = range.begin + static_cast<std::int64_t>(i);
    CompensatedSum sum_student, sum_teacher, weighted_gap;
    for (std::int64_t v = 0; v < student.width; ++v) {
      const float a = a_of(row, v), b = b_of(row, v);
      const float teacher_weight = std::exp(b - maxima[n + i]);
      sum_student.add(std::exp(a - maxima[i]));
      sum_teacher.add(teacher_weight);
      weighted_gap.add(teacher_weight * (b - a));
    }
    packed[i] = sum_student.value();
    packed[n + i] = sum_teacher.value();
    packed[2 * n + i] = weighted_gap.value();
  }
  allreduce(comm, LV_GROUP_TP, packed, LV_REDUCE_SUM);

  std::vector<KdRowStats> stats(n, KdRowStats{0.0f, 0.0f, 0.0f});
  for (std::size_t i = 0; i < n; ++i) {
    if (!counts(i)) continue;
    const float s_a = packed[i], s_b = packed[n + i], w = packed[2 * n + i];
    stats[i] = {maxima[i] + std::log(s_a), maxima[n + i] + std::log(s_b),
                w / s_b + ((maxima[i] - maxima[n + i]) + std::log(s_a / s_b))};
  }
  return stats;
}

// k = T^s KL, dk/dx_v = T^(s-1) (Q_v - P_v), s = 2 with T^2 scaling, else 0.
template <class T>
void kd_micro_batch(const lv_rank_inputs& in, lv_rank_outputs& out, RowRange range, const BatchPlan& plan,
                    const Collectives& comm) {
  const std::int64_t width = in.vocab_end - in.vocab_begin;
  const Matrix<T> student{static_cast<const T*>(in.logits), width};
  const Matrix<T> teacher{static_cast<const T*>(in.teacher_logits), width};
  const double temperature = in.loss.temperature;
  const int power = in.loss.t2_scaling != 0 ? 2 : 0;
  const auto loss_scale = static_cast<float>(std::pow(temperature, power));
  const auto grad_scale = static_cast<float>(std::pow(temperature, power - 1));
  const auto inverse_t = static_cast<float>(1.0 / temperature);
  const std::vector<KdRowStats> stats = kd_stats(student, teacher, range, plan, inverse_t, comm);
  T* grad = static_cast<T*>(out.grad);
  for (std::int64_t i = 0; i < range.size(); ++i) {
    const std::int64_t row = range.begin + i;
    const RowPlan& row_plan = plan.rows[static_cast<std::size_t>(row)];
    if (!row_plan.valid) continue;
    const KdRowStats& s = stats[static_cast<std::size_t>(i)];
    out.token_loss[row] = loss_scale * s.divergence;
    const T* x = student.row(row);
    const T* y = teacher.row(row);
    for (std::int64_t v = 0; v < width; ++v) {
      const float q = std::exp(widen(x[v]) * inverse_t - s.lse_student);
      const float p = std::exp(widen(y[v]) * inverse_t - s.lse_teacher);
      grad[row * width + v] = narrow<T>(row_plan.backward_weight * grad_scale * (q - p));
    }
  }
}

// ---- The rank -----------------------------------------------------------------------------------

template <class T>
void run_typed(const lv_rank_inputs& in, lv_rank_outputs& out, const Options& options, const Collectives& comm) {
  auto sum_over_dp_cp = [&comm](auto value) {
    comm.allreduce(LV_GROUP_DP_CP, &value, 1, LV_REDUCE_SUM);
    return value;
  };
  const BatchPlan plan = plan_batch(in, HostRows{in.labels, in.loss_mask, in.upstream_weights}, sum_over_dp_cp);
  zero_rows_that_do_not_count<T>(plan, out, in.vocab_end - in.vocab_begin);
  for (std::int32_t k = 0; k < in.ga; ++k) {
    const RowRange range{in.micro_batch_begin[k], in.micro_batch_begin[k + 1]};
    // An empty micro-batch: the TP peers, holding the same rows, skip it too.
    if (range.size() == 0) continue;
    if (in.loss.kind == LV_LOSS_KD) {
      kd_micro_batch<T>(in, out, range, plan, comm);
    } else {
      cross_entropy_micro_batch<T>(in, out, range, plan, options, comm);
    }
  }
  out.grad_rows = in.rows;
  out.grad_columns = in.vocab_end - in.vocab_begin;
  out.token_loss_count = in.rows;
  out.logged_num_tokens = plan.valid_tokens;
  out.has_logged_loss = in.loss.reduction != LV_REDUCTION_NONE;
  if (out.has_logged_loss != 0) out.logged_loss = logged_loss(plan, out.token_loss, sum_over_dp_cp);
}

// The kind on the case's logits, or behind the LM head when the case has one.
template <class T>
void run_head_and_kind(const lv_rank_inputs& in, lv_rank_outputs& out, const Options& options,
                       const Collectives& comm) {
  if (!has_head(in)) return run_typed<T>(in, out, options, comm);
  run_with_head<T>(in, out, options.head, comm,
                   [&](const lv_rank_inputs& kind_inputs) { run_typed<T>(kind_inputs, out, options, comm); });
}

void run(const lv_rank_inputs& in, lv_rank_outputs& out, const Collectives& comm) {
  check_rank_inputs(in, out);
  if (in.memory != LV_MEMORY_HOST) throw std::invalid_argument("inputs are not in host memory");
  if (in.loss.kind == LV_LOSS_KD && in.teacher_logits == nullptr) {
    throw std::invalid_argument("KD without teacher logits");
  }
  const Options options = parse_options(in.params);
  if (in.loss.kind == LV_LOSS_POLICY) return run_policy(in, out, options.policy, comm);
  switch (in.dtype) {
    case LV_DTYPE_F32:
      return run_head_and_kind<float>(in, out, options, comm);
    case LV_DTYPE_BF16:
      return run_head_and_kind<Bf16>(in, out, options, comm);
    case LV_DTYPE_F16:
      return run_head_and_kind<Fp16>(in, out, options, comm);
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<int>(in.dtype)));
}

int run_rank(const lv_rank_inputs* inputs, lv_rank_outputs* outputs, const lv_collectives* collectives) {
  return run_guarded(*outputs, [&] { run(*inputs, *outputs, Collectives(*collectives)); });
}

int check_params(const char* params, char* error, size_t error_size) {
  return check_bug_parameters(params, kParameters, error, error_size);
}

const lv_plugin kPlugin = {
    LV_PLUGIN_ABI_VERSION,
    "example-cpu-cross-entropy",
    "example plugin: vocabulary-parallel cross-entropy, KD and the RL policy loss on the host, "
    "and the LM head in front of cross-entropy and KD (bug=smoothing-partition-vocab, bug=rl-kl-no-grad, "
    "bug=rl-temperature-one-side, bug=rl-gspo-cp-local-ratio, bug=head-dh-shard-partial available)",
    LV_MEMORY_HOST,
    LV_SUPPORTS_CROSS_ENTROPY | LV_SUPPORTS_KD | LV_SUPPORTS_POLICY | LV_SUPPORTS_POLICY_SEQUENCE_RATIO |
        LV_SUPPORTS_LM_HEAD,
    run_rank,
    check_params,
};

}  // namespace

extern "C" const lv_plugin* lossverify_plugin(void) { return &kPlugin; }
