#include "lossverify/impl/plugin/plugin_backend.hpp"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/plugin/plugin_host.hpp"
#include "lossverify/impl/plugin/plugin_region.hpp"
#include "lossverify/impl/plugin/settings_block.hpp"
#include "lossverify/impl/rank_inputs.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify {

namespace {

namespace ph = plugin_host;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

template <std::size_t N>
std::string text_of(const char (&chars)[N]) {
  return std::string(chars, strnlen(chars, N));
}

std::uint64_t random_word() {
  thread_local std::mt19937_64 generator(std::random_device{}());
  return generator();
}

lv_dtype abi_dtype(DType d) {
  return d == DType::bf16 ? LV_DTYPE_BF16 : d == DType::fp16 ? LV_DTYPE_F16 : LV_DTYPE_F32;
}

// The v1 structures' shared fields; the kind fills its own (LossKind::plugin_settings).
lv_loss_config abi_loss(const LossSpec& loss) {
  lv_loss_config config{};
  const std::optional<int> code = kind_of(loss).plugin_kind();
  config.kind = code ? static_cast<lv_loss_kind>(*code) : LV_LOSS_BY_NAME;
  config.reduction = loss.reduction == Reduction::sum    ? LV_REDUCTION_SUM
                     : loss.reduction == Reduction::none ? LV_REDUCTION_NONE
                                                         : LV_REDUCTION_MEAN;
  config.ignore_index = loss.ignore_index;
  return config;
}

// Every setting of the case's kind, whole, from its table (settings_block.hpp).
std::string abi_settings_block(const LossSpec& loss) {
  const LossKind& kind = kind_of(loss);
  std::vector<ph::EncodedSetting> encoded;
  for (const Setting& s : kind.settings()) {
    const nlohmann::json value = s.get(loss);
    ph::EncodedSetting e;
    e.name = s.key;
    switch (s.type) {
      case Setting::Type::number:
        e.type = LV_SETTING_NUMBER;
        e.number = value.get<double>();
        break;
      case Setting::Type::integer:
        e.type = LV_SETTING_INTEGER;
        e.integer = value.get<std::int64_t>();
        break;
      case Setting::Type::boolean:
        e.type = LV_SETTING_BOOLEAN;
        e.integer = value.get<bool>() ? 1 : 0;
        break;
      case Setting::Type::choice:
        e.type = LV_SETTING_CHOICE;
        e.choice = value.get<std::string>();
        break;
    }
    encoded.push_back(std::move(e));
  }
  return ph::encode_settings(kind.name(), encoded);
}

// Where each of a kind's per-token inputs (the kind's token_inputs(), by their export names) goes in the ABI: the
// columns of RegionLayout::token_inputs, lv_rank_inputs' old_logprob, ref_logprob and advantages.
constexpr std::string_view kAbiTokenInputs[plugin_host::kTokenInputs] = {"old_logprob", "ref_logprob", "advantages"};

std::vector<std::size_t> abi_token_input_columns(const LossSpec& loss) {
  std::vector<std::size_t> columns;
  for (const std::string& name : kind_of(loss).token_inputs(loss)) {
    const auto* at = std::find(std::begin(kAbiTokenInputs), std::end(kAbiTokenInputs), name);
    if (at == std::end(kAbiTokenInputs)) throw InternalError("the plugin ABI has no per-row input " + name);
    columns.push_back(static_cast<std::size_t>(at - std::begin(kAbiTokenInputs)));
  }
  return columns;
}

std::string names_of(const std::vector<std::string>& names) {
  std::string list;
  for (const std::string& name : names) append_to_list(list, name);
  return list;
}

const char* element_name(std::int64_t e) { return e == LV_ELEMENT_F32 ? "f32" : e == LV_ELEMENT_F64 ? "f64" : "i64"; }
const char* op_name(std::int64_t op) { return op == LV_REDUCE_SUM ? "sum" : "max"; }
const char* group_name(std::int32_t g) {
  return g == LV_GROUP_TP ? "TP" : g == LV_GROUP_CP ? "CP" : g == LV_GROUP_DP ? "DP" : "DP x CP";
}

// Hosts that served a run cleanly wait for the next run of the same plugin: starting one and loading the
// library again costs milliseconds for every rank of every run, and a gate makes hundreds. A host that failed
// in any way is never kept.
class HostPool {
 public:
  std::unique_ptr<PluginHostProcess> take(const std::string& spec) {
    const std::lock_guard lock(mutex_);
    auto& idle = idle_[spec];
    if (idle.empty()) return nullptr;
    std::unique_ptr<PluginHostProcess> host = std::move(idle.back());
    idle.pop_back();
    return host;
  }
  void keep(const std::string& spec, std::unique_ptr<PluginHostProcess> host) {
    const std::lock_guard lock(mutex_);
    idle_[spec].push_back(std::move(host));
  }

