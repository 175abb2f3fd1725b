// Example plugin: a mixture-of-experts router's load-balancing losses and z-loss on the host (docs/spec.md §3, the
// router), the way Megatron's router computes them, with the trainer's scaling around them. The kind has no
// lv_loss_kind code: the plugin names it and every setting it reads (lossverify_plugin_names), and reads them from
// lv_rank_inputs.settings. Rows are whole on every rank: [layers x E] float32 router logits per token; TP replicates
// the tokens, or splits them under sequence parallelism (lv_rank_inputs.sequence_parallel).
//
// Per micro-batch and layer: the scores (softmax, or sigmoid normalised over the experts), the top-k map (or the map
// the router dispatches by: groups and the expert bias, the case's map: routed), the
// scope's counts and valid tokens all-reduced over CP (and TP under SP), each sequence's too, the global aux loss's
// counts over every rank (the step's, or micro-batches 0..m), then each token's
//   l_t = sum over layers of <w, s_t> + alpha_z / T lse(z_t)^2,   w = a c + a_s c_s + a_g c^G
// and its gradient s_t (.) slope (.) (w - <w, s_t>) + 2 alpha_z / T lse softmax(z_t), weighted by the micro-batch's
// share of L (1 / (DP GA), or T / N in per-token mode) over the framework's factor (and times N in per-token mode,
// which the framework divides out); each micro-batch scope's counts go to outputs->scope_values.
//
//   lossverify run cases/moe-aux-sp-tp2-cp2.json --impl plugin:./liblossverify_example_router_plugin.so
//   lossverify run CASE.json --impl 'plugin:./liblossverify_example_router_plugin.so?bug=moe-aux-local-counts'
#include <lossverify/plugin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "plugin_common.hpp"

namespace {

using namespace lossverify_example;

constexpr std::string_view kLocalCounts = "bug=moe-aux-local-counts";
constexpr std::string_view kTpSum = "bug=moe-aux-tp-sum";
constexpr std::initializer_list<std::string_view> kParameters = {kLocalCounts, kTpSum};

struct Settings {
  int top_k = 2, layers = 1;
  bool sigmoid = false, running = false, first = false, divide_by_k = true, per_token = false, pooled = false;
  double aux = 0.0, seq_aux = 0.0, global_aux = 0.0, z = 0.0;
  bool routed_map = false;  // the aux terms count the map the router dispatches by (groups, expert bias)
  int groups = 1, top_groups = 1;
  double expert_bias = 0.0;
};

const lv_setting& setting(const lv_rank_inputs& in, const char* name) {
  const lv_setting* s = lv_find_setting(&in, name);
  if (s == nullptr) throw std::invalid_argument(std::string("the router case carries no setting ") + name);
  return *s;
}
bool choice_is(const lv_rank_inputs& in, const char* name, const char* value) {
  return std::strcmp(setting(in, name).choice, value) == 0;
}

Settings read_settings(const lv_rank_inputs& in) {
  Settings s;
  s.top_k = static_cast<int>(setting(in, "top_k").integer);
  s.layers = static_cast<int>(setting(in, "layers").integer);
  s.sigmoid = choice_is(in, "score", "sigmoid");
  s.aux = setting(in, "aux_coef").number;
  s.seq_aux = setting(in, "seq_aux_coef").number;
  s.global_aux = setting(in, "global_aux_coef").number;
  s.running = choice_is(in, "global_counts", "running");
  s.z = setting(in, "z_loss_coef").number;
  s.first = choice_is(in, "counts", "first");
  s.divide_by_k = setting(in, "divide_by_k").integer != 0;
  s.per_token = choice_is(in, "scaling", "per_token");
  s.pooled = setting(in, "pool_layers").integer != 0;
  s.routed_map = choice_is(in, "map", "routed");
  s.groups = static_cast<int>(setting(in, "groups").integer);
  s.top_groups = static_cast<int>(setting(in, "top_groups").integer);
  s.expert_bias = setting(in, "expert_bias").number;
  return s;
}

// One token's layer: the scores, lse(z), and the experts it counts for (ties to the lower index).
struct Block {
  std::vector<float> s;
  float lse = 0.0f;
  std::vector<int> routed;
};

// `order` sorted by decreasing key, ties to the lower index.
void by_key(std::vector<int>& order, const std::vector<float>& key) {
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return key[static_cast<std::size_t>(x)] > key[static_cast<std::size_t>(y)]; });
}

