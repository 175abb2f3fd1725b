// The router's GPU oracle (kind_api/cuda_kind.hpp's CudaKindOracle): the float64 reference of router_reference.cpp
// with its two passes over the logits on the device. Before the implementation runs, it generates its own copy of the
// step's router logits and of the rank's rows (oracle/cuda's generator, buffers no implementation sees) and routes
// every valid token of the step in float64 (router_oracle_kernels.cu, pass 1). Once the rank's outputs exist, the
// routing builds the host's scopes, counts and weights (RouterReference with that routing: no logit is read on the
// host), pass 2 evaluates each of the rank's rows (its terms, value and expected gradient with the tie slack), and the
// oracle's comparison kernel judges the rank's gradient where it stayed, element by element.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/oracle.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/cuda/device_buffer.hpp"
#include "lossverify/cuda/shard_inputs.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/cuda_kind.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_oracle_kernels.hpp"
#include "lossverify/kinds/router/router_reference.hpp"
#include "lossverify/oracle/cuda/device_oracle.hpp"
#include "lossverify/oracle/cuda/gpu_reference.hpp"
#include "lossverify/outputs/rank_output.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify::cuda {

namespace {

// Pass 1's results on the host: each valid token's routing per layer, as router::top_k / routed_top_k write it.
struct StepRouting {
  std::int64_t layers = 0;
  int take = 0;
  std::vector<int> experts, next;
  std::vector<double> margins;
  router::TopK at(std::int64_t token, std::size_t layer) const {
    const auto item = static_cast<std::size_t>(token * layers) + layer;
    router::TopK t;
    t.experts.assign(experts.begin() + static_cast<std::ptrdiff_t>(item * static_cast<std::size_t>(take)),
                     experts.begin() + static_cast<std::ptrdiff_t>((item + 1) * static_cast<std::size_t>(take)));
    t.next = next[item];
    t.margin = margins[4 * item];
    t.scale = margins[4 * item + 1];
    t.group_margin = margins[4 * item + 2];
    t.group_scale = margins[4 * item + 3];
    return t;
  }
};

class RouterOracle final : public Oracle {
 public:
  RouterOracle(const Case& c, const InputSource& inputs, std::shared_ptr<OracleShard> shard,
               std::shared_ptr<const StepRouting> routing, const RankOutput& out, const GradJudgement& judgement)
      : case_(c),
        options_(router_options(c.loss)),
        out_(out),
        shard_(std::move(shard)),
        routed_(router::make_routed_reference(c, inputs,
                                              [routing](std::int64_t t, std::size_t l) { return routing->at(t, l); })),
        terms_(routed_.terms),
        reference_(c, inputs, std::move(routed_.reference)),
        stream_(static_cast<cudaStream_t>(oracle_shard_stream(*shard_))) {
    if (!out_.device_shard) throw InternalError("the router's GPU oracle needs the rank's gradient on the GPU");
    compare_.atol = judgement.tolerance.atol;
    compare_.rtol = judgement.tolerance.rtol;
    compare_.max_ulp = judgement.tolerance.max_ulp;
    compare_.framework_scale = judgement.framework_scale;
    compare_.quantum = judgement.quantum;
    compare_.grad_scale = judgement.grad_scale;
    compare_.smallest_normal = judgement.smallest_normal;
  }

  const LossReference& reference() const override { return reference_; }

  // The router's rows have no partials (RouterReference::partial is empty): each row's validity, and pass 2.
  void row_partials(std::vector<double>& partials, std::vector<char>& valid) override {
    const std::size_t rows = out_.assignment.rows.size();
    partials.assign(rows * RowPartial::kDoubles, 0.0);
    valid.assign(rows, 0);
    compare_.kind.assign(rows, 1);
    compare_.labels.assign(rows, -1);
    compare_.lse.assign(rows, 0.0);
    compare_.teacher_lse.assign(rows, 0.0);
    compare_.weight.assign(rows, 0.0);
    std::vector<int> slot(rows, -1);
    std::vector<double> z_weight(rows, 0.0);
    for (std::size_t k = 0; k < rows; ++k) {
      RowPartial{}.store(&partials[k * RowPartial::kDoubles]);
      const std::int64_t t = out_.assignment.rows[k].token;
      if (t < 0) {
        compare_.kind[k] = 2;
        continue;
      }
      const std::int64_t j = terms_->weight_slot(t);
      if (j < 0) continue;
      valid[k] = 1;
      compare_.kind[k] = 0;
      compare_.weight[k] = reference_.token_weight(t);
      slot[k] = static_cast<int>(j);
      z_weight[k] = terms_->z_weight(t);
    }
    evaluate_rows(slot, z_weight);
  }

