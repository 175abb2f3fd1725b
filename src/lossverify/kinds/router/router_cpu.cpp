// The router kind on the CPU backend, one micro-batch (one scope's share) of one rank, in float32 as a trainer
// computes it: per layer, the scores, the top-k map, the scope's counts and valid tokens all-reduced over the
// sequence partition (CP, and TP under sequence parallelism) before any gradient, then each token's
//   l_t = sum over layers of a <c, s_t> + a_s <c_s, s_t> / S + a_g <c^G, s_t> + alpha_z / T lse(z_t)^2
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
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/kinds/router/router_scaling.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

namespace {

// One layer's router logits of a row and their scores.
struct Block {
  std::vector<float> z, s;
  float lse = 0.0f;
};

// Scores in float32: softmax, or sigmoid normalised over the experts.
void score_block(RouterOptions::Score score, Block& r) {
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

// The top-k experts of a block's scores (ties to the lower index).
std::vector<int> routed(const Block& r, int k) {
  std::vector<int> order(r.s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return r.s[static_cast<std::size_t>(a)] > r.s[static_cast<std::size_t>(b)]; });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

// The experts in decreasing order of `key` among `members`, ties to the lower index.
void order_by(std::vector<int>& members, const std::vector<float>& key) {
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return key[static_cast<std::size_t>(a)] > key[static_cast<std::size_t>(b)]; });
}

// The map a router dispatches by (the case's map: routed): keys = routing score (softmax p, or sigmoid sigma(z)) +
// the layer's expert bias; with groups, each group scores the sum of its top k / top_groups keys, the best top_groups
// groups are kept, and the top-k keys among their experts route the token. Its first `take` experts count.
std::vector<int> routed_map(const Block& b, const RouterOptions& o, std::span<const float> bias, int top_k, int take) {
  const std::size_t experts = b.z.size();
  std::vector<float> key(experts);
  for (std::size_t e = 0; e < experts; ++e) {
    const float r = o.score == RouterOptions::Score::softmax ? b.s[e] : 1.0f / (1.0f + std::exp(-b.z[e]));
    key[e] = r + bias[e];
  }
  std::vector<int> allowed;
  const auto groups = static_cast<std::size_t>(o.groups);
  const std::size_t size = experts / groups;
  if (groups > 1) {
    const auto best = static_cast<std::size_t>(std::max(1, top_k / o.top_groups));
    std::vector<float> group_score(groups, 0.0f);
    for (std::size_t q = 0; q < groups; ++q) {
      std::vector<int> members(size);
      std::iota(members.begin(), members.end(), static_cast<int>(q * size));
      order_by(members, key);
      for (std::size_t i = 0; i < best && i < size; ++i) group_score[q] += key[static_cast<std::size_t>(members[i])];
    }
    std::vector<int> chosen(groups);
    std::iota(chosen.begin(), chosen.end(), 0);
    order_by(chosen, group_score);
    chosen.resize(static_cast<std::size_t>(o.top_groups));
    for (const int q : chosen) {
      for (std::size_t i = 0; i < size; ++i)
        allowed.push_back(static_cast<int>(static_cast<std::size_t>(q) * size + i));
    }
    std::sort(allowed.begin(), allowed.end());
  } else {
    allowed.resize(experts);
    std::iota(allowed.begin(), allowed.end(), 0);
  }
  order_by(allowed, key);
  allowed.resize(std::min(allowed.size(), static_cast<std::size_t>(take)));
  return allowed;
}

// Each layer's expert bias, as the router holds it (float32).
std::vector<float> layer_biases(const RouterOptions& o, std::size_t layers, std::size_t experts) {
  std::vector<float> bias(layers * experts);
  for (std::size_t i = 0; i < bias.size(); ++i) {
    bias[i] = router::expert_bias(o.expert_bias, static_cast<std::int64_t>(i / experts),
                                  static_cast<std::int64_t>(i % experts), static_cast<std::int64_t>(experts));
  }
  return bias;
}

// The experts a token counts for in layer l: the plain top-k of its scores, or the routed map.
std::vector<int> token_map(const Block& b, const RouterOptions& o, const std::vector<float>& bias, std::size_t l,
                           int top_k) {
  const int take = o.counts == RouterOptions::Counts::first ? 1 : top_k;
  if (o.map == RouterOptions::Map::top_k) return routed(b, take);
  return routed_map(b, o, std::span<const float>(bias).subspan(l * b.z.size(), b.z.size()), top_k, take);
}