 private:
  std::mutex mutex_;
  std::map<std::string, std::vector<std::unique_ptr<PluginHostProcess>>> idle_;
};

HostPool& host_pool() {
  static HostPool pool;  // destroyed at exit: its hosts are killed and reaped
  return pool;
}

template <class T>
void put(const SharedRegion& region, std::uint64_t offset, const std::vector<T>& values) {
  if (!values.empty()) std::memcpy(region.at(offset), values.data(), values.size() * sizeof(T));
}

}  // namespace

class PluginRank {
 public:
  PluginRank(const PluginLibrary& plugin, const Case& c, RankGroups groups, const PluginRankOptions& options)
      : plugin_(plugin), case_(c), groups_(groups), options_(options) {}

  RankOutput run(const InputSource& inputs, RankAssignment assignment, PluginSession& session) {
    const auto start = Clock::now();
    const RankInputs in = make_rank_inputs(case_, inputs, std::move(assignment), options_.threads);
    out_.assignment = in.assignment;
    out_.dtype = in.dtype;
    rank_ = in.assignment.world_rank;
    std::int64_t valid = 0;
    for (std::int64_t t = 0; t < case_.shape.tokens; ++t) valid += inputs.is_valid(t);
    Communicator& cp = groups_.cp;

    RegionSizes sizes;
    sizes.params_bytes = plugin_.params.size() + 1;
    const std::string settings_block = abi_settings_block(case_.loss);
    sizes.settings_bytes = settings_block.size() + 1;
    sizes.micro_batches = case_.layout.ga;
    sizes.logits_bytes = in.logits.size();
    sizes.teacher_bytes = kind_of(case_.loss).inputs().teacher_logits ? in.logits.size() : 0;
    sizes.rows = in.rows();
    sizes.grad_bytes = in.logits.size();
    sizes.token_values = kind_of(case_.loss).token_quantities().size();
    sizes.scope_values = static_cast<std::size_t>(case_.layout.ga * kind_of(case_.loss).scope_values_width(case_));
    const std::vector<std::vector<std::byte>> stage_inputs = size_stage(in, inputs, sizes);
    layout_ = region_layout(sizes);
    std::uint8_t canary[ph::kCanaryBytes];
    for (std::size_t k = 0; k < ph::kCanaryBytes; k += 8) {
      const std::uint64_t word = random_word();
      std::memcpy(canary + k, &word, 8);
    }
    const SharedRegion region(layout_, canary);
    fill(region, in);
    fill_stage(region, stage_inputs);
    std::memcpy(region.at(layout_.settings), settings_block.c_str(), settings_block.size() + 1);
    std::unique_ptr<PluginHostProcess> host = host_pool().take(plugin_.spec);
    if (!host) {
      host = std::make_unique<PluginHostProcess>(plugin_.path, plugin_.params, PluginHostProcess::Mode::serve);
      await_hello(*host, region);
    }
    const auto sequences = static_cast<std::int64_t>(inputs.batch().sequences().size());
    const ph::Run run = describe(in, canary, valid, sequences, cp);
    host->send(run, region.fd());
    out_.generate_seconds = seconds_since(start);

    const auto compute_start = Clock::now();
    const double collectives_before = collective_seconds(cp);
    const ph::Done done = converse(*host, region, run.header.token, cp);
    take_outputs(done, in, region);
    out_.collective_seconds = collective_seconds(cp) - collectives_before;
    out_.compute_seconds = seconds_since(compute_start) - out_.collective_seconds;
    session.host_ = std::move(host);
    session.spec_ = plugin_.spec;
    session.rank_ = rank_;
    session.token_ = run.header.token;
    session.timeout_seconds_ = options_.timeout_seconds;
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw InternalError("plugin " + printable(plugin_.spec) + ": " + what);  // the rank's world names the rank
  }