  // l_t of each row: the sum over layers of its terms, from pass 2.
  std::vector<double> value_partials(std::span<const RowStats>) override {
    const std::size_t rows = out_.assignment.rows.size();
    const auto layers = static_cast<std::size_t>(options_.layers);
    std::vector<double> values(2 * rows, 0.0);
    for (std::size_t k = 0; k < rows; ++k) {
      if (compare_.kind[k] != 0) continue;
      double sum = 0.0;
      for (std::size_t l = 0; l < layers; ++l)
        sum += terms_host_[(k * layers + l) * 3] + terms_host_[(k * layers + l) * 3 + 1];
      values[2 * k] = sum;
    }
    return values;
  }

  void start_judging(std::span<const RowStats>) override {
    compare_.expected = expected_.as<double>();
    compare_.slack = slack_.size() > 0 ? slack_.as<double>() : nullptr;
    gpu_reference_compare_launch(*shard_, *out_.device_shard, case_, compare_, false);
  }

  std::span<const RowJudgement> judged_rows() override {
    const std::span<const RowComparison> compared = gpu_reference_compare_wait(*shard_);
    rows_.assign(compared.size(), RowJudgement{});
    for (std::size_t k = 0; k < compared.size(); ++k) rows_[k] = row_judgement(out_, k, compared[k]);
    return rows_;
  }

 private:
  // Pass 2 over the rank's rows; each valid row's terms go to the reference (its logged values read them).
  void evaluate_rows(const std::vector<int>& slot, const std::vector<double>& z_weight) {
    const auto rows = static_cast<std::int64_t>(slot.size());
    const auto layers = static_cast<std::size_t>(options_.layers);
    const auto experts = static_cast<std::size_t>(case_.shape.vocab) / layers;
    const std::size_t elements = static_cast<std::size_t>(rows) * layers * experts;
    const DeviceBytes d_slot = upload(slot, stream_);
    const DeviceBytes d_weight = upload(compare_.weight, stream_);
    const DeviceBytes d_z_weight = upload(z_weight, stream_);
    const DeviceBytes d_weights = upload(terms_->weight_table(false), stream_);
    const bool ties = terms_->any_ties();
    const DeviceBytes d_tie_weights = ties ? upload(terms_->weight_table(true), stream_) : DeviceBytes(0);
    expected_ = DeviceBytes(elements * sizeof(double));
    if (ties) slack_ = DeviceBytes(elements * sizeof(double));
    DeviceBytes d_terms(static_cast<std::size_t>(rows) * layers * 3 * sizeof(double));
    RouterReferenceRowArgs a{};
    a.logits = static_cast<const float*>(oracle_shard_logits(*shard_));
    a.rows = rows;
    a.layers = options_.layers;
    a.experts = static_cast<int>(experts);
    a.sigmoid = options_.score == RouterOptions::Score::sigmoid ? 1 : 0;
    a.slot = d_slot.as<int>();
    a.weight = d_weight.as<double>();
    a.z_weight = d_z_weight.as<double>();
    a.weights = d_weights.as<double>();
    a.tie_weights = ties ? d_tie_weights.as<double>() : nullptr;
    a.expected = expected_.as<double>();
    a.slack = ties ? slack_.as<double>() : nullptr;
    a.terms = d_terms.as<double>();
    router_reference_rows(a, stream_);
    terms_host_ = download<double>(d_terms, static_cast<std::size_t>(rows) * layers * 3, stream_);
    for (std::size_t k = 0; k < slot.size(); ++k) {
      if (slot[k] < 0) continue;
      terms_->set_terms(out_.assignment.rows[k].token,
                        std::span<const double>(terms_host_).subspan(k * layers * 3, layers * 3));
    }
  }

