// Cross-entropy on the CPU backend: the kernel's side of the protocol over one micro-batch, float32 from
// the input dtype, OpenMP over rows.
#include "lossverify/kinds/cross_entropy/cross_entropy_parts.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <type_traits>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/cpu/lane_sum.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_protocol.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
        cap_(static_cast<float>(cross_entropy_options(c.loss).softcap)),
        in_dtype_(bugs.compute_in_input_dtype && !std::is_same_v<T, float>) {}

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
    const bool smoothing = cross_entropy_options(case_.loss).label_smoothing > 0.0;
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
    const auto z_weight = static_cast<float>(cross_entropy_options(case_.loss).z_loss_weight);
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
      if (in_dtype_) {
        gradient_in_dtype(i, p, max[k], log_sum[k], q, z_weight);
        continue;
      }
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
  // The 16-bit control's gradient of one row (docs/checks.md, "The control band"): autograd's graph of
  // log_softmax, the negative log-likelihood, the smoothing mean and the z-loss on 16-bit tensors, each
  // node's output rounded to T and each reduction accumulated in float32. With u the token's weight:
  //   lp_v = r(x_v - lse); upstream on lp: g_v = r(-u (q_on - q_off)) [v = y] + r(-u q_off), added in T;
  //   log_softmax backward r(g_v - e^lp_v sum g); z-loss r(r(2 w_z u r(lse)) e^(x_v - r(lse))), added in T;
  //   softcap's backward r(g (1 - tanh^2)).
  void gradient_in_dtype(std::int64_t i, const RowPlan& p, float row_max, float log_sum, SmoothingWeights<float> q,
                         float z_weight) const {
    const float u = p.backward_weight;
    const float lse = row_max + log_sum;
    const float lse16 = r(lse);
    const float g_off = p.valid ? r(-u * q.off_target) : 0.0f;
    const float g_on = p.valid ? r(r(-u * (q.on_target - q.off_target)) + g_off) : 0.0f;
    const float g_sum = g_on + static_cast<float>(case_.shape.vocab - 1) * g_off;
    const float g_lse = r(2.0f * z_weight * u * lse16);
    const T* x = row(i) + at_.column_offset;
    T* g = at_.grad + i * at_.cols;
    const std::int64_t target_column = p.label - at_.grad_label_offset;
    for (std::int64_t v = 0; v < at_.cols; ++v) {
      const float xv = load(x[v]);
      const float lp = r((xv - row_max) - log_sum);
      float value = r((v == target_column ? g_on : g_off) - std::exp(lp) * g_sum);
      if (z_weight != 0.0f) value = r(value + r(g_lse * std::exp(xv - lse16)));
      if (cap_ > 0.0f) value = r(value * (1.0f - (xv / cap_) * (xv / cap_)));
      g[v] = T(value);
    }
  }
  bool active(std::int64_t i) const { return plan_.row(begin_ + i).active; }
  T* row(std::int64_t i) const { return at_.logits + i * at_.width; }
  float r(float v) const { return static_cast<float>(T(v)); }
  // The logit the kernel computes with: softcapped (c tanh(x / c), each op's output in T for the 16-bit control).
  float load(T raw) const {
    const float x = static_cast<float>(raw);
    if (cap_ <= 0.0f) return x;
    return in_dtype_ ? r(cap_ * r(std::tanh(x / cap_))) : cap_ * std::tanh(x / cap_);
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
  const bool in_dtype_;  // the 16-bit control on 16-bit logits
};

template <class T>
void run_micro_batch(const CpuMicroBatch& mb) {
  const std::int64_t width = mb.work.size();
  const VocabRange out_vocab = mb.assignment.vocab;
  typename CpuCrossEntropyShard<T>::Geometry at;
  at.logits = reinterpret_cast<T*>(mb.logits) + mb.begin * width;
  at.width = width;
  at.grad = reinterpret_cast<T*>(mb.grad) + mb.begin * out_vocab.size();
  at.cols = out_vocab.size();
  at.column_offset = out_vocab.begin - mb.work.begin;
  // Under full-vocab-through-tp every rank believes its columns start at tp * width.
  const bool full_vocab = mb.work.size() != out_vocab.size();
  const std::int64_t owner_base = full_vocab ? mb.assignment.coordinates.tp * width : mb.work.begin;
  at.label_offset = owner_base;
  at.grad_label_offset = out_vocab.begin + (owner_base - mb.work.begin);
  CpuCrossEntropyShard<T> shard(mb.c, mb.bugs, mb.plan, mb.begin, mb.n, at, mb.threads, mb.beacon);
  cross_entropy_protocol(mb.c, mb.bugs, mb.plan, mb.groups, mb.begin, mb.n, width, shard, mb.token_loss);
}

}  // namespace

void cross_entropy_cpu_micro_batch(const CpuMicroBatch& batch) {
  dispatch_dtype(batch.dtype, [&](auto type) { run_micro_batch<typename decltype(type)::type>(batch); });
}

}  // namespace lossverify