  // A stage in front (the LM head): its inputs, the rows whose input gradient the rank returns, and the sizes of
  // its outputs in the region; under it the plugin makes the logits, so none are handed over.
  std::vector<std::vector<std::byte>> size_stage(const RankInputs& in, const InputSource& inputs, RegionSizes& sizes) {
    const Stage* stage = case_.loss.stage;
    if (stage == nullptr) return {};
    std::vector<std::vector<std::byte>> stage_inputs = stage->plugin_inputs(case_, inputs, in.assignment);
    if (stage_inputs.size() != 3 || stage->gradients().size() != 1 || stage->parameters().size() != 2) {
      throw InternalError("the plugin ABI carries a stage of 3 inputs, 1 input gradient and 2 parameter gradients");
    }
    out_.stage_rows = stage->gradient_rows(case_, in.assignment);
    out_.stage_columns = {stage->gradient_columns(0, case_, in.assignment)};
    const std::size_t element = dtype_size(in.dtype);
    sizes.logits_bytes = 0;
    sizes.hidden_bytes = stage_inputs[0].size();
    sizes.head_weight_bytes = stage_inputs[1].size();
    sizes.head_bias_bytes = stage_inputs[2].size();
    sizes.head_dh_rows = static_cast<std::int64_t>(out_.stage_rows.size());
    sizes.head_dh_bytes = out_.stage_rows.size() * static_cast<std::size_t>(out_.stage_columns[0]) * element;
    for (std::size_t p = 0; p < 2; ++p) {
      const ParameterShape shape = stage->parameter_shape(p, case_, in.assignment);
      (p == 0 ? sizes.head_dw_bytes : sizes.head_db_bytes) =
          static_cast<std::size_t>(shape.rows * shape.columns) * element;
    }
    return stage_inputs;
  }

  void fill_stage(const SharedRegion& region, const std::vector<std::vector<std::byte>>& stage_inputs) const {
    if (stage_inputs.empty()) return;
    put(region, layout_.hidden, stage_inputs[0]);
    put(region, layout_.head_weight, stage_inputs[1]);
    put(region, layout_.head_bias, stage_inputs[2]);
    put(region, layout_.head_dh_row_index, out_.stage_rows);
  }

  void fill(const SharedRegion& region, const RankInputs& in) const {
    std::memcpy(region.at(layout_.params), plugin_.params.c_str(), plugin_.params.size() + 1);
    put(region, layout_.micro_batch_begin, in.assignment.micro_batch_begin);
    if (layout_.logits_bytes > 0) put(region, layout_.logits, in.logits);
    if (kind_of(case_.loss).inputs().teacher_logits) put(region, layout_.teacher, in.teacher_logits);
    put(region, layout_.labels, in.labels);
    put(region, layout_.loss_mask, in.loss_mask);
    put(region, layout_.upstream, in.upstream_weights);
    put(region, layout_.tokens, in.tokens);
    put(region, layout_.sequences, in.sequences);
    fill_token_inputs(region, in);
  }

  // The kind's per-token inputs of every row (RankInputs::token_inputs, as export-inputs writes them), each
  // into its ABI array; the region is zero-filled, so arrays the kind does not read stay 0.
  void fill_token_inputs(const SharedRegion& region, const RankInputs& in) const {
    const std::vector<std::size_t> columns = abi_token_input_columns(case_.loss);
    const std::uint64_t column_bytes = static_cast<std::uint64_t>(in.rows()) * sizeof(float);
    for (std::size_t k = 0; k < columns.size(); ++k) {
      put(region, layout_.token_inputs + columns[k] * column_bytes, in.token_inputs[k]);
    }
  }