  const Case& case_;
  const RouterOptions& options_;
  const RankOutput& out_;
  std::shared_ptr<OracleShard> shard_;
  router::RoutedReference routed_;
  router::DeviceTerms* terms_;
  const LossReference reference_;
  cudaStream_t stream_;
  GpuCompareInputs compare_;
  DeviceBytes expected_{0}, slack_{0};
  std::vector<double> terms_host_;  // rows x layers x [aux, z, tie bound]
  std::vector<RowJudgement> rows_;
};

class RouterKindOracle final : public CudaKindOracle {
 public:
  RouterKindOracle(const Case& c, const InputSource& inputs, const RankAssignment& assignment, int device)
      : case_(c), inputs_(inputs), shard_(make_oracle_shard(c, inputs, assignment, device)) {
    const RouterOptions& o = router_options(c.loss);
    const auto stream = static_cast<cudaStream_t>(oracle_shard_stream(*shard_));
    // The step's tokens in order, each a row of the oracle's own copy.
    RankAssignment step;
    step.vocab = VocabRange{0, c.shape.vocab};
    step.rows.resize(static_cast<std::size_t>(c.shape.tokens));
    std::vector<int> valid(step.rows.size());
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      step.rows[static_cast<std::size_t>(t)].token = t;
      valid[static_cast<std::size_t>(t)] = inputs.is_valid(t) ? 1 : 0;
    }
    step_logits_ = generate_shard_inputs(c, inputs, step, step.vocab, stream);
    const auto layers = static_cast<std::int64_t>(o.layers);
    const std::int64_t experts = c.shape.vocab / layers;
    std::vector<double> bias(static_cast<std::size_t>(c.shape.vocab), 0.0);
    for (std::int64_t i = 0; i < c.shape.vocab; ++i)
      bias[static_cast<std::size_t>(i)] = router::expert_bias(o.expert_bias, i / experts, i % experts, experts);
    routing_.layers = layers;
    routing_.take = o.counts == RouterOptions::Counts::first ? 1 : o.top_k;
    const auto items = static_cast<std::size_t>(c.shape.tokens * layers);
    d_valid_ = upload(valid, stream);
    d_bias_ = upload(bias, stream);
    d_experts_ = DeviceBytes(items * static_cast<std::size_t>(routing_.take) * sizeof(int));
    d_next_ = DeviceBytes(items * sizeof(int));
    d_margins_ = DeviceBytes(items * 4 * sizeof(double));
    RouterReferenceRouteArgs a{};
    a.logits = step_logits_.student.as<float>();
    a.rows = c.shape.tokens;
    a.layers = o.layers;
    a.experts = static_cast<int>(experts);
    a.valid = d_valid_.as<int>();
    a.sigmoid = o.score == RouterOptions::Score::sigmoid ? 1 : 0;
    a.take = routing_.take;
    a.routed_map = o.map == RouterOptions::Map::routed ? 1 : 0;
    a.router_k = o.top_k;
    a.groups = o.groups;
    a.top_groups = o.top_groups;
    a.bias = d_bias_.as<double>();
    a.experts_out = d_experts_.as<int>();
    a.next_out = d_next_.as<int>();
    a.margins = d_margins_.as<double>();
    router_reference_route(a, stream);
  }

  std::unique_ptr<Oracle> judge(const RankOutput& out, const GradJudgement& judgement) override {
    const auto stream = static_cast<cudaStream_t>(oracle_shard_stream(*shard_));
    const auto items = static_cast<std::size_t>(case_.shape.tokens * routing_.layers);
    auto routing = std::make_shared<StepRouting>(routing_);
    routing->experts = download<int>(d_experts_, items * static_cast<std::size_t>(routing_.take), stream);
    routing->next = download<int>(d_next_, items, stream);
    routing->margins = download<double>(d_margins_, items * 4, stream);
    step_logits_ = ShardInputs{};  // pass 2 reads the rank's rows
    return std::make_unique<RouterOracle>(case_, inputs_, shard_, std::move(routing), out, judgement);
  }

 private:
  const Case& case_;
  const InputSource& inputs_;
  std::shared_ptr<OracleShard> shard_;
  ShardInputs step_logits_;
  StepRouting routing_;
  DeviceBytes d_valid_{0}, d_bias_{0}, d_experts_{0}, d_next_{0}, d_margins_{0};
};

}  // namespace

std::unique_ptr<CudaKindOracle> make_router_cuda_oracle(const Case& c, const InputSource& inputs,
                                                        const RankAssignment& assignment, int device) {
  LV_CUDA(cudaSetDevice(device));
  return std::make_unique<RouterKindOracle>(c, inputs, assignment, device);
}

}  // namespace lossverify::cuda
