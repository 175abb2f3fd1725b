#include "lossverify/impl/cpu/sharded_loss.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/math/cross_entropy_math.hpp"
#include "lossverify/math/kd_math.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/impl/row_loss.hpp"
#include <optional>

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Sum of f(v) for v in [0, n) with 8 independent float32 lanes (vectorizable, shallow error growth).
template <class F>
float lane_sum(std::int64_t n, F f) {
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) lanes[k] += f(i + k);
  }
  for (int k = 0; i < n; ++i, ++k) lanes[k] += f(i);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}


class RankKernel {
 public:
  RankKernel(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
             const BugSwitches& bugs, const CpuKernelOptions& options)
      : case_(c), inputs_(inputs), groups_(groups), bugs_(bugs), threads_(options.threads) {
    out_.assignment = std::move(assignment);
    out_.dtype = c.inputs.dtype;
  }

  template <class T>
  RankOutput run() {
    const auto start = Clock::now();
    const double collectives_before = collective_seconds();
    // The rank generates exactly its own shard (the whole vocabulary under full-vocab-through-tp).
    const VocabRange vocab = out_.assignment.vocab;
    work_ = full_vocab() ? VocabRange{0, case_.shape.vocab} : vocab;
    std::vector<T> student(static_cast<std::size_t>(rows() * work_.size()));
    std::vector<T> teacher;
    if (kd()) teacher.resize(student.size());
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < rows(); ++i) {
      beat_row(beacon_, i);
      const LocalRow& row = out_.assignment.rows[static_cast<std::size_t>(i)];
      T* s = student.data() + i * work_.size();
      if (row.token < 0) {
        inputs_.padding_logits(row.sequence, row.position, work_.begin, work_.end, s);
        if (kd()) inputs_.padding_logits(row.sequence, row.position, work_.begin, work_.end, teacher.data() + i * work_.size());
      } else {
        inputs_.logits(row.token, work_.begin, work_.end, s);
        if (kd()) inputs_.teacher_logits(row.token, work_.begin, work_.end, teacher.data() + i * work_.size());
      }
    }
    out_.generate_seconds = seconds_since(start);
    const auto compute_start = Clock::now();

