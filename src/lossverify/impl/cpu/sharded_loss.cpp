#include "lossverify/impl/cpu/sharded_loss.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/impl/loss_protocol.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/impl/row_loss.hpp"
#include "lossverify/math/cross_entropy_math.hpp"
#include "lossverify/math/kd_math.hpp"

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

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

// The CPU kernel's side of the cross-entropy protocol over one micro-batch: float32 from the input dtype,
// OpenMP over rows.
template <class T>
class CpuCrossEntropyShard final : public CrossEntropyShard {
 public:
  struct Geometry {
    T* logits = nullptr;                 // the micro-batch's first row of the kernel's columns
    std::int64_t width = 0;              // columns the kernel sees
    T* grad = nullptr;                   // the micro-batch's first gradient row
    std::int64_t cols = 0;               // gradient columns (the rank's own)
    std::int64_t column_offset = 0;      // first gradient column within the kernel's columns
    std::int64_t label_offset = 0;       // label - this = the target's column among the kernel's columns
    std::int64_t grad_label_offset = 0;  // label - this = the target's gradient column
  };

  CpuCrossEntropyShard(const Case& c, const BugSwitches& bugs, const RankPlan& plan, std::int64_t begin, std::int64_t n,
                       const Geometry& at, int threads, ProgressBeacon* beacon)
      : case_(c),
        bugs_(bugs),
        plan_(plan),
        begin_(begin),
        n_(n),
        at_(at),
        threads_(threads),
        beacon_(beacon),
        cap_(static_cast<float>(c.loss.softcap)) {}