  ph::Run describe(const RankInputs& in, const std::uint8_t* canary, std::int64_t valid, std::int64_t sequences,
                   Communicator& cp) const {
    const LayoutSpec& layout = case_.layout;
    const RankCoordinates& at = in.assignment.coordinates;
    ph::Run r;
    r.header.token = random_word() | 1;
    r.layout = layout_;
    std::memcpy(r.canary, canary, ph::kCanaryBytes);
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
    r.global_valid_tokens = valid;
    r.num_sequences = sequences;
    r.dtype = abi_dtype(in.dtype);
    r.device = plugin_.device_memory() ? options_.device : -1;
    r.has_teacher = kind_of(case_.loss).inputs().teacher_logits ? 1 : 0;
    lv_rank_inputs settings{};
    settings.loss = abi_loss(case_.loss);
    kind_of(case_.loss).plugin_settings(case_.loss, settings);
    r.loss = settings.loss;
    r.policy = settings.policy;
    r.policy_ratio = settings.policy_ratio;
    r.sequence_parallel = !tp_splits_columns(case_) && layout.sp ? 1 : 0;
    if (const Stage* stage = case_.loss.stage) {
      stage->plugin_settings(case_, in.assignment, settings);
      r.head_hidden = settings.head_hidden;
      r.head_bias = settings.head_bias;
      r.head_dh_reduce = settings.head_dh_reduce;
      r.head_dh_rows = static_cast<std::int64_t>(out_.stage_rows.size());
    }
    r.framework.grad_reduce_avg = case_.framework.grad_reduce == FrameworkSpec::GradReduce::avg ? 1 : 0;
    r.framework.ga_reduce_mean = case_.framework.ga_reduce == FrameworkSpec::GaReduce::mean ? 1 : 0;
    Communicator* groups[4] = {&groups_.tp, &cp, &groups_.dp, &groups_.batch};
    for (int g = 0; g < 4; ++g) {
      r.group_size[g] = groups[g]->size();
      r.group_rank[g] = groups[g]->rank();
    }
    // No loss all-reduces more than a few numbers per row (a head its dh); four times the rank's logits (and h) is a
    // wide bound.
    r.max_allreduce_bytes =
        std::max<std::uint64_t>(std::uint64_t{64} << 20, 4 * (in.logits.size() + layout_.hidden_bytes));
    return r;
  }

  // The host loads the library (validated when it was probed) and says hello before its call.
  void await_hello(PluginHostProcess& host, const SharedRegion& region) const {
    const auto reply = host.next(std::max(options_.timeout_seconds, 300.0), abandon());
    if (reply.is<ph::Hello>()) {
      const ph::Hello hello = reply.as<ph::Hello>();
      if (hello.ok != 1) fail("the plugin host could not load it: " + printable(text_of(hello.message)));
      return;
    }
    on_silence_or_end(host, region, reply, "while loading the library");
  }

  std::function<bool()> abandon() const {
    return [this] { return groups_.tp.aborted(); };
  }

  // A wait that got no message: the world failed, the host is silent past the timeout, or it ended.
  [[noreturn]] void on_silence_or_end(PluginHostProcess& host, const SharedRegion& region,
                                      const PluginHostProcess::Received& reply, const char* phase) const {
    const std::string who = "plugin " + printable(plugin_.spec);
    if (reply.kind == PluginHostProcess::Received::Kind::abandoned) {
      throw InternalError(who + ": abandoned in rank " + std::to_string(rank_) + ": another rank failed");
    }
    if (reply.kind == PluginHostProcess::Received::Kind::timed_out) {
      throw TimeoutError(who + " in rank " + std::to_string(rank_) + ": no collective call and no result for " +
                         std::to_string(static_cast<int>(options_.timeout_seconds)) + " s " + phase +
                         " (a hang in the plugin, or a rank that never reaches a collective?)");
    }
    if (reply.kind == PluginHostProcess::Received::Kind::message) {
      fail("rank " + std::to_string(rank_) + ": the plugin host sent an unexpected message " + phase +
           " (did the plugin write to its file descriptor 3?)");
    }
    const int sig = host.signal_number();
    const std::string how = host.ended_how();
    const auto* crash = reinterpret_cast<const ph::CrashRecord*>(region.at(layout_.crash));
    if ((sig == SIGSEGV || sig == SIGBUS) && crash->signal == sig) {
      const std::string guard = region.guard_hit(crash->offset);
      if (!guard.empty()) fail("wrote " + guard + " (" + signal_description(sig) + " at its guard page)");
    }
    if (sig != 0)
      throw InternalError(who + " crashed in rank " + std::to_string(rank_) + ": " + signal_description(sig) + " " +
                          phase);
    throw InternalError(who + " ended its process in rank " + std::to_string(rank_) + " " + phase + ": the host " +
                        how + " without reporting a result (an exit in a plugin is never a result)");
  }