    plan_.emplace(case_, inputs_, out_.assignment, groups_, bugs_);
    out_.logged_valid_tokens = plan_->logged_valid_tokens();
    out_.token_loss.assign(static_cast<std::size_t>(rows()), 0.0f);
    out_.grad.assign(static_cast<std::size_t>(rows() * vocab.size()) * sizeof(T), std::byte{0});
    const auto& offsets = out_.assignment.micro_batch_begin;
    for (std::size_t k = 0; k + 1 < offsets.size(); ++k) {
      if (offsets[k + 1] == offsets[k]) continue;  // an empty micro-batch: TP peers skip it too
      if (kd()) {
        kd_micro_batch<T>(offsets[k], offsets[k + 1], student.data(), teacher.data());
      } else {
        cross_entropy_micro_batch<T>(offsets[k], offsets[k + 1], student.data());
      }
    }
    if (const auto logged = plan_->logged_loss(out_.token_loss, groups_.batch)) {
      out_.has_reduced_loss = true;
      out_.reduced_loss = *logged;
    }
    out_.collective_seconds = collective_seconds() - collectives_before;
    out_.compute_seconds = seconds_since(compute_start) - out_.collective_seconds;
    return std::move(out_);
  }

 private:
  bool kd() const { return case_.loss.kind == LossKind::kd; }
  // A cross-entropy switch: the KD path never gathers the vocabulary.
  bool full_vocab() const { return bugs_.full_vocab_through_tp && !kd(); }
  std::int64_t rows() const { return out_.rows(); }
  double collective_seconds() const {
    return groups_.tp.collective_seconds() + groups_.batch.collective_seconds() + groups_.dp.collective_seconds();
  }

  template <class T>
  void cross_entropy_micro_batch(std::int64_t begin, std::int64_t end, T* logits) {
    const LossSpec& loss = case_.loss;
    const std::int64_t n = end - begin;
    const std::int64_t width = work_.size();
    const VocabRange out_vocab = out_.assignment.vocab;
    const std::int64_t cols = out_vocab.size();
    // Under full-vocab-through-tp every rank believes its columns start at tp * width.
    const std::int64_t owner_base =
        full_vocab() ? out_.assignment.coordinates.tp * width : work_.begin;
    const float cap = static_cast<float>(loss.softcap);
    auto load = [cap](T raw) {
      const float x = static_cast<float>(raw);
      return cap > 0.0f ? cap * std::tanh(x / cap) : x;
    };
    auto row_of = [&](std::int64_t i) { return logits + (begin + i) * width; };
    auto plan = [&](std::int64_t i) -> const RowPlan& { return plan_->row(begin + i); };

    // 1. Global row max (skipped entirely by the no-max-shift bug).
    std::vector<float> row_max(static_cast<std::size_t>(n), bugs_.no_max_shift ? 0.0f : kNegInf);
    if (!bugs_.no_max_shift) {
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
      for (std::int64_t i = 0; i < n; ++i) {
        beat_row(beacon_, i);
        if (!plan(i).active) continue;
        const T* x = row_of(i);
        float m = kNegInf;
        for (std::int64_t v = 0; v < width; ++v) m = std::fmax(m, load(x[v]));
        row_max[static_cast<std::size_t>(i)] = m;
      }
      groups_.tp.allreduce_max(row_max);
    }

    // 2. One packed all-reduce: [S | x_l - M | sum(x - M)].
    const bool smoothing = loss.label_smoothing > 0.0;
    const int packed_width = smoothing ? 3 : 2;
    std::vector<float> packed(static_cast<std::size_t>(n * packed_width), 0.0f);
    float* sum_exp = packed.data();
    float* target_shifted = packed.data() + n;
    float* sum_shifted = smoothing ? packed.data() + 2 * n : nullptr;
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < n; ++i) {
      beat_row(beacon_, i);
      if (!plan(i).active) continue;
      const T* x = row_of(i);
      const float m = row_max[static_cast<std::size_t>(i)];
      sum_exp[i] = lane_sum(width, [&](std::int64_t v) { return std::exp(load(x[v]) - m); });
      if (smoothing) sum_shifted[i] = lane_sum(width, [&](std::int64_t v) { return load(x[v]) - m; });
      const std::int64_t local = plan(i).label - owner_base;
      if (local >= 0 && local < width) target_shifted[i] = load(x[local]) - m;
    }
    std::vector<float> local_sum_shifted;
    if (smoothing) local_sum_shifted.assign(sum_shifted, sum_shifted + n);
    groups_.tp.allreduce_sum(packed);

    std::vector<float> log_sum(static_cast<std::size_t>(n), 0.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      if (plan(i).active) log_sum[static_cast<std::size_t>(i)] = std::log(sum_exp[i]);
    }

    // The smoothing sum the forward uses: global, shard-local, or rebuilt from log(exp(x - M) / S).
    std::vector<float> smoothing_sum(static_cast<std::size_t>(n), 0.0f);
    if (smoothing) {
      for (std::int64_t i = 0; i < n; ++i) {
        smoothing_sum[static_cast<std::size_t>(i)] =
            bugs_.smoothing_sum_local_forward ? local_sum_shifted[static_cast<std::size_t>(i)] : sum_shifted[i];
      }
      if (bugs_.smoothing_log_after_exp) {
        std::vector<float> sum_log_p(static_cast<std::size_t>(n), 0.0f);
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
        for (std::int64_t i = 0; i < n; ++i) {
          beat_row(beacon_, i);
          if (!plan(i).active) continue;
          const T* x = row_of(i);
          const float m = row_max[static_cast<std::size_t>(i)];
          const float s = sum_exp[i];
          sum_log_p[static_cast<std::size_t>(i)] =
              lane_sum(width, [&](std::int64_t v) { return std::log(std::exp(load(x[v]) - m) / s); });
        }
        if (!bugs_.smoothing_sum_local_forward) groups_.tp.allreduce_sum(sum_log_p);
        const auto terms = static_cast<float>(bugs_.smoothing_sum_local_forward ? width : case_.shape.vocab);
        for (std::int64_t i = 0; i < n; ++i) {
          smoothing_sum[static_cast<std::size_t>(i)] =
              sum_log_p[static_cast<std::size_t>(i)] + terms * log_sum[static_cast<std::size_t>(i)];
        }
      }
    }

    const auto z_weight = static_cast<float>(loss.z_loss_weight);
    const auto shard_vocab = static_cast<float>(width);
    const SmoothingPair smoothing_pair = smoothing_for(case_, bugs_, shard_vocab);
    const SmoothingWeights<float> q_backward = smoothing_pair.backward;

    // 3. Per-token loss.
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const RowPlan& p = plan(i);
      if (!p.active) continue;
      out_.token_loss[static_cast<std::size_t>(begin + i)] = cross_entropy_row_loss(
          p, row_max[k], log_sum[k], target_shifted[i], smoothing ? smoothing_sum[k] : 0.0f,
          local_sum_shifted.empty() ? 0.0f : local_sum_shifted[k], shard_vocab, smoothing_pair.forward, z_weight, bugs_);
    }

    // 4. Gradient of this rank's columns; inactive rows keep their exact zeros.
    T* grad = reinterpret_cast<T*>(out_.grad.data());
    const std::int64_t column_offset = out_vocab.begin - work_.begin;
    const std::int64_t target_shift = owner_base - work_.begin;  // column c is the target if c + shift == label
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < n; ++i) {
      beat_row(beacon_, i);
      const auto k = static_cast<std::size_t>(i);
      const RowPlan& p = plan(i);
      if (!p.active) continue;
      T* x = row_of(i) + column_offset;
      T* g = grad + (begin + i) * cols;
      const float shift = row_max[k] + log_sum[k];  // lse
      const float z_factor = 1.0f + 2.0f * z_weight * shift;
      const std::int64_t target_column = p.label - out_vocab.begin - target_shift;
      for (std::int64_t v = 0; v < cols; ++v) {
        const float xv = load(x[v]);
        const float probability = std::exp((xv - row_max[k]) - log_sum[k]);
        float value = 0.0f;
        if (!p.valid) {
          value = 2.0f * z_weight * shift * probability;
        } else if (bugs_.zloss_grad_after_smoothing) {
          const float q = v == target_column ? q_backward.on_target : q_backward.off_target;
          value = (probability - q) * z_factor;
        } else {
          value = cross_entropy_grad(probability, v == target_column, q_backward, z_factor);
        }
        if (cap > 0.0f) value *= 1.0f - (xv / cap) * (xv / cap);
        if (bugs_.overwrites_input) {  // the softmax over its own input, then that buffer as the gradient
          x[v] = T(probability);
          g[v] = x[v];
        } else if (bugs_.grad_rounded_early) {
          g[v] = T(static_cast<float>(T(value)) * p.backward_weight);
        } else {
          g[v] = T(p.backward_weight * value);
        }
      }
    }
  }

  template <class T>
  void kd_micro_batch(std::int64_t begin, std::int64_t end, const T* student, const T* teacher) {
    const LossSpec& loss = case_.loss;
    const std::int64_t n = end - begin;
    const std::int64_t cols = work_.size();
    const auto inverse_t = static_cast<float>(1.0 / loss.temperature);
    const bool local_softmax = bugs_.kd_local_softmax;
    const KdScales scales = kd_scales(loss, bugs_, case_.layout.tp);
    const float loss_scale = scales.loss;
    const float grad_scale = scales.grad;
    auto plan = [&](std::int64_t i) -> const RowPlan& { return plan_->row(begin + i); };
    auto a_of = [&](std::int64_t i, std::int64_t v) {
      return static_cast<float>(student[(begin + i) * cols + v]) * inverse_t;
    };
    auto b_of = [&](std::int64_t i, std::int64_t v) {
      return static_cast<float>(teacher[(begin + i) * cols + v]) * inverse_t;
    };

    // 1. Student and teacher maxima in one all-reduce: [M_a | M_b].
    std::vector<float> maxima(static_cast<std::size_t>(2 * n), kNegInf);
    std::vector<std::int64_t> local_argmax(static_cast<std::size_t>(n), 0);
    for (std::int64_t i = 0; i < n; ++i) {
      beat_row(beacon_, i);
      if (!plan(i).active) continue;
      for (std::int64_t v = 0; v < cols; ++v) {
        const float a = a_of(i, v);
        if (a > maxima[static_cast<std::size_t>(i)]) {
          maxima[static_cast<std::size_t>(i)] = a;
          local_argmax[static_cast<std::size_t>(i)] = v;
        }
        maxima[static_cast<std::size_t>(n + i)] = std::fmax(maxima[static_cast<std::size_t>(n + i)], b_of(i, v));
      }
    }
    if (!local_softmax) groups_.tp.allreduce_max(maxima);

    // 2. One packed all-reduce: [S_a | S_b | sum exp(b - M_b)(b - a) (| sum exp(b - M_b)(a - M_a))].
    const bool cross_entropy_value = bugs_.kd_cross_entropy_value;
    const int width = cross_entropy_value ? 4 : 3;
    std::vector<float> packed(static_cast<std::size_t>(width * n), 0.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      beat_row(beacon_, i);
      if (!plan(i).active) continue;
      const float ma = maxima[static_cast<std::size_t>(i)];
      const float mb = maxima[static_cast<std::size_t>(n + i)];
      packed[static_cast<std::size_t>(i)] = lane_sum(cols, [&](std::int64_t v) { return std::exp(a_of(i, v) - ma); });
      packed[static_cast<std::size_t>(n + i)] =
          lane_sum(cols, [&](std::int64_t v) { return std::exp(b_of(i, v) - mb); });
      packed[static_cast<std::size_t>(2 * n + i)] = lane_sum(
          cols, [&](std::int64_t v) { return std::exp(b_of(i, v) - mb) * (b_of(i, v) - a_of(i, v)); });
      if (cross_entropy_value) {
        packed[static_cast<std::size_t>(3 * n + i)] =
            lane_sum(cols, [&](std::int64_t v) { return std::exp(b_of(i, v) - mb) * (a_of(i, v) - ma); });
      }
    }
    std::vector<float> divergence(static_cast<std::size_t>(n), 0.0f);
    if (local_softmax) {
      // Each shard's own KL, summed over the TP group: every rank reports the same (wrong) value.
      for (std::int64_t i = 0; i < n; ++i) {
        if (!plan(i).active) continue;
        divergence[static_cast<std::size_t>(i)] = kl_from_sums(
            packed[static_cast<std::size_t>(i)], packed[static_cast<std::size_t>(n + i)],
            packed[static_cast<std::size_t>(2 * n + i)], maxima[static_cast<std::size_t>(i)],
            maxima[static_cast<std::size_t>(n + i)]);
      }
      groups_.tp.allreduce_sum(divergence);
    } else {
      groups_.tp.allreduce_sum(packed);
    }

    // 3. Per-token loss.
    std::vector<float> lse_a(static_cast<std::size_t>(n), 0.0f);
    std::vector<float> lse_b(static_cast<std::size_t>(n), 0.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (!plan(i).active) continue;
      lse_a[k] = maxima[k] + std::log(packed[k]);
      lse_b[k] = maxima[static_cast<std::size_t>(n + i)] + std::log(packed[static_cast<std::size_t>(n + i)]);
      const float value = kd_row_value(packed[k], packed[static_cast<std::size_t>(n + i)],
                                       packed[static_cast<std::size_t>(2 * n + i)],
                                       cross_entropy_value ? packed[static_cast<std::size_t>(3 * n + i)] : 0.0f,
                                       maxima[k], maxima[static_cast<std::size_t>(n + i)], divergence[k], bugs_);
      out_.token_loss[static_cast<std::size_t>(begin + i)] = loss_scale * value;
    }

    // 4. Gradient T^(s-1) (Q - P) of this rank's columns.
    T* grad = reinterpret_cast<T*>(out_.grad.data());
    for (std::int64_t i = 0; i < n; ++i) {
      beat_row(beacon_, i);
      const auto k = static_cast<std::size_t>(i);
      const RowPlan& p = plan(i);
      if (!p.active) continue;
      T* g = grad + (begin + i) * cols;
      float shard_teacher_mass = 0.0f;
      float shard_student_mass = 0.0f;
      if (bugs_.kd_untracked_allreduce) {
        shard_student_mass = lane_sum(cols, [&](std::int64_t v) { return std::exp(a_of(i, v) - lse_a[k]); });
        shard_teacher_mass = lane_sum(cols, [&](std::int64_t v) { return std::exp(b_of(i, v) - lse_b[k]); });
      }
      for (std::int64_t v = 0; v < cols; ++v) {
        const float q = std::exp(a_of(i, v) - lse_a[k]);
        const float t = std::exp(b_of(i, v) - lse_b[k]);
        float value = q - t;
        if (bugs_.kd_untracked_allreduce) {
          value = shard_teacher_mass * q - t;
          if (v == local_argmax[k]) value += shard_teacher_mass * (1.0f - shard_student_mass);
        }
        g[v] = T(p.backward_weight * grad_scale * value);
      }
    }
  }

  const Case& case_;
  const InputSource& inputs_;
  RankGroups groups_;
  const BugSwitches& bugs_;
  int threads_;
  // Captured on the rank thread, where current() is this rank's: the OpenMP workers beat through it.
  ProgressBeacon* const beacon_ = ProgressBeacon::current();
  RankOutput out_;
  std::optional<RankPlan> plan_;
  VocabRange work_;
};

}  // namespace

RankOutput run_sharded_loss(const Case& c, const InputSource& inputs, RankAssignment assignment, RankGroups groups,
                            const BugSwitches& bugs, const CpuKernelOptions& options) {
  RankKernel kernel(c, inputs, std::move(assignment), groups, bugs, options);
  return dispatch_dtype(c.inputs.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return kernel.template run<T>();
  });
}

}  // namespace lossverify