// The map the router dispatches by: keys = routing score (softmax p, or sigmoid sigma(z)) + the expert bias; with
// groups, the top_groups groups with the largest sums of their top k / top_groups keys hold the token's k experts.
std::vector<int> dispatch_map(const float* z, const Block& b, const Settings& st, std::size_t layer, std::size_t take) {
  const std::size_t experts = b.s.size();
  std::vector<float> key(experts);
  for (std::size_t e = 0; e < experts; ++e) {
    const float r = st.sigmoid ? 1.0f / (1.0f + std::exp(-z[e])) : b.s[e];
    key[e] = r + lv_router_expert_bias(st.expert_bias, static_cast<int64_t>(layer), static_cast<int64_t>(e),
                                       static_cast<int64_t>(experts));
  }
  const auto groups = static_cast<std::size_t>(st.groups);
  const std::size_t size = experts / groups;
  std::vector<int> allowed;
  if (groups > 1) {
    const auto best = static_cast<std::size_t>(std::max(1, st.top_k / st.top_groups));
    std::vector<float> group_score(groups, 0.0f);
    for (std::size_t q = 0; q < groups; ++q) {
      std::vector<int> members(size);
      std::iota(members.begin(), members.end(), static_cast<int>(q * size));
      by_key(members, key);
      for (std::size_t i = 0; i < best; ++i) group_score[q] += key[static_cast<std::size_t>(members[i])];
    }
    std::vector<int> kept(groups);
    std::iota(kept.begin(), kept.end(), 0);
    by_key(kept, group_score);
    kept.resize(static_cast<std::size_t>(st.top_groups));
    std::sort(kept.begin(), kept.end());
    for (const int q : kept) {
      for (std::size_t i = 0; i < size; ++i)
        allowed.push_back(static_cast<int>(static_cast<std::size_t>(q) * size + i));
    }
  } else {
    allowed.resize(experts);
    std::iota(allowed.begin(), allowed.end(), 0);
  }
  by_key(allowed, key);
  allowed.resize(take);
  return allowed;
}

Block score(const float* z, std::size_t experts, const Settings& st, std::size_t layer, int counted) {
  Block b{std::vector<float>(experts), 0.0f, {}};
  const float max = *std::max_element(z, z + experts);
  float sum = 0.0f;
  for (std::size_t e = 0; e < experts; ++e) sum += std::exp(z[e] - max);
  b.lse = max + std::log(sum);
  float total = 0.0f;
  for (std::size_t e = 0; e < experts; ++e) {
    b.s[e] = st.sigmoid ? 1.0f / (1.0f + std::exp(-z[e])) : std::exp(z[e] - b.lse);
    total += b.s[e];
  }
  if (st.sigmoid) {
    for (float& v : b.s) v /= total;
  }
  if (st.routed_map) {
    b.routed = dispatch_map(z, b, st, layer, static_cast<std::size_t>(counted));
    return b;
  }
  std::vector<int> order(experts);
  std::iota(order.begin(), order.end(), 0);
  by_key(order, b.s);
  b.routed.assign(order.begin(), order.begin() + counted);
  return b;
}

// Per layer [c_0 .. c_{E-1}, T] of a scope, layer after layer.
struct Counts {
  std::size_t experts;
  std::vector<float> values;
  Counts(std::size_t scopes, std::size_t width) : experts(width), values(scopes * (width + 1), 0.0f) {}
  float* at(std::size_t scope) { return &values[scope * (experts + 1)]; }
  const float* at(std::size_t scope) const { return &values[scope * (experts + 1)]; }
  void add(std::size_t scope, const std::vector<int>& routed) {
    float* c = at(scope);
    for (int e : routed) c[static_cast<std::size_t>(e)] += 1.0f;
    c[experts] += 1.0f;
  }
};