  // f(i) for every active row of the micro-batch, over the shard's OpenMP threads.
  template <class F>
  void for_active_rows(F f) const {
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < n_; ++i) {
      beat_row(beacon_, i);
      if (!active(i)) continue;
      f(i);
    }
  }

  void local_max(std::span<float> max) override {
    for_active_rows([&](std::int64_t i) {
      const T* x = row(i);
      float m = kNegInf;
      for (std::int64_t v = 0; v < at_.width; ++v) m = std::fmax(m, load(x[v]));
      max[static_cast<std::size_t>(i)] = m;
    });
  }

  void shifted_sums(std::span<const float> max, std::span<float> sum_exp, std::span<float> target_shifted,
                    std::span<float> sum_shifted) override {
    const bool smoothing = case_.loss.label_smoothing > 0.0;
    for_active_rows([&](std::int64_t i) {
      const auto k = static_cast<std::size_t>(i);
      const T* x = row(i);
      const float m = max[k];
      sum_exp[k] = lane_sum(at_.width, [&](std::int64_t v) { return std::exp(load(x[v]) - m); });
      if (smoothing) sum_shifted[k] = lane_sum(at_.width, [&](std::int64_t v) { return load(x[v]) - m; });
      const std::int64_t local = plan_.row(begin_ + i).label - at_.label_offset;
      if (local >= 0 && local < at_.width) target_shifted[k] = load(x[local]) - m;
    });
  }

  void sum_log_p(std::span<const float> max, std::span<const float> sum_exp, std::span<float> out) override {
    for_active_rows([&](std::int64_t i) {
      const auto k = static_cast<std::size_t>(i);
      const T* x = row(i);
      const float m = max[k];
      const float s = sum_exp[k];
      out[k] = lane_sum(at_.width, [&](std::int64_t v) { return std::log(std::exp(load(x[v]) - m) / s); });
    });
  }

  void gradient(std::span<const float> max, std::span<const float> log_sum) override {
    const auto z_weight = static_cast<float>(case_.loss.z_loss_weight);
    const SmoothingWeights<float> q = smoothing_for(case_, bugs_, static_cast<float>(at_.width)).backward;
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < n_; ++i) {
      beat_row(beacon_, i);
      const RowPlan& p = plan_.row(begin_ + i);
      if (!p.active) continue;
      const auto k = static_cast<std::size_t>(i);
      T* x = row(i) + at_.column_offset;
      T* g = at_.grad + i * at_.cols;
      const float shift = max[k] + log_sum[k];  // lse
      const float z_factor = 1.0f + 2.0f * z_weight * shift;
      const std::int64_t target_column = p.label - at_.grad_label_offset;
      for (std::int64_t v = 0; v < at_.cols; ++v) {
        const float xv = load(x[v]);
        const float probability = std::exp((xv - max[k]) - log_sum[k]);
        float value = 0.0f;
        if (!p.valid) {
          value = 2.0f * z_weight * shift * probability;
        } else if (bugs_.zloss_grad_after_smoothing) {
          value = (probability - (v == target_column ? q.on_target : q.off_target)) * z_factor;
        } else {
          value = cross_entropy_grad(probability, v == target_column, q, z_factor);
        }
        if (cap_ > 0.0f) value *= 1.0f - (xv / cap_) * (xv / cap_);
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

 private:
  bool active(std::int64_t i) const { return plan_.row(begin_ + i).active; }
  T* row(std::int64_t i) const { return at_.logits + i * at_.width; }
  float load(T raw) const {
    const float x = static_cast<float>(raw);
    return cap_ > 0.0f ? cap_ * std::tanh(x / cap_) : x;
  }

  const Case& case_;
  const BugSwitches& bugs_;
  const RankPlan& plan_;
  const std::int64_t begin_;
  const std::int64_t n_;
  const Geometry at_;
  const int threads_;
  ProgressBeacon* const beacon_;
  const float cap_;
};

// The CPU kernel's side of the KD protocol over one micro-batch (serial over rows).
template <class T>
class CpuKdShard final : public KdShard {
 public:
  CpuKdShard(const Case& c, const BugSwitches& bugs, const RankPlan& plan, std::int64_t begin, std::int64_t n,
             std::int64_t cols, const T* student, const T* teacher, T* grad, ProgressBeacon* beacon)
      : bugs_(bugs),
        plan_(plan),
        begin_(begin),
        n_(n),
        cols_(cols),
        student_(student),
        teacher_(teacher),
        grad_(grad),
        beacon_(beacon),
        inverse_t_(static_cast<float>(1.0 / c.loss.temperature)),
        local_argmax_(static_cast<std::size_t>(n), 0) {}

  void local_maxima(std::span<float> maxima) override {
    for (std::int64_t i = 0; i < n_; ++i) {
      beat_row(beacon_, i);
      if (!active(i)) continue;
      const auto k = static_cast<std::size_t>(i);
      for (std::int64_t v = 0; v < cols_; ++v) {
        const float a = a_of(i, v);
        if (a > maxima[k]) {
          maxima[k] = a;
          local_argmax_[k] = v;
        }
        maxima[static_cast<std::size_t>(n_ + i)] = std::fmax(maxima[static_cast<std::size_t>(n_ + i)], b_of(i, v));
      }
    }
  }

  void shifted_sums(std::span<const float> maxima, std::span<float> packed) override {
    const bool cross_entropy_value = packed.size() == static_cast<std::size_t>(4 * n_);
    for (std::int64_t i = 0; i < n_; ++i) {
      beat_row(beacon_, i);
      if (!active(i)) continue;
      const float ma = maxima[static_cast<std::size_t>(i)];
      const float mb = maxima[static_cast<std::size_t>(n_ + i)];
      packed[static_cast<std::size_t>(i)] = lane_sum(cols_, [&](std::int64_t v) { return std::exp(a_of(i, v) - ma); });
      packed[static_cast<std::size_t>(n_ + i)] =
          lane_sum(cols_, [&](std::int64_t v) { return std::exp(b_of(i, v) - mb); });
      packed[static_cast<std::size_t>(2 * n_ + i)] =
          lane_sum(cols_, [&](std::int64_t v) { return std::exp(b_of(i, v) - mb) * (b_of(i, v) - a_of(i, v)); });
      if (cross_entropy_value) {
        packed[static_cast<std::size_t>(3 * n_ + i)] =
            lane_sum(cols_, [&](std::int64_t v) { return std::exp(b_of(i, v) - mb) * (a_of(i, v) - ma); });
      }
    }
  }

  void gradient(std::span<const float> lse_a, std::span<const float> lse_b, std::span<const float> weight) override {
    for (std::int64_t i = 0; i < n_; ++i) {
      beat_row(beacon_, i);
      if (!active(i)) continue;
      const auto k = static_cast<std::size_t>(i);
      T* g = grad_ + i * cols_;
      float shard_teacher_mass = 0.0f;
      float shard_student_mass = 0.0f;
      if (bugs_.kd_untracked_allreduce) {
        shard_student_mass = lane_sum(cols_, [&](std::int64_t v) { return std::exp(a_of(i, v) - lse_a[k]); });
        shard_teacher_mass = lane_sum(cols_, [&](std::int64_t v) { return std::exp(b_of(i, v) - lse_b[k]); });
      }
      for (std::int64_t v = 0; v < cols_; ++v) {
        const float q = std::exp(a_of(i, v) - lse_a[k]);
        const float t = std::exp(b_of(i, v) - lse_b[k]);
        float value = q - t;
        if (bugs_.kd_untracked_allreduce) {
          value = shard_teacher_mass * q - t;
          if (v == local_argmax_[k]) value += shard_teacher_mass * (1.0f - shard_student_mass);
        }
        g[v] = T(weight[k] * value);
      }
    }
  }

 private:
  bool active(std::int64_t i) const { return plan_.row(begin_ + i).active; }
  float a_of(std::int64_t i, std::int64_t v) const { return static_cast<float>(student_[i * cols_ + v]) * inverse_t_; }
  float b_of(std::int64_t i, std::int64_t v) const { return static_cast<float>(teacher_[i * cols_ + v]) * inverse_t_; }

  const BugSwitches& bugs_;
  const RankPlan& plan_;
  const std::int64_t begin_;
  const std::int64_t n_;
  const std::int64_t cols_;
  const T* student_;
  const T* teacher_;
  T* grad_;
  ProgressBeacon* const beacon_;
  const float inverse_t_;
  std::vector<std::int64_t> local_argmax_;
};

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
    std::vector<T> student, teacher;
    assign_zeros_beating(student, static_cast<std::size_t>(rows() * work_.size()), beacon_);
    if (kd()) assign_zeros_beating(teacher, student.size(), beacon_);
#pragma omp parallel for num_threads(threads_) schedule(static) if (threads_ > 1)
    for (std::int64_t i = 0; i < rows(); ++i) {
      beat_row(beacon_, i);
      const LocalRow& row = out_.assignment.rows[static_cast<std::size_t>(i)];
      T* s = student.data() + i * work_.size();
      if (row.token < 0) {
        inputs_.padding_logits(row.sequence, row.position, work_.begin, work_.end, s);
        if (kd())
          inputs_.padding_logits(row.sequence, row.position, work_.begin, work_.end, teacher.data() + i * work_.size());
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
    assign_zeros_beating(out_.grad, static_cast<std::size_t>(rows() * vocab.size()) * sizeof(T), beacon_);
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
    const std::int64_t width = work_.size();
    const VocabRange out_vocab = out_.assignment.vocab;
    typename CpuCrossEntropyShard<T>::Geometry at;
    at.logits = logits + begin * width;
    at.width = width;
    at.grad = reinterpret_cast<T*>(out_.grad.data()) + begin * out_vocab.size();
    at.cols = out_vocab.size();
    at.column_offset = out_vocab.begin - work_.begin;
    // Under full-vocab-through-tp every rank believes its columns start at tp * width.
    const std::int64_t owner_base = full_vocab() ? out_.assignment.coordinates.tp * width : work_.begin;
    at.label_offset = owner_base;
    at.grad_label_offset = out_vocab.begin + (owner_base - work_.begin);
    CpuCrossEntropyShard<T> shard(case_, bugs_, *plan_, begin, end - begin, at, threads_, beacon_);
    cross_entropy_protocol(case_, bugs_, *plan_, groups_, begin, end - begin, width, shard, out_.token_loss);
  }

  template <class T>
  void kd_micro_batch(std::int64_t begin, std::int64_t end, const T* student, const T* teacher) {
    const std::int64_t cols = work_.size();
    CpuKdShard<T> shard(case_, bugs_, *plan_, begin, end - begin, cols, student + begin * cols, teacher + begin * cols,
                        reinterpret_cast<T*>(out_.grad.data()) + begin * cols, beacon_);
    kd_protocol(case_, bugs_, *plan_, groups_, begin, end - begin, shard, out_.token_loss);
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