  ph::Done converse(PluginHostProcess& host, const SharedRegion& region, std::uint64_t token, Communicator& cp) {
    std::string misuse;
    for (;;) {
      const auto reply = host.next(options_.timeout_seconds, abandon());
      if (reply.kind != PluginHostProcess::Received::Kind::message) {
        on_silence_or_end(host, region, reply, "in run_rank");
      }
      if (reply.is<ph::Allreduce>() && reply.as<ph::Allreduce>().header.token == token) {
        serve_allreduce(host, region, reply.as<ph::Allreduce>(), cp);
      } else if (reply.is<ph::Misuse>() && reply.as<ph::Misuse>().header.token == token) {
        if (misuse.empty()) misuse = printable(text_of(reply.as<ph::Misuse>().message));
      } else if (reply.is<ph::Done>() && reply.as<ph::Done>().header.token == token) {
        if (!misuse.empty()) fail(misuse);
        return reply.as<ph::Done>();
      } else {
        on_silence_or_end(host, region, reply, "in run_rank");
      }
    }
  }

  Communicator& group(std::int32_t g, Communicator& cp) const {
    return g == LV_GROUP_TP ? groups_.tp : g == LV_GROUP_CP ? cp : g == LV_GROUP_DP ? groups_.dp : groups_.batch;
  }

  // One chunk of the plugin's all-reduce, over the rank's real group. The first chunk of a call first checks
  // that every rank of the group makes the same call (number, count, element, op): a mismatch fails them all.
  void serve_allreduce(PluginHostProcess& host, const SharedRegion& region, const ph::Allreduce& a,
                       Communicator& cp) const {
    Communicator& comm = group(a.group, cp);
    if (a.chunk_begin == 0) agree(comm, a);
    const ElementType type = a.element == LV_ELEMENT_F32   ? ElementType::f32
                             : a.element == LV_ELEMENT_F64 ? ElementType::f64
                                                           : ElementType::i64;
    const auto n = static_cast<std::size_t>(a.chunk_count);
    if (n * element_size(type) > layout_.staging_bytes) fail("an all-reduce chunk larger than the staging area");
    comm.allreduce(region.at(layout_.staging), n, type, a.op == LV_REDUCE_SUM ? ReduceOp::sum : ReduceOp::max);
    ph::AllreduceDone reply;
    reply.header.token = a.header.token;
    host.send(reply);
  }

  void agree(Communicator& comm, const ph::Allreduce& a) const {
    const std::int64_t mine[4] = {a.call, a.count, a.element, a.op};
    std::vector<std::int64_t> all(4 * static_cast<std::size_t>(comm.size()));
    comm.all_gather(mine, all.data(), sizeof(mine));
    bool same = true;
    for (std::size_t k = 0; k < all.size(); ++k) same = same && all[k] == all[k % 4];
    if (same) return;
    std::string calls;
    for (int r = 0; r < comm.size(); ++r) {
      const std::int64_t* c = all.data() + 4 * r;
      calls += (r == 0 ? "" : "; ") + std::string("group rank ") + std::to_string(r) + ": call " +
               std::to_string(c[0]) + ", count " + std::to_string(c[1]) + ", " + element_name(c[2]) + ", " +
               op_name(c[3]);
    }
    fail("the ranks of its " + std::string(group_name(a.group)) +
         " group made different all-reduce calls (every rank must call with the same count, element and op): " + calls);
  }