// Per layer [c_e..., T]: a scope's counts and tokens, layer after layer.
struct Sums {
  std::size_t experts;
  std::vector<float> values;
  Sums(std::size_t layers, std::size_t width) : experts(width), values(layers * (width + 1), 0.0f) {}
  float* layer(std::size_t l) { return &values[l * (experts + 1)]; }
  const float* layer(std::size_t l) const { return &values[l * (experts + 1)]; }
  // A token in T, and (`routed`) in its experts' counts.
  void add(std::size_t l, std::span<const int> experts_routed, bool routed = true) {
    float* c = layer(l);
    for (const int e : experts_routed) c[static_cast<std::size_t>(e)] += routed ? 1.0f : 0.0f;
    c[experts] += 1.0f;
  }
};

template <class T>
void load_block(const T* row, std::size_t l, Block& b) {
  const std::size_t width = b.z.size();
  for (std::size_t e = 0; e < width; ++e) b.z[e] = static_cast<float>(row[l * width + e]);
}

// The global aux loss's counts and tokens per layer: the rank's rows of every micro-batch (step) or of micro-batches
// 0..k (running), all-reduced over every rank holding other tokens.
template <class T>
Sums global_counts(const CpuMicroBatch& mb, const RouterOptions& o, const std::vector<float>& bias, std::size_t experts,
                   int k) {
  const auto layers = static_cast<std::size_t>(o.layers);
  const auto& begins = mb.assignment.micro_batch_begin;
  const std::int64_t end =
      o.global_counts == RouterOptions::GlobalCounts::step ? begins.back() : begins[static_cast<std::size_t>(k) + 1];
  Sums sums(layers, experts);
  Block b{std::vector<float>(experts), std::vector<float>(experts)};
  const T* x = reinterpret_cast<const T*>(mb.logits);
  for (std::int64_t i = 0; i < end; ++i) {
    if (!mb.plan.row(i).active) continue;
    for (std::size_t l = 0; l < layers; ++l) {
      load_block(x + i * static_cast<std::int64_t>(layers * experts), l, b);
      score_block(o.score, b);
      sums.add(l, token_map(b, o, bias, l, o.top_k));
    }
  }
  mb.groups.batch.allreduce_sum(std::span<float>(sums.values));
  return sums;
}

