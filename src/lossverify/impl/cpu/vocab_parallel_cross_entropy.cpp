#include "lossverify/impl/cpu/vocab_parallel_cross_entropy.hpp"

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "lossverify/math/cross_entropy_math.hpp"

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Pairwise float32 sum: the error grows with log n, as in the framework reductions it models.
float pairwise_sum(const float* x, std::int64_t n) {
  if (n <= 16) {
    float s = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
  const std::int64_t half = n / 2;
  return pairwise_sum(x, half) + pairwise_sum(x + half, n - half);
}

// Sum of f(x_i) over a row with 8 independent float32 lanes (vectorizable, shallow error growth),
// the lanes combined pairwise.
template <class T, class F>
float lane_sum(const T* x, std::int64_t n, F f) {
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) lanes[k] += f(static_cast<float>(x[i + k]));
  }
  for (int k = 0; i < n; ++i, ++k) lanes[k] += f(static_cast<float>(x[i]));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <class T>
RankOutput run_typed(const Case& c, const InputSource& inputs, RankAssignment assignment, Communicator& tp_group,
                     Communicator& token_group, const BugSwitches& bugs, const CpuKernelOptions& options) {
  const auto start = Clock::now();
  const double collectives_before = tp_group.collective_seconds() + token_group.collective_seconds();
  RankOutput out;
  out.assignment = std::move(assignment);
  out.dtype = c.inputs.dtype;
  const std::int64_t rows = out.rows();
  const std::int64_t cols = out.columns();
  const VocabRange vocab = out.assignment.vocab;
  const auto& tokens = out.assignment.tokens;
  const int threads = options.threads;
  const LossSpec& loss = c.loss;

  // The rank generates exactly its own shard.
  std::vector<T> logits(static_cast<std::size_t>(rows * cols));
  std::vector<std::int64_t> label(static_cast<std::size_t>(rows));
  std::vector<char> valid(static_cast<std::size_t>(rows));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto t = tokens[static_cast<std::size_t>(i)];
    inputs.logits(t, vocab.begin, vocab.end, logits.data() + i * cols);
    label[static_cast<std::size_t>(i)] = inputs.label(t);
    valid[static_cast<std::size_t>(i)] = label[static_cast<std::size_t>(i)] != loss.ignore_index;
  }
  out.generate_seconds = seconds_since(start);
  const auto compute_start = Clock::now();

  // 1. Global row max.
  std::vector<float> row_max(static_cast<std::size_t>(rows), -std::numeric_limits<float>::infinity());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (std::int64_t i = 0; i < rows; ++i) {
    if (!valid[static_cast<std::size_t>(i)]) continue;
    const T* x = logits.data() + i * cols;
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t v = 0; v < cols; ++v) m = std::fmax(m, static_cast<float>(x[v]));
    row_max[static_cast<std::size_t>(i)] = m;
  }
  tp_group.allreduce_max(row_max);

  // 2. One packed all-reduce: [S | x_l - M | Z], each a block of `rows` floats.
  const bool smoothing = loss.label_smoothing > 0.0;
  const int width = smoothing ? 3 : 2;
  std::vector<float> packed(static_cast<std::size_t>(rows * width), 0.0f);
  float* sum_exp = packed.data();
  float* target_shifted = packed.data() + rows;
  float* sum_shifted = smoothing ? packed.data() + 2 * rows : nullptr;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (std::int64_t i = 0; i < rows; ++i) {
    if (!valid[static_cast<std::size_t>(i)]) continue;
    const T* x = logits.data() + i * cols;
    const float m = row_max[static_cast<std::size_t>(i)];
    sum_exp[i] = lane_sum(x, cols, [m](float xv) { return std::exp(xv - m); });
    if (smoothing) sum_shifted[i] = lane_sum(x, cols, [m](float xv) { return xv - m; });
    const std::int64_t l = label[static_cast<std::size_t>(i)];
    if (vocab.contains(l)) target_shifted[i] = static_cast<float>(x[l - vocab.begin]) - m;
  }
  std::vector<float> local_sum_shifted;
  if (smoothing && bugs.smoothing_sum_local_forward) local_sum_shifted.assign(sum_shifted, sum_shifted + rows);
  tp_group.allreduce_sum(packed);

  std::vector<float> log_sum(static_cast<std::size_t>(rows), 0.0f);
  for (std::int64_t i = 0; i < rows; ++i) {
    if (valid[static_cast<std::size_t>(i)]) log_sum[static_cast<std::size_t>(i)] = std::log(sum_exp[i]);
  }

  // The smoothing sum that the forward uses: global, shard-local, or rebuilt from log(exp(x - M) / S).
  std::vector<float> smoothing_sum;
  if (smoothing) {
    smoothing_sum = bugs.smoothing_sum_local_forward ? local_sum_shifted
                                                     : std::vector<float>(sum_shifted, sum_shifted + rows);
    if (bugs.smoothing_log_after_exp) {
      // sum_v (x_v - M) = sum_v log p_v + V log S, with log p_v taken after the exponential.
      std::vector<float> sum_log_p(static_cast<std::size_t>(rows), 0.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
      for (std::int64_t i = 0; i < rows; ++i) {
        if (!valid[static_cast<std::size_t>(i)]) continue;
        const float m = row_max[static_cast<std::size_t>(i)];
        const float s = sum_exp[i];
        sum_log_p[static_cast<std::size_t>(i)] =
            lane_sum(logits.data() + i * cols, cols, [m, s](float xv) { return std::log(std::exp(xv - m) / s); });
      }
      if (!bugs.smoothing_sum_local_forward) tp_group.allreduce_sum(sum_log_p);
      const auto width_used = static_cast<float>(bugs.smoothing_sum_local_forward ? cols : c.shape.vocab);
      for (std::int64_t i = 0; i < rows; ++i) {
        smoothing_sum[static_cast<std::size_t>(i)] =
            sum_log_p[static_cast<std::size_t>(i)] + width_used * log_sum[static_cast<std::size_t>(i)];
      }
    }
  }

  // 3. Valid tokens over the ranks that hold different tokens, and each token's weight in L.
  std::int64_t valid_count[1] = {0};
  for (char v : valid) valid_count[0] += v;
  token_group.allreduce_sum(std::span<std::int64_t>(valid_count, 1));
  out.logged_valid_tokens = valid_count[0];
  std::vector<float> weight(static_cast<std::size_t>(rows), 0.0f);
  for (std::int64_t i = 0; i < rows; ++i) {
    if (!valid[static_cast<std::size_t>(i)]) continue;
    switch (loss.reduction) {
      case Reduction::mean:
        weight[static_cast<std::size_t>(i)] = 1.0f / static_cast<float>(valid_count[0]);
        break;
      case Reduction::sum:
        weight[static_cast<std::size_t>(i)] = 1.0f;
        break;
      case Reduction::none:
        weight[static_cast<std::size_t>(i)] =
            static_cast<float>(inputs.upstream_weight(tokens[static_cast<std::size_t>(i)]));
        break;
    }
  }

  const auto alpha = static_cast<float>(loss.label_smoothing);
  const auto z_weight = static_cast<float>(loss.z_loss_weight);
  const auto global_vocab = static_cast<float>(c.shape.vocab);
  const auto shard_vocab = static_cast<float>(cols);
  const SmoothingWeights<float> q_forward =
      smoothing_weights(alpha, loss.convention, bugs.smoothing_vocab_local_forward ? shard_vocab : global_vocab);
  const SmoothingWeights<float> q_backward =
      smoothing_weights(alpha, loss.convention, bugs.smoothing_vocab_local_backward ? shard_vocab : global_vocab);

  // 4. Per-token loss and the logged (reduced) loss.
  out.token_loss.assign(static_cast<std::size_t>(rows), 0.0f);
  std::vector<float> weighted(static_cast<std::size_t>(rows), 0.0f);
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    if (!valid[k]) continue;
    const float lse = row_max[k] + log_sum[k];
    const float s = smoothing ? smoothing_sum[k] : 0.0f;
    out.token_loss[k] = cross_entropy_from_sums(log_sum[k], target_shifted[i], s, q_forward, z_weight, lse);
    weighted[k] = weight[k] * out.token_loss[k];
  }
  if (loss.reduction != Reduction::none) {
    float reduced[1] = {pairwise_sum(weighted.data(), rows)};
    token_group.allreduce_sum(std::span<float>(reduced, 1));
    out.has_reduced_loss = true;
    out.reduced_loss = reduced[0];
  }

  // 5. Gradient of the local columns; masked rows get exact zeros.
  out.grad.assign(static_cast<std::size_t>(rows * cols) * sizeof(T), std::byte{0});
  T* grad = reinterpret_cast<T*>(out.grad.data());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    T* g = grad + i * cols;
    if (!valid[k]) {
      for (std::int64_t v = 0; v < cols; ++v) g[v] = T(0.0f);
      continue;
    }
    const T* x = logits.data() + i * cols;
    const float shift = row_max[k] + log_sum[k];  // lse
    const float z_factor = 1.0f + 2.0f * z_weight * shift;
    const float w = weight[k];
    const std::int64_t target_column = label[k] - vocab.begin;
    for (std::int64_t v = 0; v < cols; ++v) {
      const float p = std::exp((static_cast<float>(x[v]) - row_max[k]) - log_sum[k]);
      g[v] = T(w * cross_entropy_grad(p, v == target_column, q_backward, z_factor));
    }
  }

  out.collective_seconds = tp_group.collective_seconds() + token_group.collective_seconds() - collectives_before;
  out.compute_seconds = seconds_since(compute_start) - out.collective_seconds;
  return out;
}

}  // namespace

RankOutput run_vocab_parallel_cross_entropy(const Case& c, const InputSource& inputs, RankAssignment assignment,
                                            Communicator& tp_group, Communicator& token_group,
                                            const BugSwitches& bugs, const CpuKernelOptions& options) {
  return dispatch_dtype(c.inputs.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return run_typed<T>(c, inputs, std::move(assignment), tp_group, token_group, bugs, options);
  });
}

}  // namespace lossverify
