#include "lossverify/impl/plugin/plugin_backend.hpp"

#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/impl/plugin/crash_guard.hpp"
#include "lossverify/impl/plugin/plugin_memory.hpp"
#include "lossverify/impl/rank_inputs.hpp"

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;
using plugin_memory::Buffer;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The collectives table's state: the rank's groups, and the first failure a collective raised (exceptions
// must not cross the plugin's C frames; it is rethrown once the plugin returns).
struct CollectiveContext {
  Communicator* groups[4] = {};  // indexed by lv_group
  lv_memory memory = LV_MEMORY_HOST;
  std::exception_ptr failure;
  std::string misuse;  // a call with impossible arguments
  std::vector<std::byte> staging;
};

Communicator* group_of(CollectiveContext& ctx, lv_group group) {
  const auto index = static_cast<int>(group);
  return index >= 0 && index < 4 ? ctx.groups[index] : nullptr;
}

int plugin_allreduce(void* context, lv_group group, void* data, int64_t count, lv_element element, lv_reduce_op op) {
  auto& ctx = *static_cast<CollectiveContext*>(context);
  if (ctx.failure || !ctx.misuse.empty()) return 1;
  Communicator* comm = group_of(ctx, group);
  if (comm == nullptr || count < 0 || (data == nullptr && count > 0) || element < LV_ELEMENT_F32 ||
      element > LV_ELEMENT_I64 || (op != LV_REDUCE_SUM && op != LV_REDUCE_MAX)) {
    ctx.misuse = "allreduce called with group " + std::to_string(static_cast<int>(group)) + ", count " +
                 std::to_string(count) + ", element " + std::to_string(static_cast<int>(element)) + ", op " +
                 std::to_string(static_cast<int>(op));
    return 1;
  }
  const ElementType type = element == LV_ELEMENT_F32   ? ElementType::f32
                           : element == LV_ELEMENT_F64 ? ElementType::f64
                                                       : ElementType::i64;
  try {
    const auto n = static_cast<std::size_t>(count);
    const std::size_t bytes = n * element_size(type);
    ctx.staging.resize(bytes);
    plugin_memory::to_host(ctx.memory, data, ctx.staging.data(), bytes);
    comm->allreduce(ctx.staging.data(), n, type, op == LV_REDUCE_SUM ? ReduceOp::sum : ReduceOp::max);
    plugin_memory::from_host(ctx.memory, ctx.staging.data(), data, bytes);
    return 0;
  } catch (...) {
    ctx.failure = std::current_exception();
    return 1;
  }
}

int plugin_group_size(void* context, lv_group group) {
  Communicator* comm = group_of(*static_cast<CollectiveContext*>(context), group);
  return comm != nullptr ? comm->size() : -1;
}

int plugin_group_rank(void* context, lv_group group) {
  Communicator* comm = group_of(*static_cast<CollectiveContext*>(context), group);
  return comm != nullptr ? comm->rank() : -1;
}

lv_dtype abi_dtype(DType d) {
  return d == DType::bf16 ? LV_DTYPE_BF16 : d == DType::fp16 ? LV_DTYPE_F16 : LV_DTYPE_F32;
}

lv_loss_config abi_loss(const LossSpec& loss) {
  lv_loss_config config{};
  config.kind = loss.kind == LossKind::kd ? LV_LOSS_KD : LV_LOSS_CROSS_ENTROPY;
  config.reduction = loss.reduction == Reduction::sum    ? LV_REDUCTION_SUM
                     : loss.reduction == Reduction::none ? LV_REDUCTION_NONE
                                                         : LV_REDUCTION_MEAN;
  config.label_smoothing = loss.label_smoothing;
  config.smoothing_convention =
      loss.convention == SmoothingConvention::megatron ? LV_SMOOTHING_MEGATRON : LV_SMOOTHING_PYTORCH;
  config.z_loss_weight = loss.z_loss_weight;
  config.softcap = loss.softcap;
  config.ignore_index = loss.ignore_index;
  config.temperature = loss.temperature;
  config.t2_scaling = loss.t2_scaling ? 1 : 0;
  return config;
}

// The rank's inputs, copied into buffers the plugin may read (and scribble on: they are its own).
struct InputBuffers {
  std::unique_ptr<Buffer> logits, teacher, labels, loss_mask, upstream, tokens;
};

template <class T>
std::unique_ptr<Buffer> buffer_of(lv_memory memory, const std::vector<T>& host) {
  auto b = std::make_unique<Buffer>(memory, host.size() * sizeof(T));
  b->upload(host.data());
  return b;
}

class PluginRank {
 public:
  PluginRank(const PluginLibrary& plugin, const Case& c, RankGroups groups)
      : plugin_(plugin), case_(c), groups_(groups), memory_(plugin.entry->memory) {}

  RankOutput run(const InputSource& inputs, RankAssignment assignment, const PluginRankOptions& options) {
    const auto start = Clock::now();
    const RankInputs in = make_rank_inputs(case_, inputs, std::move(assignment), options.threads);
    out_.assignment = in.assignment;
    out_.dtype = in.dtype;
    rank_ = in.assignment.world_rank;
    plugin_memory::select_device(memory_, options.device);
    const InputBuffers buffers = upload(in);
    Buffer grad(memory_, in.logits.size());
    Buffer token_loss(memory_, static_cast<std::size_t>(in.rows()) * sizeof(float));
    std::int64_t valid = 0;
    for (std::int64_t t = 0; t < case_.shape.tokens; ++t) valid += inputs.is_valid(t);
    // The CP group: the batch group's ranks with this rank's DP coordinate.
    const RankCoordinates& at = in.assignment.coordinates;
    const std::unique_ptr<Communicator> cp = groups_.batch.split(at.dp, at.cp);
    out_.generate_seconds = seconds_since(start);

    const auto compute_start = Clock::now();
    const double collectives_before = collective_seconds(*cp);
    lv_rank_inputs abi_in = describe_inputs(in, buffers, valid, options.device);
    lv_rank_outputs abi_out{};
    abi_out.struct_size = sizeof(lv_rank_outputs);
    abi_out.grad = grad.data();
    abi_out.token_loss = static_cast<float*>(token_loss.data());
    CollectiveContext context;
    context.groups[LV_GROUP_TP] = &groups_.tp;
    context.groups[LV_GROUP_CP] = cp.get();
    context.groups[LV_GROUP_DP] = &groups_.dp;
    context.groups[LV_GROUP_DP_CP] = &groups_.batch;
    context.memory = memory_;
    const lv_collectives table{&context, plugin_allreduce, plugin_group_size, plugin_group_rank};
    // Native code cannot beat the rank's progress beacon: to the deadlock guard, the plugin's compute
    // between its collectives (whose entries and exits do count) gets the timeout as its grace period.
    // The split above is its last beat before the call.
    const int status = call_plugin(abi_in, abi_out, table);
    plugin_memory::wait_for_device(memory_);  // work a plugin left queued on its own streams
    if (context.failure) std::rethrow_exception(context.failure);
    if (!context.misuse.empty()) fail(context.misuse);
    if (status != 0) {
      abi_out.error[sizeof(abi_out.error) - 1] = '\0';
      fail("run_rank returned " + std::to_string(status) +
           (abi_out.error[0] != '\0' ? ": " + std::string(abi_out.error) : " (no message in outputs->error)"));
    }
    take_outputs(abi_out, in, grad, token_loss);
    out_.collective_seconds = collective_seconds(*cp) - collectives_before;
    out_.compute_seconds = seconds_since(compute_start) - out_.collective_seconds;
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw InternalError("plugin " + plugin_.spec + ": " + what);  // the rank's world names the rank
  }

  // A C++ plugin whose exception unwinds through the C ABI (GCC and Clang on Linux carry it) is named too.
  int call_plugin(const lv_rank_inputs& in, lv_rank_outputs& out, const lv_collectives& table) const {
    const PluginCallScope scope(plugin_.spec.c_str(), rank_);
    try {
      return plugin_.entry->run_rank(&in, &out, &table);
    } catch (const std::exception& e) {
      fail(std::string("run_rank threw a C++ exception through the C ABI: ") + e.what());
    } catch (...) {
      fail("run_rank threw through the C ABI");
    }
  }

  double collective_seconds(const Communicator& cp) const {
    return groups_.tp.collective_seconds() + groups_.batch.collective_seconds() + groups_.dp.collective_seconds() +
           cp.collective_seconds();
  }

  InputBuffers upload(const RankInputs& in) const {
    InputBuffers b;
    b.logits = buffer_of(memory_, in.logits);
    if (case_.loss.kind == LossKind::kd) b.teacher = buffer_of(memory_, in.teacher_logits);
    b.labels = buffer_of(memory_, in.labels);
    b.loss_mask = buffer_of(memory_, in.loss_mask);
    b.upstream = buffer_of(memory_, in.upstream_weights);
    b.tokens = buffer_of(memory_, in.tokens);
    return b;
  }

  lv_rank_inputs describe_inputs(const RankInputs& in, const InputBuffers& b, std::int64_t valid, int device) const {
    const LayoutSpec& layout = case_.layout;
    const RankCoordinates& at = in.assignment.coordinates;
    lv_rank_inputs r{};
    r.struct_size = sizeof(lv_rank_inputs);
    r.world_rank = in.assignment.world_rank;
    r.world_size = layout.world_size();
    r.tp = at.tp;
    r.cp = at.cp;
    r.dp = at.dp;
    r.tp_size = layout.tp;
    r.cp_size = layout.cp;
    r.dp_size = layout.dp;
    r.ga = layout.ga;
    r.vocab_size = case_.shape.vocab;
    r.vocab_begin = in.assignment.vocab.begin;
    r.vocab_end = in.assignment.vocab.end;
    r.rows = in.rows();
    r.micro_batch_begin = in.assignment.micro_batch_begin.data();
    r.global_valid_tokens = valid;
    r.dtype = abi_dtype(in.dtype);
    r.memory = memory_;
    r.device = memory_ == LV_MEMORY_CUDA ? device : -1;
    r.logits = b.logits->data();
    r.teacher_logits = b.teacher ? b.teacher->data() : nullptr;
    r.labels = static_cast<const int64_t*>(b.labels->data());
    r.loss_mask = static_cast<const uint8_t*>(b.loss_mask->data());
    r.upstream_weights = static_cast<const double*>(b.upstream->data());
    r.tokens = static_cast<const int64_t*>(b.tokens->data());
    r.loss = abi_loss(case_.loss);
    r.framework.grad_reduce_avg = case_.framework.grad_reduce == FrameworkSpec::GradReduce::avg ? 1 : 0;
    r.framework.ga_reduce_mean = case_.framework.ga_reduce == FrameworkSpec::GaReduce::mean ? 1 : 0;
    r.params = plugin_.params.c_str();
    return r;
  }

  // Sizes and guards first: nothing the plugin wrote is read until it is known to fit.
  void take_outputs(const lv_rank_outputs& o, const RankInputs& in, const Buffer& grad, const Buffer& token_loss) {
    const std::int64_t rows = in.rows();
    const std::int64_t cols = in.columns();
    if (o.grad_rows != rows || o.grad_columns != cols) {
      fail("wrote a gradient of " + std::to_string(o.grad_rows) + " x " + std::to_string(o.grad_columns) +
           " (grad_rows x grad_columns), but the rank holds " + std::to_string(rows) + " rows x " +
           std::to_string(cols) + " vocabulary columns");
    }
    if (o.token_loss_count != rows) {
      fail("wrote " + std::to_string(o.token_loss_count) + " per-row losses (token_loss_count), but the rank holds " +
           std::to_string(rows) + " rows");
    }
    if (!grad.guard_intact()) fail("wrote past the end of its gradient buffer (outputs->grad)");
    if (!token_loss.guard_intact()) fail("wrote past the end of its per-row loss buffer (outputs->token_loss)");
    const bool logs_loss = case_.loss.reduction != Reduction::none;
    if (logs_loss && o.has_logged_loss == 0) {
      fail("reduction " + std::string(to_string(case_.loss.reduction)) +
           " logs a loss, but the plugin set has_logged_loss = 0");
    }
    if (o.logged_num_tokens < 0) fail("logged a negative token count " + std::to_string(o.logged_num_tokens));
    out_.grad.resize(grad.size());
    grad.download(out_.grad.data());
    out_.token_loss.resize(static_cast<std::size_t>(rows));
    token_loss.download(out_.token_loss.data());
    out_.has_reduced_loss = logs_loss;
    out_.reduced_loss = static_cast<float>(o.logged_loss);
    out_.logged_valid_tokens = o.logged_num_tokens;
  }

  const PluginLibrary& plugin_;
  const Case& case_;
  RankGroups groups_;
  lv_memory memory_;
  int rank_ = 0;
  RankOutput out_;
};

}  // namespace

RankOutput run_plugin_rank(const PluginLibrary& plugin, const Case& c, const InputSource& inputs,
                           RankAssignment assignment, RankGroups groups, const PluginRankOptions& options) {
  PluginRank rank(plugin, c, groups);
  return rank.run(inputs, std::move(assignment), options);
}

}  // namespace lossverify
