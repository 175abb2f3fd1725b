// The router kind on the CUDA backend (CUDA builds): per micro-batch, pass 1 routes and counts every row of the
// rank on the GPU, the host all-reduces the scopes' counts over the sequence partition (CP, and TP under sequence
// parallelism) and, for the global aux loss, over every rank holding other tokens, turns them into each sequence's
// per-expert weights, and pass 2 writes the loss terms and the gradient. The arithmetic and the catalogued bugs are
// those of router_cpu.cpp (router_scaling.hpp holds their factors).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_kernels.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/kinds/router/router_scaling.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/rank_layout.hpp"

namespace lossverify::cuda {

namespace {

class RouterCudaRank final : public CudaKindRank {
 public:
  explicit RouterCudaRank(const CudaRankSetup& s)
      : setup_(s),
        options_(router_options_read(s.c.loss, s.bugs.kind_switches)),
        layers_(options_.layers),
        experts_(static_cast<int>(s.cols / options_.layers)),
        stream_(static_cast<cudaStream_t>(s.stream)),
        bias_(expert_biases()) {
    if (s.type != StorageType::fp32) throw CaseError(s.c.source + ": the router kind reads float32 router logits");
  }

  void micro_batch(const RankPlan& plan, RankGroups& groups, const CudaRows& rows, std::int64_t b, std::int64_t n,
                   KindOutputs& out) override {
    const std::uint64_t bugs = setup_.bugs.kind_switches;
    const std::vector<float>& row_inputs = plan.kind_plan().row_inputs;
    const auto at = [&](std::int64_t row, std::size_t j) {
      return row_inputs[static_cast<std::size_t>(row) * kRouterRowInputs + j];
    };
    // Every micro-batch comes in order, those without rows too (their sequences' counts are all-reduced alike).
    const int k = next_micro_batch_++;
    const RankAssignment& assignment = *setup_.assignment;
    if (assignment.micro_batch_begin[static_cast<std::size_t>(k)] != b) {
      throw InternalError("router CUDA rank: micro-batch " + std::to_string(k) + " called out of order");
    }
    const std::size_t sequences =
        sequences_of_slot(GlobalBatch(setup_.c.batch), setup_.c.batch, setup_.c.layout, assignment.coordinates.dp, k)
            .size();
    const std::size_t width = static_cast<std::size_t>(experts_) + 1;
    // The rows that count (every row under moe-aux-padding-counted) and their sequences, for the micro-batch.
    // Padding too under moe-aux-padding-counted and the bugs that route it as tokens (they give it a gradient).
    const bool padding_routed = (bugs & router_bug::routes_padding) != 0;
    std::vector<int> counted(static_cast<std::size_t>(n)), slot(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      counted[static_cast<std::size_t>(i)] =
          (bugs & router_bug::padding_counted) != 0 || padding_routed || plan.row(b + i).active;
      slot[static_cast<std::size_t>(i)] = static_cast<int>(at(b + i, 3));
    }
    const DeviceBytes d_counted = upload(counted, stream_);
    const DeviceBytes d_slot = upload(slot, stream_);
    // Each sequence's counts matter to the sequence aux loss only (its weights are 0 without it).
    const std::size_t counted_sequences = options_.seq_aux_coef > 0.0 ? sequences : 0;
    std::vector<float> per_sequence(counted_sequences * static_cast<std::size_t>(layers_) * width, 0.0f);
    DeviceBytes d_sequences = zeros(per_sequence.size());
    std::vector<float> scope =
        route(b, n, d_counted.as<int>(), d_slot.as<int>(), per_sequence.empty() ? nullptr : d_sequences.as<float>());
    download(d_sequences, per_sequence);
    if ((bugs & router_bug::mask_counts_only) != 0) {  // the experts' counts of the valid rows only, T of every row
      std::vector<float> valid_sequences(per_sequence.size(), 0.0f);
      DeviceBytes d_valid_sequences = zeros(valid_sequences.size());
      const std::vector<float> valid_scope = route(b, n, rows.active + b, d_slot.as<int>(),
                                                   valid_sequences.empty() ? nullptr : d_valid_sequences.as<float>());
      download(d_valid_sequences, valid_sequences);
      keep_counts(scope, valid_scope);
      keep_counts(per_sequence, valid_sequences);
    }
    if ((bugs & router_bug::local_counts) == 0) {  // the scopes span the sequence partition
      for (std::vector<float>* sums : {&scope, &per_sequence}) {
        groups.cp.allreduce_sum(std::span<float>(*sums));
        if (setup_.c.layout.sp) groups.tp.allreduce_sum(std::span<float>(*sums));
      }
    }
    for (std::size_t l = 0; l < static_cast<std::size_t>(layers_); ++l) {  // the counts as this rank holds them
      for (std::size_t e = 0; e < static_cast<std::size_t>(experts_); ++e) {
        out.scope_values[(static_cast<std::size_t>(k) * static_cast<std::size_t>(layers_) + l) *
                             static_cast<std::size_t>(experts_) +
                         e] = scope[l * width + e];
      }
    }
    const std::vector<float> global = global_counts(plan, groups, b + n);
    const float batch_tokens =
        global_reads_batch_tokens(options_, bugs) ? router_batch_valid_tokens(plan, groups, b, n) : 0.0f;
    const Weights tables = weights(scope, per_sequence, global, sequences, batch_tokens, k + 1);
    const int* gradient_rows = padding_routed ? d_counted.as<int>() : rows.active + b;
    const RouterFactors f =
        n > 0 ? router_factors(bugs, setup_.c.layout, options_,
                               std::span<const float>(row_inputs)
                                   .subspan(static_cast<std::size_t>(b) * kRouterRowInputs, kRouterRowInputs),
                               sequences)
              : RouterFactors{};
    const DeviceBytes d_weights = upload(tables.all, stream_);
    const DeviceBytes d_sequence_weights = upload(tables.sequence, stream_);
    DeviceBytes d_terms(static_cast<std::size_t>(n) * static_cast<std::size_t>(layers_) * 2 * sizeof(float));
    const RouterGradArgs args{logits(b),
                              reinterpret_cast<float*>(setup_.grad) + b * setup_.cols,
                              n,
                              layers_,
                              experts_,
                              options_.score == RouterOptions::Score::sigmoid ? 1 : 0,
                              gradient_rows,
                              rows.weight + b,
                              d_slot.as<int>(),
                              d_weights.as<float>(),
                              d_sequence_weights.as<float>(),
                              tables.z_weight * f.z,
                              f.all,
                              f.aux,
                              f.sequence_aux,
                              d_terms.as<float>()};
    router_grad(args, stream_);
    std::vector<float> terms(static_cast<std::size_t>(n) * static_cast<std::size_t>(layers_) * 2);
    download(d_terms, terms);
    log_rows(plan, b, n, terms, out);
  }

