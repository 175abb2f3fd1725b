// The policy kind on the CPU backend: the shard's side of the protocol (policy_protocol.hpp) over one
// micro-batch, float32 from the input dtype, OpenMP over rows.
#include <cmath>
#include <limits>
#include <span>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/cpu/lane_sum.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"
#include "lossverify/kinds/policy/policy_protocol.hpp"

namespace lossverify {

namespace {

template <class T>
class CpuPolicyShard final : public PolicyShard {
 public:
  explicit CpuPolicyShard(const CpuMicroBatch& mb) : mb_(mb), width_(mb.work.size()) {}

  // m = max_v x_v / T and its column, then S and E relative to m, and the target's u.
  void local_stats(float inverse_t, bool round_scaled, std::span<float> stats) override {
    if (round_scaled) {
      stats_of(stats, [inverse_t](T x) { return static_cast<float>(T(static_cast<float>(x) * inverse_t)); });
    } else {
      stats_of(stats, [inverse_t](T x) { return static_cast<float>(x) * inverse_t; });
    }
  }

  void gradient(float inverse_t, PolicyGradRounding rounding, std::span<const float> rows) override {
    const bool round_scaled = rounding != PolicyGradRounding::none;
    const bool logsoftmax16 = rounding == PolicyGradRounding::logsoftmax16;
    for_active_rows([&](std::int64_t i) {
      const float* r = &rows[static_cast<std::size_t>(i) * PolicyGradRow::kFloats];
      const PolicyGradRow g{r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]};
      const T* x = logits(i);
      T* out = reinterpret_cast<T*>(mb_.grad) + (mb_.begin + i) * width_;
      const auto target = static_cast<std::int64_t>(g.target);
      const auto argmax = static_cast<std::int64_t>(g.argmax);
      const float scaled_a = static_cast<float>(T(g.scale * g.a));  // log_softmax's 16-bit upstream gradient
      for (std::int64_t v = 0; v < width_; ++v) {
        const float u = round_scaled ? static_cast<float>(T(static_cast<float>(x[v]) * inverse_t))
                                     : static_cast<float>(x[v]) * inverse_t;
        const float log_p = (u - g.max) - g.log_sum;
        const float p = std::exp(log_p);
        const float delta = v == target ? 1.0f : 0.0f;
        float value = g.c * p * (log_p + g.shift);
        if (v == argmax) value += g.bonus;
        float element = 0.0f;
        if (logsoftmax16) {
          const float p16 = std::exp(static_cast<float>(T(log_p)));
          element = static_cast<float>(T(scaled_a * (delta - p16))) + g.scale * value;
        } else {
          element = g.scale * (g.a * (delta - p) + value);
        }
        out[v] = round_scaled ? T(static_cast<float>(T(element)) * inverse_t) : T(element);
      }
    });
  }

 private:
  template <class F>
  void for_active_rows(F f) const {
#pragma omp parallel for num_threads(mb_.threads) schedule(static) if (mb_.threads > 1)
    for (std::int64_t i = 0; i < mb_.n; ++i) {
      beat_row(mb_.beacon, i);
      if (mb_.plan.row(mb_.begin + i).active) f(i);
    }
  }
  template <class Scaled>
  void stats_of(std::span<float> stats, Scaled scaled) {
    for_active_rows([&](std::int64_t i) {
      const T* x = logits(i);
      float m = -std::numeric_limits<float>::infinity();
      std::int64_t at = 0;
      for (std::int64_t v = 0; v < width_; ++v) {
        const float u = scaled(x[v]);
        if (u > m) m = u, at = v;
      }
      float* s = &stats[static_cast<std::size_t>(i) * PolicyLocalStats::kFloats];
      s[0] = m;
      s[1] = lane_sum(width_, [&](std::int64_t v) { return std::exp(scaled(x[v]) - m); });
      s[2] = lane_sum(width_, [&](std::int64_t v) {
        const float u = scaled(x[v]) - m;
        return std::exp(u) * u;
      });
      const std::int64_t y = mb_.plan.row(mb_.begin + i).label - mb_.work.begin;
      s[3] = y >= 0 && y < width_ ? scaled(x[y]) - m : 0.0f;
      s[4] = static_cast<float>(at);
    });
  }
  const T* logits(std::int64_t i) const { return reinterpret_cast<const T*>(mb_.logits) + (mb_.begin + i) * width_; }

  const CpuMicroBatch& mb_;
  const std::int64_t width_;
};

}  // namespace

void policy_cpu_micro_batch(const CpuMicroBatch& mb) {
  const PolicyBatch batch{mb.c,
                          mb.bugs,
                          mb.plan,
                          mb.groups,
                          mb.begin,
                          mb.n,
                          mb.work,
                          mb.token_loss,
                          mb.logged_token_loss,
                          mb.token_values,
                          mb.logged_stats};
  dispatch_dtype(mb.dtype, [&](auto type) {
    CpuPolicyShard<typename decltype(type)::type> shard(mb);
    policy_protocol(batch, shard);
  });
}

}  // namespace lossverify