class Router {
 public:
  Router(const lv_rank_inputs& in, const Collectives& comm, bool local_counts, bool tp_sum)
      : in_(in), comm_(comm), s_(read_settings(in)), local_counts_(local_counts), tp_sum_(tp_sum) {
    layers_ = static_cast<std::size_t>(s_.layers);
    experts_ = static_cast<std::size_t>(in.vocab_end - in.vocab_begin) / layers_;
    counted_ = s_.first ? 1 : s_.top_k;
    divisor_ = s_.first || !s_.divide_by_k ? 1.0f : static_cast<float>(s_.top_k);
    sp_ = in.sequence_parallel != 0;
  }

  void run(lv_rank_outputs& out) {
    statistics_.assign(2 + (layers_ > 1 ? 2 * layers_ : 0), 0.0);
    for (int k = 0; k < in_.ga; ++k) micro_batch(k, out);
    finish(out);
  }

 private:
  bool valid(std::int64_t i) const { return in_.loss_mask[i] != 0; }
  const float* row(std::int64_t i) const {
    return static_cast<const float*>(in_.logits) + i * static_cast<std::int64_t>(layers_ * experts_);
  }
  // A scope spans the sequence partition: CP, and TP under sequence parallelism.
  void over_partition(std::vector<float>& values) const {
    if (local_counts_) return;
    comm_.allreduce(LV_GROUP_CP, values.data(), static_cast<std::int64_t>(values.size()), LV_REDUCE_SUM);
    if (sp_) comm_.allreduce(LV_GROUP_TP, values.data(), static_cast<std::int64_t>(values.size()), LV_REDUCE_SUM);
  }
  // Over every rank holding other tokens (DP_CP is the world under SP).
  template <class T>
  void over_batch(T* values, std::int64_t count) const {
    comm_.allreduce(LV_GROUP_DP_CP, values, count, LV_REDUCE_SUM);
  }

  // The global aux loss's counts: every valid row of micro-batches 0..last on every rank.
  Counts global_counts(int last) const {
    Counts g(layers_, experts_);
    for (std::int64_t i = 0; i < in_.micro_batch_begin[last + 1]; ++i) {
      if (!valid(i)) continue;
      for (std::size_t l = 0; l < layers_; ++l)
        g.add(l, score(row(i) + l * experts_, experts_, s_, l, counted_).routed);
    }
    over_batch(g.values.data(), static_cast<std::int64_t>(g.values.size()));
    return g;
  }