 private:
  struct Weights {
    std::vector<float> all, sequence;  // sequences x layers x experts
    float z_weight = 0.0f;
  };

  // Each layer's expert bias as the router holds it (float32), for the routed map; one float otherwise.
  DeviceBytes expert_biases() const {
    const bool routed = options_.map == RouterOptions::Map::routed;
    std::vector<float> bias(routed ? static_cast<std::size_t>(layers_) * static_cast<std::size_t>(experts_) : 1, 0.0f);
    for (std::size_t i = 0; routed && i < bias.size(); ++i) {
      bias[i] = router::expert_bias(options_.expert_bias, static_cast<std::int64_t>(i) / experts_,
                                    static_cast<std::int64_t>(i) % experts_, experts_);
    }
    return upload(bias, stream_);
  }

  const float* logits(std::int64_t b) const { return reinterpret_cast<const float*>(setup_.logits) + b * setup_.cols; }

  DeviceBytes zeros(std::size_t count) const {
    DeviceBytes d(count * sizeof(float));
    if (count > 0) LV_CUDA(cudaMemsetAsync(d.as<void>(), 0, d.size(), stream_));
    return d;
  }
  void download(const DeviceBytes& d, std::vector<float>& host) const {
    if (!host.empty()) {
      LV_CUDA(cudaMemcpyAsync(host.data(), d.as<void>(), host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    }
    LV_CUDA(cudaStreamSynchronize(stream_));
  }

  // The experts' counts of `from` into `into`, per layer (or sequence and layer), T left as `into` has it.
  void keep_counts(std::vector<float>& into, const std::vector<float>& from) const {
    const std::size_t width = static_cast<std::size_t>(experts_) + 1;
    for (std::size_t i = 0; i < into.size(); ++i) {
      if (i % width != static_cast<std::size_t>(experts_)) into[i] = from[i];
    }
  }

  // Pass 1 over rows [b, b + n): the scope's counts per layer (and each sequence's, into `sequences`).
  std::vector<float> route(std::int64_t b, std::int64_t n, const int* counted, const int* slot,
                           float* sequences) const {
    const int counted_per_token = options_.counts == RouterOptions::Counts::first ? 1 : options_.top_k;
    std::vector<float> scope(static_cast<std::size_t>(layers_) * (static_cast<std::size_t>(experts_) + 1), 0.0f);
    DeviceBytes d_scope = zeros(scope.size());
    RouterRouteArgs args{logits(b),           n,        layers_, experts_, counted_per_token, counted, slot,
                         d_scope.as<float>(), sequences};
    if (options_.map == RouterOptions::Map::routed) {
      args.bias = bias_.as<float>();
      args.sigmoid = options_.score == RouterOptions::Score::sigmoid ? 1 : 0;
      args.router_k = options_.top_k;
      args.groups = options_.groups;
      args.top_groups = options_.top_groups;
    }
    router_route(args, stream_);
    download(d_scope, scope);
    return scope;
  }

  // The global aux loss's counts per layer: the rank's active rows of every micro-batch (step) or of micro-batches
  // 0..this one (running, rows [0, end)), all-reduced over every rank holding other tokens.
  std::vector<float> global_counts(const RankPlan& plan, RankGroups& groups, std::int64_t end) const {
    std::vector<float> global(static_cast<std::size_t>(layers_) * (static_cast<std::size_t>(experts_) + 1), 0.0f);
    if (options_.global_aux_coef <= 0.0) return global;
    const std::int64_t rows = options_.global_counts == RouterOptions::GlobalCounts::step ? setup_.rows : end;
    std::vector<int> active(static_cast<std::size_t>(rows));
    for (std::int64_t i = 0; i < rows; ++i) active[static_cast<std::size_t>(i)] = plan.row(i).active;
    const DeviceBytes d_active = upload(active, stream_);
    global = route(0, rows, d_active.as<int>(), nullptr, nullptr);
    groups.batch.allreduce_sum(std::span<float>(global));
    return global;
  }

  // Each sequence's per-expert weights of the aux terms, a c + a_s c_s / S + a_g c^G, and their sequence part
  // (0 where `per_sequence` is empty: the case has no sequence aux loss).
  Weights weights(const std::vector<float>& scope, const std::vector<float>& per_sequence,
                  const std::vector<float>& global, std::size_t sequences, float batch_tokens, int micro_batch) const {
    const std::uint64_t bugs = setup_.bugs.kind_switches;
    const auto experts = static_cast<std::size_t>(experts_);
    const std::size_t width = experts + 1;
    const auto layers = static_cast<std::size_t>(layers_);
    const AuxScales scales =
        aux_scales(options_, bugs, setup_.c.layout, std::span<const float>(scope), experts, layers);
    const bool with_sequences = !per_sequence.empty();
    const std::vector<float> none(width, 0.0f);
    float held = 0.0f;  // the micro-batch's sequences that hold a valid token
    for (std::size_t j = 0; with_sequences && j < sequences; ++j) {
      held += per_sequence[j * layers * width + experts] > 0.0f ? 1.0f : 0.0f;
    }
    const bool packed = (bugs & router_bug::seq_aux_packed) != 0;  // the micro-batch one sequence
    Weights w;
    w.z_weight = scales.z_weight;
    w.all.assign(std::max<std::size_t>(sequences, 1) * layers * experts, 0.0f);
    w.sequence.assign(w.all.size(), 0.0f);
    for (std::size_t j = 0; j < sequences; ++j) {
      for (std::size_t l = 0; l < layers; ++l) {
        const float* c = scales.counts(&scope[l * width]);
        const float* own = packed           ? &scope[l * width]
                           : with_sequences ? &per_sequence[(j * layers + l) * width]
                                            : none.data();
        const float* c_global = &global[l * width];
        const float sequence_scale = scales.sequence(own[experts], packed ? 1.0f : held);
        const float global_scale = scales.global(c_global[experts], batch_tokens, micro_batch);
        for (std::size_t e = 0; e < experts; ++e) {
          const std::size_t k = (j * layers + l) * experts + e;
          w.sequence[k] = sequence_scale * own[e];
          w.all[k] = scales.aux * c[e] + w.sequence[k] + global_scale * c_global[e];
        }
      }
    }
    return w;
  }

  // Each active row's loss (the sum over layers), and the logged values: this rank's share (summed over the ranks
  // holding other tokens by the backend).
  void log_rows(const RankPlan& plan, std::int64_t b, std::int64_t n, const std::vector<float>& terms,
                KindOutputs& out) const {
    const bool doubled = (setup_.bugs.kind_switches & router_bug::log_doubled) != 0;
    const auto layers = static_cast<std::size_t>(layers_);
    for (std::int64_t i = 0; i < n; ++i) {
      const RowPlan& p = plan.row(b + i);
      if (!p.active && p.forward_weight == 0.0f) continue;  // routed padding is weighed (and has terms)
      float loss = 0.0f;
      for (std::size_t l = 0; l < layers; ++l) {
        const float dot = terms[(static_cast<std::size_t>(i) * layers + l) * 2];
        const float z_term = terms[(static_cast<std::size_t>(i) * layers + l) * 2 + 1];
        loss += dot + z_term;
        const double logged_aux = doubled ? 2.0 * dot : dot;
        const double forward = p.forward_weight;
        out.logged_stats[0] += forward * logged_aux / logged_aux_divisor(options_);
        out.logged_stats[1] += forward * static_cast<double>(z_term) / static_cast<double>(layers);
        if (layers > 1) {
          out.logged_stats[2 + 2 * l] += forward * logged_aux;
          out.logged_stats[3 + 2 * l] += forward * static_cast<double>(z_term);
        }
      }
      if (p.active) out.token_loss[static_cast<std::size_t>(b + i)] = loss;
      if (!out.logged_token_loss.empty()) out.logged_token_loss[static_cast<std::size_t>(b + i)] = loss;
    }
  }

  CudaRankSetup setup_;
  int next_micro_batch_ = 0;
  RouterOptions options_;
  int layers_, experts_;
  cudaStream_t stream_;
  DeviceBytes bias_;  // layers x experts (the routed map)
};

}  // namespace

std::unique_ptr<CudaKindRank> make_router_cuda_rank(const CudaRankSetup& setup) {
  return std::make_unique<RouterCudaRank>(setup);
}

}  // namespace lossverify::cuda