// The micro-batch's valid tokens over every rank holding other tokens (two catalogued bugs read them).
template <class T>
void run(const CpuMicroBatch& mb) {
  const RouterOptions o = router_options_read(mb.c.loss, mb.bugs.kind_switches);
  const std::uint64_t bugs = mb.bugs.kind_switches;
  const auto layers = static_cast<std::size_t>(o.layers);
  const auto row_width = static_cast<std::size_t>(mb.work.size());
  const std::size_t experts = row_width / layers;
  const std::vector<float> bias = layer_biases(o, layers, experts);
  const T* x = reinterpret_cast<const T*>(mb.logits) + mb.begin * static_cast<std::int64_t>(row_width);
  T* g = reinterpret_cast<T*>(mb.grad) + mb.begin * static_cast<std::int64_t>(row_width);
  const auto n = static_cast<std::size_t>(mb.n);
  auto plan = [&](std::size_t i) -> const RowPlan& { return mb.plan.row(mb.begin + static_cast<std::int64_t>(i)); };
  // moe-aux-padding-counted: every row of the rank counts in T and in the scores, padding included; the bugs that
  // route padding as tokens give it a gradient too, and moe-aux-mask-counts-only keeps it out of the experts' counts.
  const bool padding_routed = (bugs & router_bug::routes_padding) != 0;
  auto counted = [&](std::size_t i) {
    return (bugs & router_bug::padding_counted) != 0 || padding_routed || plan(i).active;
  };
  auto in_counts = [&](std::size_t i) { return (bugs & router_bug::mask_counts_only) == 0 || plan(i).active; };
  auto gets_gradient = [&](std::size_t i) { return padding_routed || plan(i).active; };
  std::vector<Block> blocks(n * layers, Block{std::vector<float>(experts), std::vector<float>(experts)});
  Sums scope(layers, experts);
  // The sequence aux loss's scopes: the micro-batch's sequences, in the layout's order.
  const int k = mb.index;
  const std::vector<std::int64_t> sequences =
      sequences_of_slot(GlobalBatch(mb.c.batch), mb.c.batch, mb.c.layout, mb.assignment.coordinates.dp, k);
  Sums per_sequence(sequences.size() * layers, experts);  // sequence j's layer l at j * layers + l
  auto sequence_slot = [&](std::size_t i) {
    const std::int64_t q = mb.assignment.rows[static_cast<std::size_t>(mb.begin) + i].sequence;
    return static_cast<std::size_t>(std::find(sequences.begin(), sequences.end(), q) - sequences.begin());
  };
  for (std::size_t i = 0; i < n; ++i) {
    beat_row(mb.beacon, static_cast<std::int64_t>(i));
    if (!counted(i)) continue;
    for (std::size_t l = 0; l < layers; ++l) {
      Block& b = blocks[i * layers + l];
      load_block(x + i * row_width, l, b);
      score_block(o.score, b);
      const std::vector<int> map = token_map(b, o, bias, l, o.top_k);
      scope.add(l, map, in_counts(i));
      per_sequence.add(sequence_slot(i) * layers + l, map, in_counts(i));
    }
  }
  if ((bugs & router_bug::local_counts) == 0) {  // the scopes span the sequence partition
    for (Sums* sums : {&scope, &per_sequence}) {
      mb.groups.cp.allreduce_sum(std::span<float>(sums->values));
      if (mb.c.layout.sp) mb.groups.tp.allreduce_sum(std::span<float>(sums->values));
    }
  }
  if (mb.scope_values != nullptr) {  // the counts as this rank holds them
    for (std::size_t l = 0; l < layers; ++l) {
      std::copy(
          scope.layer(l), scope.layer(l) + experts,
          mb.scope_values->begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(k) * layers + l) * experts));
    }
  }
  const Sums global = o.global_aux_coef > 0.0 ? global_counts<T>(mb, o, bias, experts, k) : Sums(layers, experts);
  float held = 0.0f;  // the micro-batch's sequences that hold a valid token
  for (std::size_t j = 0; j < sequences.size(); ++j)
    held += per_sequence.layer(j * layers)[experts] > 0.0f ? 1.0f : 0.0f;
  const AuxScales scales = aux_scales(o, bugs, mb.c.layout, std::span<const float>(scope.values), experts, layers);
  const float batch_tokens =
      global_reads_batch_tokens(o, bugs) ? router_batch_valid_tokens(mb.plan, mb.groups, mb.begin, mb.n) : 0.0f;
  const std::vector<float>& row_inputs = mb.plan.kind_plan().row_inputs;
  std::vector<float> weights(experts);  // a c_e + a_s c_s,e / S + a_g c^G_e: the aux terms' weights
  const bool packed = (bugs & router_bug::seq_aux_packed) != 0;  // the micro-batch one sequence
  for (std::size_t i = 0; i < n; ++i) {
    if (!gets_gradient(i)) continue;
    const bool active = plan(i).active;  // a routed padding row has a gradient, but no loss of its own
    const std::size_t row = static_cast<std::size_t>(mb.begin) + i;
    const RouterFactors f = router_factors(
        bugs, mb.c.layout, o, std::span<const float>(row_inputs).subspan(row * kRouterRowInputs, kRouterRowInputs),
        sequences.size());
    const float w = plan(i).backward_weight * f.all;
    float loss = 0.0f;
    for (std::size_t l = 0; l < layers; ++l) {
      const Block& b = blocks[i * layers + l];
      const float* c = scales.counts(scope.layer(l));
      const float* own = packed ? scope.layer(l) : per_sequence.layer(sequence_slot(i) * layers + l);
      const float* c_global = global.layer(l);
      const float sequence_scale = scales.sequence(own[experts], packed ? 1.0f : held);
      const float global_scale = scales.global(c_global[experts], batch_tokens, k + 1);
      float dot = 0.0f, sequence_dot = 0.0f;  // <weights, s> and its sequence aux part
      for (std::size_t e = 0; e < experts; ++e) {
        weights[e] = scales.aux * c[e] + sequence_scale * own[e] + global_scale * c_global[e];
        dot += weights[e] * b.s[e];
        sequence_dot += sequence_scale * own[e] * b.s[e];
      }
      const float z_weight = scales.z_weight * f.z;
      const float z_term = z_weight * b.lse * b.lse;
      loss += dot + z_term;
      // The logged aux and z values: this rank's share (summed over the ranks holding other tokens afterwards).
      const double logged_aux = (bugs & router_bug::log_doubled) != 0 ? 2.0 * dot : dot;
      const double forward = plan(i).forward_weight;  // routed padding's too, under the bugs that route it
      mb.logged_stats[0] += forward * logged_aux / logged_aux_divisor(o);
      mb.logged_stats[1] += forward * static_cast<double>(z_term) / static_cast<double>(layers);
      if (layers > 1) {
        mb.logged_stats[2 + 2 * l] += forward * logged_aux;
        mb.logged_stats[3 + 2 * l] += forward * static_cast<double>(z_term);
      }
      for (std::size_t e = 0; e < experts; ++e) {
        const float slope = o.score == RouterOptions::Score::softmax ? 1.0f : 1.0f - 1.0f / (1.0f + std::exp(-b.z[e]));
        const float sequence_weight = sequence_scale * own[e];
        const float aux = b.s[e] * slope * (weights[e] - sequence_weight - (dot - sequence_dot));
        const float sequence_aux = b.s[e] * slope * (sequence_weight - sequence_dot);
        const float z = 2.0f * z_weight * b.lse * std::exp(b.z[e] - b.lse);
        g[i * row_width + l * experts + e] = T(w * (f.aux * (aux + f.sequence_aux * sequence_aux) + z));
      }
    }
    if (active) mb.token_loss[row] = loss;
    if (!mb.logged_token_loss.empty()) mb.logged_token_loss[row] = loss;
  }
}

}  // namespace

