// The router kind on the CPU backend, one micro-batch (one scope's share) of one rank, in float32 as a trainer
// computes it: scores, the top-k map, the scope's counts and valid tokens all-reduced over the sequence partition
// (CP, and TP under sequence parallelism) before any gradient, then each token's
//   l_t = alpha E / (k T^2) <c, s_t> + alpha_z / T lse(z_t)^2
// and its gradient, scaled by the row's backward weight. The catalogued bugs are switches of router_bug.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

namespace {

struct Row {
  std::vector<float> z, s;  // logits and scores
  float lse = 0.0f;
};

// Scores in float32: softmax, or sigmoid normalised over the experts.
void score_row(RouterOptions::Score score, Row& r) {
  const float max = *std::max_element(r.z.begin(), r.z.end());
  float sum = 0.0f;
  for (float v : r.z) sum += std::exp(v - max);
  r.lse = max + std::log(sum);
  if (score == RouterOptions::Score::softmax) {
    for (std::size_t e = 0; e < r.z.size(); ++e) r.s[e] = std::exp(r.z[e] - r.lse);
    return;
  }
  float total = 0.0f;
  for (std::size_t e = 0; e < r.z.size(); ++e) total += (r.s[e] = 1.0f / (1.0f + std::exp(-r.z[e])));
  for (float& v : r.s) v /= total;
}

// The top-k experts of a row's scores (ties to the lower index).
std::vector<int> routed(const Row& r, int k) {
  std::vector<int> order(r.s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return r.s[static_cast<std::size_t>(a)] > r.s[static_cast<std::size_t>(b)]; });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

// The global aux loss's counts and tokens [c_e..., T]: the rank's rows of every micro-batch (step) or of micro-batches
// 0..k (running), all-reduced over every rank holding other tokens.
template <class T>
std::vector<float> global_counts(const CpuMicroBatch& mb, const RouterOptions& o, int k) {
  const std::int64_t experts = mb.work.size();
  const auto width = static_cast<std::size_t>(experts);
  const auto& begins = mb.assignment.micro_batch_begin;
  const std::int64_t end =
      o.global_counts == RouterOptions::GlobalCounts::step ? begins.back() : begins[static_cast<std::size_t>(k) + 1];
  std::vector<float> sums(width + 1, 0.0f);
  Row r;
  r.z.resize(width);
  r.s.resize(width);
  const T* x = reinterpret_cast<const T*>(mb.logits);
  for (std::int64_t i = 0; i < end; ++i) {
    if (!mb.plan.row(i).active) continue;
    for (std::size_t e = 0; e < width; ++e) r.z[e] = static_cast<float>(x[i * experts + static_cast<std::int64_t>(e)]);
    score_row(o.score, r);
    for (const int e : routed(r, o.top_k)) sums[static_cast<std::size_t>(e)] += 1.0f;
    sums[width] += 1.0f;
  }
  mb.groups.batch.allreduce_sum(std::span<float>(sums));
  return sums;
}

template <class T>
void run(const CpuMicroBatch& mb) {
  const RouterOptions& o = router_options(mb.c.loss);
  const std::uint64_t bugs = mb.bugs.kind_switches;
  const std::int64_t experts = mb.work.size();
  const auto width = static_cast<std::size_t>(experts);
  const T* x = reinterpret_cast<const T*>(mb.logits) + mb.begin * experts;
  T* g = reinterpret_cast<T*>(mb.grad) + mb.begin * experts;
  const auto n = static_cast<std::size_t>(mb.n);
  auto plan = [&](std::size_t i) -> const RowPlan& { return mb.plan.row(mb.begin + static_cast<std::int64_t>(i)); };
  // moe-aux-padding-counted: every row of the rank counts in T and in the scores, padding included.
  auto counted = [&](std::size_t i) { return (bugs & router_bug::padding_counted) != 0 || plan(i).active; };
  std::vector<Row> rows(n);
  std::vector<float> scope(width + 1, 0.0f);  // counts c_e, then T
  // The sequence aux loss's scopes: the micro-batch's sequences, in the layout's order, each [c_e..., T_s].
  const auto& begins = mb.assignment.micro_batch_begin;
  const auto k = static_cast<int>(std::find(begins.begin(), begins.end(), mb.begin) - begins.begin());
  const std::vector<std::int64_t> sequences =
      sequences_of_slot(GlobalBatch(mb.c.batch), mb.c.batch, mb.c.layout, mb.assignment.coordinates.dp, k);
  std::vector<float> per_sequence(sequences.size() * (width + 1), 0.0f);
  auto sequence_slot = [&](std::size_t i) {
    const std::int64_t q = mb.assignment.rows[static_cast<std::size_t>(mb.begin) + i].sequence;
    return static_cast<std::size_t>(std::find(sequences.begin(), sequences.end(), q) - sequences.begin());
  };
  for (std::size_t i = 0; i < n; ++i) {
    beat_row(mb.beacon, static_cast<std::int64_t>(i));
    if (!counted(i)) continue;
    Row& r = rows[i];
    r.z.resize(width);
    r.s.resize(width);
    for (std::size_t e = 0; e < width; ++e) r.z[e] = static_cast<float>(x[i * width + e]);
    score_row(o.score, r);
    float* own = &per_sequence[sequence_slot(i) * (width + 1)];
    for (const int e : routed(r, o.top_k)) {
      scope[static_cast<std::size_t>(e)] += 1.0f;
      own[static_cast<std::size_t>(e)] += 1.0f;
    }
    scope[width] += 1.0f;
    own[width] += 1.0f;
  }
  if ((bugs & router_bug::local_counts) == 0) {  // the scopes span the sequence partition
    for (std::vector<float>* sums : {&scope, &per_sequence}) {
      mb.groups.cp.allreduce_sum(std::span<float>(*sums));
      if (mb.c.layout.sp) mb.groups.tp.allreduce_sum(std::span<float>(*sums));
    }
  }
  const std::vector<float> global =
      o.global_aux_coef > 0.0 ? global_counts<T>(mb, o, k) : std::vector<float>(width + 1, 0.0f);
  float held = 0.0f;  // the micro-batch's sequences that hold a valid token
  for (std::size_t j = 0; j < sequences.size(); ++j) held += per_sequence[j * (width + 1) + width] > 0.0f ? 1.0f : 0.0f;
  const float tokens = std::fmax(scope[width], 1.0f);
  const float k_div =
      (bugs & router_bug::topk_squared) != 0 ? static_cast<float>(o.top_k * o.top_k) : static_cast<float>(o.top_k);
  const float aux_scale = static_cast<float>(o.aux_coef) * static_cast<float>(experts) / (k_div * tokens * tokens);
  const float z_weight = static_cast<float>(o.z_loss_coef) / tokens;
  float aux_factor = 1.0f, factor = 1.0f;
  if ((bugs & router_bug::tp_sum) != 0 && mb.c.layout.sp) aux_factor = static_cast<float>(mb.c.layout.tp);
  if ((bugs & router_bug::cp_missing) != 0) factor = 1.0f / static_cast<float>(mb.c.layout.cp);
  if ((bugs & router_bug::no_grad) != 0) aux_factor = 0.0f;  // the scaler's return discarded
  if ((bugs & router_bug::ga_overweight) != 0) aux_factor *= static_cast<float>(mb.c.layout.ga);
  std::vector<float> weights(width);  // a c_e + a_s c_s,e / S: the aux terms' weights of the row's experts
  for (std::size_t i = 0; i < n; ++i) {
    if (!plan(i).active) continue;
    const Row& r = rows[i];
    const float* own = &per_sequence[sequence_slot(i) * (width + 1)];
    const float sequence_tokens = std::fmax(own[width], 1.0f);
    const float sequence_scale = static_cast<float>(o.seq_aux_coef) * static_cast<float>(experts) /
                                 (k_div * sequence_tokens * sequence_tokens * std::fmax(held, 1.0f));
    const float global_scale = global[width] > 0.0f
                                   ? static_cast<float>(o.global_aux_coef) * static_cast<float>(experts) /
                                         (static_cast<float>(o.top_k) * global[width] * tokens)
                                   : 0.0f;
    float dot = 0.0f;
    for (std::size_t e = 0; e < width; ++e) {
      weights[e] = aux_scale * scope[e] + sequence_scale * own[e] + global_scale * global[e];
      dot += weights[e] * r.s[e];
    }
    mb.token_loss[static_cast<std::size_t>(mb.begin) + i] = dot + z_weight * r.lse * r.lse;
    // The logged aux and z values: this rank's share (summed over the ranks holding other tokens afterwards).
    const double logged_aux = (bugs & router_bug::log_doubled) != 0 ? 2.0 * dot : dot;
    mb.logged_stats[0] += plan(i).forward_weight * logged_aux;
    mb.logged_stats[1] += plan(i).forward_weight * static_cast<double>(z_weight * r.lse * r.lse);
    const float w = plan(i).backward_weight * factor;
    for (std::size_t e = 0; e < width; ++e) {
      const float slope = o.score == RouterOptions::Score::softmax ? 1.0f : 1.0f - 1.0f / (1.0f + std::exp(-r.z[e]));
      const float aux = r.s[e] * slope * (weights[e] - dot);
      const float z = 2.0f * z_weight * r.lse * std::exp(r.z[e] - r.lse);
      g[i * width + e] = T(w * (aux_factor * aux + z));
    }
  }
}

}  // namespace

void router_cpu_micro_batch(const CpuMicroBatch& batch) {
  dispatch_dtype(batch.dtype, [&](auto type) { run<typename decltype(type)::type>(batch); });
}

// Each valid row's weight in L: the step's mean over its DP x GA micro-batches of their scopes' losses.
KindRowPlan plan_router_rows(const RowPlanRequest& r) {
  KindRowPlan plan;
  const double weight = 1.0 / (static_cast<double>(r.c.layout.dp) * static_cast<double>(r.c.layout.ga));
  plan.weights = std::vector<double>(r.valid.size(), 0.0);
  for (std::size_t i = 0; i < r.valid.size(); ++i) (*plan.weights)[i] = r.valid[i] ? weight : 0.0;
  return plan;
}

}  // namespace lossverify