  void micro_batch(int k, lv_rank_outputs& out) {
    const std::int64_t begin = in_.micro_batch_begin[k], end = in_.micro_batch_begin[k + 1];
    const auto sequences = static_cast<std::size_t>(std::max<std::int64_t>(in_.num_sequences, 1));
    Counts scope(layers_, experts_), per_sequence(sequences * layers_, experts_);
    std::vector<Block> blocks(static_cast<std::size_t>(end - begin) * layers_);
    for (std::int64_t i = begin; i < end; ++i) {
      if (!valid(i)) continue;
      const auto q = static_cast<std::size_t>(in_.sequences[i]);
      for (std::size_t l = 0; l < layers_; ++l) {
        Block& b = blocks[static_cast<std::size_t>(i - begin) * layers_ + l];
        b = score(row(i) + l * experts_, experts_, s_, l, counted_);
        scope.add(l, b.routed);
        per_sequence.add(q * layers_ + l, b.routed);
      }
    }
    over_partition(scope.values);
    if (s_.seq_aux > 0.0) over_partition(per_sequence.values);
    for (std::size_t l = 0; l < layers_; ++l) {  // the counts as this rank holds them (outputs->scope_values)
      for (std::size_t e = 0; e < experts_; ++e) {
        out.scope_values[(static_cast<std::size_t>(k) * layers_ + l) * experts_ + e] = scope.at(l)[e];
      }
    }
    const Counts global = s_.global_aux > 0.0 ? global_counts(s_.running ? k : in_.ga - 1) : Counts(layers_, experts_);
    float held = 0.0f;  // the micro-batch's sequences holding a valid token
    for (std::size_t q = 0; q < sequences; ++q) held += per_sequence.at(q * layers_)[experts_] > 0.0f ? 1.0f : 0.0f;
    const float tokens = std::max(scope.at(0)[experts_], 1.0f);
    const double n = static_cast<double>(in_.global_valid_tokens);
    const double forward =
        s_.per_token ? static_cast<double>(tokens) / n : 1.0 / (static_cast<double>(in_.dp_size) * in_.ga);
    double backward = forward / framework_factor(in_);
    if (s_.per_token) backward *= n;
    const auto e_count = static_cast<float>(experts_);
    // pool_layers (transformers): one aux loss over every layer's counts, over layers x tokens.
    const float aux_tokens = tokens * (s_.pooled ? static_cast<float>(layers_) : 1.0f);
    const float aux_scale = static_cast<float>(s_.aux) * e_count / (divisor_ * aux_tokens * aux_tokens);
    std::vector<float> pooled(experts_, 0.0f);
    for (std::size_t l = 0; s_.pooled && l < layers_; ++l) {
      for (std::size_t e = 0; e < experts_; ++e) pooled[e] += scope.at(l)[e];
    }
    const float z_weight = static_cast<float>(s_.z) / tokens;
    const float aux_factor = tp_sum_ && sp_ ? static_cast<float>(in_.tp_size) : 1.0f;
    auto* g = static_cast<float*>(out.grad);
    std::vector<float> w(experts_);
    for (std::int64_t i = begin; i < end; ++i) {
      if (!valid(i)) continue;
      const auto q = static_cast<std::size_t>(in_.sequences[i]);
      float loss = 0.0f;
      for (std::size_t l = 0; l < layers_; ++l) {
        const Block& b = blocks[static_cast<std::size_t>(i - begin) * layers_ + l];
        const float* c = s_.pooled ? pooled.data() : scope.at(l);
        const float* own = per_sequence.at(q * layers_ + l);
        const float* cg = global.at(l);
        const float sequence_tokens = std::max(own[experts_], 1.0f);
        const float sequence_scale = static_cast<float>(s_.seq_aux) * e_count /
                                     (divisor_ * sequence_tokens * sequence_tokens * std::max(held, 1.0f));
        const float global_scale =
            cg[experts_] > 0.0f ? static_cast<float>(s_.global_aux) * e_count / (divisor_ * cg[experts_] * tokens)
                                : 0.0f;
        float dot = 0.0f;
        for (std::size_t e = 0; e < experts_; ++e) {
          w[e] = aux_scale * c[e] + sequence_scale * own[e] + global_scale * cg[e];
          dot += w[e] * b.s[e];
        }
        const float z_term = z_weight * b.lse * b.lse;
        loss += dot + z_term;
        statistics_[0] += forward * dot / (s_.pooled ? 1.0 : static_cast<double>(layers_));
        statistics_[1] += forward * z_term / static_cast<double>(layers_);
        if (layers_ > 1) {
          statistics_[2 + 2 * l] += forward * dot;
          statistics_[3 + 2 * l] += forward * z_term;
        }
        const float* z = row(i) + l * experts_;
        for (std::size_t e = 0; e < experts_; ++e) {
          const float slope = s_.sigmoid ? 1.0f - 1.0f / (1.0f + std::exp(-z[e])) : 1.0f;
          const float aux = b.s[e] * slope * (w[e] - dot);
          const float zg = 2.0f * z_weight * b.lse * std::exp(z[e] - b.lse);
          g[i * static_cast<std::int64_t>(layers_ * experts_) + static_cast<std::int64_t>(l * experts_ + e)] =
              static_cast<float>(backward) * (aux_factor * aux + zg);
        }
      }
      out.token_loss[i] = loss;
      logged_ += forward * loss;
      ++valid_rows_;
    }
  }