  // Status and sizes first, then the guards: nothing the plugin wrote is read until it is known to fit.
  void take_outputs(const ph::Done& done, const RankInputs& in, const SharedRegion& region) {
    if (done.status == -1 || done.status == -2) fail(printable(text_of(done.error)));
    if (done.status != 0) {
      const std::string error = printable(text_of(done.error));
      fail("run_rank returned " + std::to_string(done.status) +
           (error.empty() ? " (no message in outputs->error)" : ": " + error));
    }
    const std::int64_t rows = in.rows();
    const std::int64_t cols = in.columns();
    if (done.grad_rows != rows || done.grad_columns != cols) {
      fail("wrote a gradient of " + std::to_string(done.grad_rows) + " x " + std::to_string(done.grad_columns) +
           " (grad_rows x grad_columns), but the rank holds " + std::to_string(rows) + " rows x " +
           std::to_string(cols) + " vocabulary columns");
    }
    if (done.token_loss_count != rows) {
      fail("wrote " + std::to_string(done.token_loss_count) +
           " per-row losses (token_loss_count), but the rank holds " + std::to_string(rows) + " rows");
    }
    if (const std::string touched = region.touched_canary(); !touched.empty()) {
      fail("wrote outside its output buffers: the bytes before its " + touched +
           " changed (a write before that buffer, or far past the one before it)");
    }
    if (done.device_guards_intact == 0)
      fail("wrote outside its gradient, per-row loss or per-row value buffer on the GPU");
    const bool logs_loss = case_.loss.reduction != Reduction::none;
    if (logs_loss && done.has_logged_loss == 0) {
      fail("reduction " + std::string(to_string(case_.loss.reduction)) +
           " logs a loss, but the plugin set has_logged_loss = 0");
    }
    if (done.logged_num_tokens < 0) fail("logged a negative token count " + std::to_string(done.logged_num_tokens));
    // The kind's per-row values and statistics: only a plugin that declares the kind (a plugin built with these
    // outputs) is given a case of a kind that has them.
    const LossKind& kind = kind_of(case_.loss);
    const auto values = static_cast<std::int64_t>(kind.token_quantities().size());
    if (values > 0 && (done.token_value_rows != rows || done.token_value_columns != values)) {
      fail("wrote " + std::to_string(done.token_value_rows) + " x " + std::to_string(done.token_value_columns) +
           " per-row values (token_value_rows x token_value_columns), but the rank holds " + std::to_string(rows) +
           " rows of " + std::to_string(values) + " values (" + names_of(kind.token_quantities()) + ")");
    }
    const auto statistics = static_cast<std::int32_t>(kind.logged_statistics(case_.loss).size());
    if (statistics > LV_MAX_LOGGED_STATISTICS) {
      throw InternalError("loss kind " + std::string(kind.name()) +
                          " logs more statistics than the plugin ABI carries");
    }
    if (statistics > 0 && done.logged_statistics_count != statistics) {
      fail("wrote " + std::to_string(done.logged_statistics_count) +
           " logged statistics (logged_statistics_count), but this loss logs " + std::to_string(statistics) + " (" +
           names_of(kind.logged_statistics(case_.loss)) + ")");
    }
    out_.grad.assign(region.at(layout_.grad), region.at(layout_.grad) + layout_.grad_bytes);
    out_.token_loss.resize(static_cast<std::size_t>(rows));
    std::memcpy(out_.token_loss.data(), region.at(layout_.token_loss), layout_.token_loss_bytes);
    out_.has_reduced_loss = logs_loss;
    out_.reduced_loss = static_cast<float>(done.logged_loss);
    out_.logged_valid_tokens = done.logged_num_tokens;
    out_.token_values.resize(static_cast<std::size_t>(rows * values));
    if (values > 0) std::memcpy(out_.token_values.data(), region.at(layout_.token_values), layout_.token_values_bytes);
    out_.logged_stats.assign(done.logged_statistics, done.logged_statistics + statistics);
    // The kind's scope values where the plugin wrote them (a router's counts); none: the check is not applicable.
    const auto scope_values = static_cast<std::int64_t>(layout_.scope_values_bytes / 8);
    if (done.scope_value_count != 0 && done.scope_value_count != scope_values) {
      fail("wrote " + std::to_string(done.scope_value_count) + " scope values (scope_value_count), but this loss has " +
           std::to_string(scope_values) + " (" + std::string(kind.scope_values_name()) + ": ga x the row's width)");
    }
    if (done.scope_value_count != 0) {
      out_.scope_values.resize(static_cast<std::size_t>(scope_values));
      std::memcpy(out_.scope_values.data(), region.at(layout_.scope_values), layout_.scope_values_bytes);
    }
    if (case_.loss.stage != nullptr) take_stage_outputs(done, region);
  }