float router_batch_valid_tokens(const RankPlan& plan, RankGroups& groups, std::int64_t begin, std::int64_t n) {
  float tokens = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) tokens += plan.row(begin + i).active ? 1.0f : 0.0f;
  groups.batch.allreduce_sum(std::span<float>(&tokens, 1));
  return tokens;
}

void router_cpu_micro_batch(const CpuMicroBatch& batch) {
  dispatch_dtype(batch.dtype, [&](auto type) { run<typename decltype(type)::type>(batch); });
}

// Each valid row's weight in L: the mean over the step's DP x GA micro-batches of their scopes' losses, or (per-token
// mode) its micro-batch scope's share T_S / N of the step's valid tokens; and the counts the kernels' scaling reads.
KindRowPlan plan_router_rows(const RowPlanRequest& r) {
  const RouterOptions& o = router_options(r.c.loss);
  const auto& begins = r.assignment.micro_batch_begin;
  const std::size_t ga = begins.size() - 1;
  std::vector<double> own(ga, 0.0);  // the rank's valid tokens per micro-batch
  for (std::size_t k = 0; k < ga; ++k) {
    for (std::int64_t i = begins[k]; i < begins[k + 1]; ++i) own[k] += r.valid[static_cast<std::size_t>(i)] ? 1.0 : 0.0;
  }
  std::vector<double> scope = own;  // over the sequence partition: CP, and TP under sequence parallelism
  r.groups.cp.allreduce_sum(std::span<double>(scope));
  if (r.c.layout.sp) r.groups.tp.allreduce_sum(std::span<double>(scope));
  const auto step = static_cast<double>(r.inputs.valid_tokens());
  KindRowPlan plan;
  plan.weights = std::vector<double>(r.valid.size(), 0.0);
  // Routed padding's terms enter the logged loss (its aux loss is over every row), not its per-token losses.
  plan.separate_logged_loss = (r.bugs.kind_switches & router_bug::routes_padding) != 0;
  plan.row_inputs.assign(r.valid.size() * kRouterRowInputs, 0.0f);
  const double mean = 1.0 / (static_cast<double>(r.c.layout.dp) * static_cast<double>(r.c.layout.ga));
  // The bugs that route padding as tokens weigh every row of the micro-batch as its valid ones.
  const bool padding_routed = plan.separate_logged_loss;
  for (std::size_t k = 0; k < ga; ++k) {
    const std::vector<std::int64_t> sequences =
        sequences_of_slot(r.inputs.batch(), r.c.batch, r.c.layout, r.assignment.coordinates.dp, static_cast<int>(k));
    for (auto i = static_cast<std::size_t>(begins[k]); i < static_cast<std::size_t>(begins[k + 1]); ++i) {
      if (r.valid[i] || padding_routed) {
        (*plan.weights)[i] = o.scaling == RouterOptions::Scaling::per_token ? scope[k] / step : mean;
      }
      const auto slot = std::find(sequences.begin(), sequences.end(), r.assignment.rows[i].sequence);
      float* in = &plan.row_inputs[i * kRouterRowInputs];
      in[0] = static_cast<float>(scope[k]);
      in[1] = static_cast<float>(own[k]);
      in[2] = static_cast<float>(step);
      in[3] = slot == sequences.end() ? -1.0f : static_cast<float>(slot - sequences.begin());
      in[4] = static_cast<float>(sequences.size());
    }
  }
  return plan;
}

}  // namespace lossverify