  // The logged loss, count and statistics: each over every rank holding other tokens (replicated TP ranks count
  // their rows once).
  void finish(lv_rank_outputs& out) {
    const bool counts = sp_ || in_.tp == 0;
    std::vector<double> totals = {counts ? logged_ : 0.0};
    for (double v : statistics_) totals.push_back(counts ? v : 0.0);
    std::int64_t rows[1] = {counts ? valid_rows_ : 0};
    over_batch(totals.data(), static_cast<std::int64_t>(totals.size()));
    over_batch(rows, 1);
    if (!sp_) {
      comm_.allreduce(LV_GROUP_TP, totals.data(), static_cast<std::int64_t>(totals.size()), LV_REDUCE_SUM);
      comm_.allreduce(LV_GROUP_TP, rows, 1, LV_REDUCE_SUM);
    }
    if (statistics_.size() > LV_MAX_LOGGED_STATISTICS) {
      throw std::invalid_argument("more router layers than the ABI's logged statistics carry");
    }
    out.grad_rows = in_.rows;
    out.grad_columns = in_.vocab_end - in_.vocab_begin;
    out.token_loss_count = in_.rows;
    out.has_logged_loss = 1;
    out.logged_loss = totals[0];
    out.logged_num_tokens = rows[0];
    for (std::size_t j = 0; j < statistics_.size(); ++j) out.logged_statistics[j] = totals[1 + j];
    out.logged_statistics_count = static_cast<std::int32_t>(statistics_.size());
    out.scope_value_count = static_cast<std::int64_t>(in_.ga) * static_cast<std::int64_t>(layers_ * experts_);
  }

  const lv_rank_inputs& in_;
  const Collectives& comm_;
  Settings s_;
  bool local_counts_, tp_sum_, sp_ = false;
  std::size_t layers_ = 1, experts_ = 0;
  int counted_ = 2;
  float divisor_ = 2.0f;
  std::vector<double> statistics_;
  double logged_ = 0.0;
  std::int64_t valid_rows_ = 0;
};

void run(const lv_rank_inputs& in, lv_rank_outputs& out, const Collectives& comm) {
  check_rank_inputs(in, out);
  if (in.struct_size < offsetof(lv_rank_inputs, sequence_parallel) + sizeof in.sequence_parallel) {
    throw std::invalid_argument("lossverify passed no sequence_parallel: built before the router's ABI fields");
  }
  if (in.memory != LV_MEMORY_HOST || in.dtype != LV_DTYPE_F32 || std::strcmp(in.loss_kind, "router") != 0) {
    throw std::invalid_argument("this plugin computes a router's losses on float32 host memory only");
  }
  const std::vector<std::string_view> given = parse_bug_parameters(in.params == nullptr ? "" : in.params, kParameters);
  Router(in, comm, has_parameter(given, kLocalCounts), has_parameter(given, kTpSum)).run(out);
}

int run_rank(const lv_rank_inputs* inputs, lv_rank_outputs* outputs, const lv_collectives* collectives) {
  return run_guarded(*outputs, [&] { run(*inputs, *outputs, Collectives(*collectives)); });
}

int check_params(const char* params, char* error, size_t error_size) {
  return check_bug_parameters(params, kParameters, error, error_size);
}

const char* const kNames[] = {"router",
                              "router.top_k",
                              "router.layers",
                              "router.score",
                              "router.aux_coef",
                              "router.seq_aux_coef",
                              "router.global_aux_coef",
                              "router.global_counts",
                              "router.z_loss_coef",
                              "router.counts",
                              "router.divide_by_k",
                              "router.scaling",
                              "router.pool_layers",
                              "router.map",
                              "router.groups",
                              "router.top_groups",
                              "router.expert_bias",
                              nullptr};

const lv_plugin kPlugin = {
    LV_PLUGIN_ABI_VERSION,
    "example-cpu-router",
    "example plugin: a mixture-of-experts router's aux losses and z-loss on the host "
    "(bug=moe-aux-local-counts, bug=moe-aux-tp-sum available)",
    LV_MEMORY_HOST,
    0u,
    run_rank,
    check_params,
};

}  // namespace

extern "C" const lv_plugin* lossverify_plugin(void) { return &kPlugin; }
extern "C" const char* const* lossverify_plugin_names(void) { return kNames; }
