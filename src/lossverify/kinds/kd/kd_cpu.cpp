// KD on the CPU backend: the kernel's side of the protocol over one micro-batch (serial over rows).
#include "lossverify/kinds/kd/kd_parts.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <type_traits>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/cpu/lane_sum.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"
#include "lossverify/kinds/kd/kd_protocol.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

namespace {

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
        inverse_t_(static_cast<float>(1.0 / kd_options(c.loss).temperature)),
        in_dtype_(bugs.compute_in_input_dtype && !std::is_same_v<T, float>),
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
      if (in_dtype_) {
        gradient_in_dtype(i, lse_a[k], lse_b[k], weight[k]);
        continue;
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
  // The 16-bit control's gradient of one row (docs/checks.md, "The control band"): autograd's graph of
  // kl_div(log_softmax(x / T), softmax(y / T)) T^s on 16-bit tensors, each node's output rounded to T. With
  // u = w T^s the upstream on the student's log-probabilities ls_v = r(a_v - lse_a) and P_v = r(e^(b_v - lse_b)):
  // g_v = r(-u P_v), log_softmax backward r(g_v + u e^ls_v) (the teacher's P summing to 1), then / T's r(. / T).
  void gradient_in_dtype(std::int64_t i, float lse_a, float lse_b, float weight) const {
    const float u = weight / inverse_t_;
    T* g = grad_ + i * cols_;
    for (std::int64_t v = 0; v < cols_; ++v) {
      const float ls = r(a_of(i, v) - lse_a);
      const float p = r(std::exp(b_of(i, v) - lse_b));
      g[v] = T(r(r(r(-u * p) + u * std::exp(ls)) * inverse_t_));
    }
  }
  bool active(std::int64_t i) const { return plan_.row(begin_ + i).active; }
  float r(float v) const { return static_cast<float>(T(v)); }
  // x / T and y / T (the division's output in T for the 16-bit control).
  float a_of(std::int64_t i, std::int64_t v) const { return scaled(student_[i * cols_ + v]); }
  float b_of(std::int64_t i, std::int64_t v) const { return scaled(teacher_[i * cols_ + v]); }
  float scaled(T raw) const {
    const float value = static_cast<float>(raw) * inverse_t_;
    return in_dtype_ ? r(value) : value;
  }

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
  const bool in_dtype_;  // the 16-bit control on 16-bit logits
  std::vector<std::int64_t> local_argmax_;
};

template <class T>
void run_micro_batch(const CpuMicroBatch& mb) {
  const std::int64_t cols = mb.work.size();
  const T* student = reinterpret_cast<const T*>(mb.logits);
  const T* teacher = reinterpret_cast<const T*>(mb.teacher);
  CpuKdShard<T> shard(mb.c, mb.bugs, mb.plan, mb.begin, mb.n, cols, student + mb.begin * cols,
                      teacher + mb.begin * cols, reinterpret_cast<T*>(mb.grad) + mb.begin * cols, mb.beacon);
  kd_protocol(mb.c, mb.bugs, mb.plan, mb.groups, mb.begin, mb.n, shard, mb.token_loss);
}

}  // namespace

void kd_cpu_micro_batch(const CpuMicroBatch& batch) {
  dispatch_dtype(batch.dtype, [&](auto type) { run_micro_batch<typename decltype(type)::type>(batch); });
}

}  // namespace lossverify