  // The head's dh, dW and db (checked sizes), as the stage's gradient and parameter gradients.
  void take_stage_outputs(const ph::Done& done, const SharedRegion& region) {
    const std::size_t element = dtype_size(out_.dtype);
    const struct {
      std::int64_t written;
      std::uint64_t offset, bytes;
      const char* what;
    } outputs[] = {{done.head_dh_count, layout_.head_dh, layout_.head_dh_bytes, "dh elements (head_dh_count)"},
                   {done.head_dw_count, layout_.head_dw, layout_.head_dw_bytes, "dW elements (head_dw_count)"},
                   {done.head_db_count, layout_.head_db, layout_.head_db_bytes, "db elements (head_db_count)"}};
    for (const auto& o : outputs) {
      const auto expected = static_cast<std::int64_t>(o.bytes / element);
      if (o.written != expected) {
        fail("wrote " + std::to_string(o.written) + " " + o.what + ", but the rank's head has " +
             std::to_string(expected) + (o.offset == layout_.head_dh ? " (head_dh_rows x head_hidden)" : ""));
      }
    }
    out_.stage_grads = {
        std::vector<std::byte>(region.at(layout_.head_dh), region.at(layout_.head_dh) + layout_.head_dh_bytes)};
    out_.stage_params = {
        std::vector<std::byte>(region.at(layout_.head_dw), region.at(layout_.head_dw) + layout_.head_dw_bytes),
        std::vector<std::byte>(region.at(layout_.head_db), region.at(layout_.head_db) + layout_.head_db_bytes)};
  }

  double collective_seconds(const Communicator& cp) const {
    return groups_.tp.collective_seconds() + groups_.batch.collective_seconds() + groups_.dp.collective_seconds() +
           cp.collective_seconds();
  }

  const PluginLibrary& plugin_;
  const Case& case_;
  RankGroups groups_;
  PluginRankOptions options_;
  ph::RegionLayout layout_{};
  int rank_ = 0;
  RankOutput out_;
};

PluginSession::PluginSession() = default;
PluginSession::~PluginSession() = default;

void PluginSession::finish() {
  if (!host_) return;
  std::unique_ptr<PluginHostProcess> host = std::move(host_);
  const std::string who = "plugin " + printable(spec_);
  ph::Quit quit;
  quit.header.token = token_;
  host->send(quit);
  const auto reply = host->next(std::max(timeout_seconds_, 10.0));
  if (reply.is<ph::Bye>() && reply.as<ph::Bye>().header.token == token_) {
    const std::int64_t late = reply.as<ph::Bye>().late_calls;
    if (late > 0) {
      throw InternalError(who + ": rank " + std::to_string(rank_) + ": the plugin called allreduce " +
                          std::to_string(late) +
                          " time(s) after run_rank returned (a thread it started?); a collective belongs inside "
                          "the call, and those calls were refused");
    }
    host_pool().keep(spec_, std::move(host));
    return;
  }
  if (reply.kind == PluginHostProcess::Received::Kind::ended) {
    const int sig = host->signal_number();
    throw InternalError(
        who +
        (sig != 0 ? " crashed in rank " + std::to_string(rank_) + ": " + signal_description(sig)
                  : " ended its process in rank " + std::to_string(rank_) + ": the host " + host->ended_how()) +
        " after run_rank returned (a thread it started?)");
  }
  throw InternalError(who + ": rank " + std::to_string(rank_) +
                      ": the plugin host did not answer after run_rank "
                      "returned");
}

RankOutput run_plugin_rank(const PluginLibrary& plugin, const Case& c, const InputSource& inputs,
                           RankAssignment assignment, RankGroups groups, const PluginRankOptions& options,
                           PluginSession& session) {
  PluginRank rank(plugin, c, groups, options);
  return rank.run(inputs, std::move(assignment), session);
}

}  // namespace lossverify
