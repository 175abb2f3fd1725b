// `lossverify bench --gpus N`: the TP-sharded cross-entropy step on N GPUs, one thread rank per GPU, with the
// collectives the backend uses between them (the NCCL communicator: an all-gather of per-row statistics and a
// reduction in rank order on the host). Three figures and what bounds each:
//   - the two kernels of a shard (statistics, gradient) against their bytes-per-logit floor at the copy
//     bandwidth each GPU measures;
//   - the collectives against a latency + size / bandwidth model fitted to a message-size sweep of the same
//     communicator on the same GPUs;
//   - the whole step (kernels, the statistics' transfers, both collectives, the host's per-row work) against
//     the sum of the first two.
// The step's result is checked on sampled rows against the float64 reference of the global problem.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "lossverify/comm/nccl_communicator.hpp"
#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/cuda/cuda_check.hpp"
#include "lossverify/impl/cuda/bench_timing.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_kernels.hpp"
#include "lossverify/layout/vocab_range.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify::cuda {

namespace {

using Clock = std::chrono::steady_clock;
using bench_timing::Buffer;
using bench_timing::median;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The message sizes of the sweep, bytes per rank: 4 B to 16 MiB by factors of 4.
std::vector<std::size_t> sweep_sizes() {
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = 4; bytes <= (std::size_t{16} << 20); bytes *= 4) sizes.push_back(bytes);
  return sizes;
}

// t = latency + bytes / bandwidth, fitted by least squares weighted by 1/t^2 (each point's relative error
// counts alike, so the small messages set the latency and the large ones the bandwidth).
struct LinearModel {
  double latency_ms = 0.0;
  double ms_per_byte = 0.0;
  double predict_ms(double bytes) const { return latency_ms + ms_per_byte * bytes; }
};
LinearModel fit(const std::vector<std::size_t>& bytes, const std::vector<double>& ms) {
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const double w = 1.0 / (ms[i] * ms[i]);
    const double x = static_cast<double>(bytes[i]);
    sw += w, sx += w * x, sy += w * ms[i], sxx += w * x * x, sxy += w * x * ms[i];
  }
  LinearModel m;
  const double det = sw * sxx - sx * sx;
  m.ms_per_byte = det > 0 ? (sw * sxy - sx * sy) / det : 0.0;
  m.latency_ms = (sy - m.ms_per_byte * sx) / sw;
  return m;
}

// The slowest rank's figure: every rank passes its own, every rank gets the maximum.
double slowest(Communicator& world, double mine) {
  world.allreduce_max(std::span<double>(&mine, 1));
  return mine;
}

// What one GPU holds: its shard of two input sets (rotated, so L2 never holds the next launch's input), the
// gradient, the per-row statistics and the row constants of the kernels.
class Shard {
 public:
  Shard(const Case& c, const InputSource& inputs, VocabRange vocab, StorageType type, std::size_t element)
      : rows_(c.shape.tokens),
        vocab_(vocab),
        type_(type),
        logits_{Buffer(bytes(element)), Buffer(bytes(element))},
        grad_(bytes(element)),
        stats_(static_cast<std::size_t>(rows_) * 4 * sizeof(float)),
        row_max_(static_cast<std::size_t>(rows_) * sizeof(float)),
        log_sum_(static_cast<std::size_t>(rows_) * sizeof(float)),
        target_(static_cast<std::size_t>(rows_) * sizeof(std::int64_t)),
        ones_(static_cast<std::size_t>(rows_) * sizeof(int)),
        weight_(static_cast<std::size_t>(rows_) * sizeof(float)) {
    LV_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    LV_CUDA(cudaMallocHost(&host_stats_, static_cast<std::size_t>(rows_) * 4 * sizeof(float)));
    const auto n = static_cast<std::size_t>(rows_);
    std::vector<std::int64_t> counters(n), target(n);
    std::vector<int> zeros(n, 0), ones(n, 1);
    std::vector<float> weight(n, 1.0f / static_cast<float>(rows_));
    for (std::int64_t i = 0; i < rows_; ++i) {
      const std::int64_t label = inputs.label(i);
      counters[static_cast<std::size_t>(i)] = i;
      target[static_cast<std::size_t>(i)] = vocab_.contains(label) ? label - vocab_.begin : -1;
    }
    target_host_ = target;
    Buffer d_counters(n * sizeof(std::int64_t)), d_zeros(n * sizeof(int));
    LV_CUDA(cudaMemcpy(d_counters.p, counters.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    LV_CUDA(cudaMemcpy(d_zeros.p, zeros.data(), n * sizeof(int), cudaMemcpyHostToDevice));
    LV_CUDA(cudaMemcpy(target_.p, target.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    LV_CUDA(cudaMemcpy(ones_.p, ones.data(), n * sizeof(int), cudaMemcpyHostToDevice));
    LV_CUDA(cudaMemcpy(weight_.p, weight.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    for (int set = 0; set < 2; ++set) {
      const GenerateArgs g{static_cast<std::uint64_t>(c.inputs.seed + static_cast<std::uint64_t>(set)),
                           static_cast<int>(InputStream::student_logits),
                           d_counters.as<std::int64_t>(),
                           d_zeros.as<int>(),
                           rows_,
                           vocab_.begin,
                           vocab_.end,
                           static_cast<int>(LogitDistribution::normal),
                           c.inputs.mean,
                           c.inputs.scale,
                           c.inputs.mean,
                           c.inputs.scale};
      generate_logits(type_, g, logits_[set].p, stream_);
    }
    LV_CUDA(cudaStreamSynchronize(stream_));
  }
  ~Shard() {
    cudaFreeHost(host_stats_);
    cudaStreamDestroy(stream_);
  }
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  cudaStream_t stream() const { return stream_; }
  std::int64_t width() const { return vocab_.size(); }
  const VocabRange& vocab() const { return vocab_; }
  const void* grad() const { return grad_.p; }
  bool owns_target(std::int64_t row) const { return target_host_[static_cast<std::size_t>(row)] >= 0; }

  void stats_kernel(int set, const CrossEntropyConstants& k) {
    const StatsArgs args{logits_[set].p, rows_, width(), target_.as<std::int64_t>(), ones_.as<int>()};
    cross_entropy_stats(type_, args, k, stats_.as<float>(), stream_);
  }
  void grad_kernel(int set, const CrossEntropyConstants& k) {
    const GradArgs args{logits_[set].p,
                        grad_.p,
                        rows_,
                        width(),
                        target_.as<std::int64_t>(),
                        ones_.as<int>(),
                        ones_.as<int>(),
                        row_max_.as<float>(),
                        log_sum_.as<float>(),
                        weight_.as<float>()};
    cross_entropy_grad(type_, args, k, stream_);
  }
  // Pass 1 and its statistics on the host: [local max, sum exp relative to it, sum x, x_target] per row.
  const float* download_stats(int set, const CrossEntropyConstants& k) {
    stats_kernel(set, k);
    LV_CUDA(cudaMemcpyAsync(host_stats_, stats_.p, static_cast<std::size_t>(rows_) * 4 * sizeof(float),
                            cudaMemcpyDeviceToHost, stream_));
    LV_CUDA(cudaStreamSynchronize(stream_));
    return host_stats_;
  }
  // Pass 2 with the global statistics.
  void gradient(int set, const CrossEntropyConstants& k, const std::vector<float>& max,
                const std::vector<float>& log_sum) {
    LV_CUDA(cudaMemcpyAsync(row_max_.p, max.data(), max.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    LV_CUDA(
        cudaMemcpyAsync(log_sum_.p, log_sum.data(), log_sum.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    grad_kernel(set, k);
    LV_CUDA(cudaStreamSynchronize(stream_));
  }

 private:
  std::size_t bytes(std::size_t element) const { return static_cast<std::size_t>(rows_ * vocab_.size()) * element; }
  std::int64_t rows_;
  VocabRange vocab_;
  StorageType type_;
  Buffer logits_[2];
  Buffer grad_, stats_, row_max_, log_sum_, target_, ones_, weight_;
  std::vector<std::int64_t> target_host_;
  float* host_stats_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Phase times of one step (milliseconds).
struct StepTimes {
  double total = 0, statistics = 0, collectives = 0, host = 0, gradient = 0;
};

// One step as the backend runs it: pass 1 and its statistics to the host, the all-reduce of the maxima, the
// packed all-reduce of the sums, the per-row log-sum-exp and loss, pass 2. `loss` gets the per-token losses.
StepTimes run_step(Shard& shard, Communicator& tp, int set, const CrossEntropyConstants& k, double alpha,
                   std::int64_t vocab, std::vector<float>& loss) {
  const auto rows = loss.size();
  StepTimes t;
  const auto start = Clock::now();
  const float* s = shard.download_stats(set, k);
  t.statistics = ms_since(start);
  std::vector<float> max(rows), log_sum(rows);
  for (std::size_t i = 0; i < rows; ++i) max[i] = s[4 * i];
  auto mark = Clock::now();
  tp.allreduce_max(std::span<float>(max));
  t.collectives += ms_since(mark);
  const bool smoothing = alpha > 0.0;
  std::vector<float> packed((smoothing ? 3 : 2) * rows, 0.0f);
  const auto width = static_cast<float>(shard.width());
  for (std::size_t i = 0; i < rows; ++i) {
    const float m = max[i];
    packed[i] = s[4 * i + 1] * std::exp(s[4 * i] - m);
    if (shard.owns_target(static_cast<std::int64_t>(i))) packed[rows + i] = s[4 * i + 3] - m;
    if (smoothing) packed[2 * rows + i] = s[4 * i + 2] - width * m;
  }
  mark = Clock::now();
  tp.allreduce_sum(std::span<float>(packed));
  t.collectives += ms_since(mark);
  const auto v = static_cast<float>(vocab);
  const auto a = static_cast<float>(alpha);
  for (std::size_t i = 0; i < rows; ++i) {
    log_sum[i] = std::log(packed[i]);
    // l = lse - sum_v q_v x_v, everything relative to the max: log S - (1 - a) (x_l - M) - (a/V) sum (x - M)
    const float sum_shifted = smoothing ? packed[2 * rows + i] : 0.0f;
    loss[i] = log_sum[i] - (1.0f - a) * packed[rows + i] - a / v * sum_shifted;
  }
  mark = Clock::now();
  shard.gradient(set, k, max, log_sum);
  t.gradient = ms_since(mark);
  t.total = ms_since(start);
  t.host = t.total - t.statistics - t.collectives - t.gradient;
  return t;
}

// The slowest rank's median of each phase over `repeats` steps, every rank starting each step together.
StepTimes time_steps(Shard& shard, Communicator& world, Communicator& tp, int repeats, const CrossEntropyConstants& k,
                     double alpha, std::int64_t vocab, std::vector<float>& loss) {
  for (int i = 0; i < 3; ++i) run_step(shard, tp, i % 2, k, alpha, vocab, loss);
  std::vector<double> total, statistics, collectives, host, gradient;
  for (int i = 0; i < repeats; ++i) {
    world.barrier();
    const StepTimes t = run_step(shard, tp, i % 2, k, alpha, vocab, loss);
    total.push_back(t.total), statistics.push_back(t.statistics), collectives.push_back(t.collectives);
    host.push_back(t.host), gradient.push_back(t.gradient);
  }
  return StepTimes{slowest(world, median(total)), slowest(world, median(statistics)),
                   slowest(world, median(collectives)), slowest(world, median(host)), slowest(world, median(gradient))};
}

// Median milliseconds of the communicator's all-reduce at each size of the sweep (slowest rank).
std::vector<double> sweep_collectives(Communicator& world, Communicator& tp, int repeats,
                                      const std::vector<std::size_t>& sizes) {
  std::vector<double> result;
  for (const std::size_t bytes : sizes) {
    std::vector<float> data(bytes / sizeof(float), 1.0f);
    for (int i = 0; i < 3; ++i) tp.allreduce_sum(std::span<float>(data));
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
      world.barrier();
      const auto start = Clock::now();
      tp.allreduce_sum(std::span<float>(data));
      times.push_back(ms_since(start));
    }
    result.push_back(slowest(world, median(times)));
  }
  return result;
}

// The sampled rows of the step's gradient and loss against the float64 reference of the global problem.
struct CheckFigures {
  int rows_sampled = 0;
  double worst_ulp_beyond_atol = 0.0;
  double worst_loss_relative = 0.0;
};
CheckFigures check_sampled_rows(Shard& shard, Communicator& world, const Case& c, const InputSource& inputs,
                                const std::vector<float>& loss, DType dtype) {
  const int samples = 32;
  const std::int64_t rows = c.shape.tokens;
  const std::int64_t widest = vocab_range(c.shape.vocab, world.size(), 0).size();
  const std::size_t element = dtype_size(dtype);
  // Each rank's columns of the sampled rows, widened to float and padded to the widest shard.
  std::vector<float> mine(static_cast<std::size_t>(samples * widest), 0.0f);
  std::vector<std::byte> row_bytes(static_cast<std::size_t>(shard.width()) * element);
  for (int s = 0; s < samples; ++s) {
    const std::int64_t row = (static_cast<std::int64_t>(s) * 7919) % rows;
    LV_CUDA(cudaMemcpy(
        row_bytes.data(),
        static_cast<const std::byte*>(shard.grad()) + static_cast<std::size_t>(row * shard.width()) * element,
        row_bytes.size(), cudaMemcpyDeviceToHost));
    dispatch_dtype(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* g = reinterpret_cast<const T*>(row_bytes.data());
      for (std::int64_t col = 0; col < shard.width(); ++col)
        mine[static_cast<std::size_t>(s * widest + col)] = static_cast<float>(g[col]);
    });
  }
  std::vector<float> all(mine.size() * static_cast<std::size_t>(world.size()));
  world.all_gather(mine.data(), all.data(), mine.size() * sizeof(float));
  CheckFigures f;
  f.rows_sampled = samples;
  if (world.rank() != 0) return f;
  const LossReference reference(c, inputs);
  std::vector<double> x(static_cast<std::size_t>(c.shape.vocab)), expected(x.size());
  for (int s = 0; s < samples; ++s) {
    const std::int64_t row = (static_cast<std::int64_t>(s) * 7919) % rows;
    inputs.logits(row, 0, c.shape.vocab, x.data());
    const ReferenceToken token = reference.evaluate(row, x, {}, expected);
    f.worst_loss_relative = std::max(
        f.worst_loss_relative,
        std::fabs(static_cast<double>(loss[static_cast<std::size_t>(row)]) - token.loss) / std::fabs(token.loss));
    for (int r = 0; r < world.size(); ++r) {
      const VocabRange v = vocab_range(c.shape.vocab, world.size(), r);
      for (std::int64_t col = v.begin; col < v.end; ++col) {
        const double got = all[static_cast<std::size_t>((r * samples + s) * widest + (col - v.begin))];
        const double e = expected[static_cast<std::size_t>(col)];
        const double err = std::fabs(got - e);
        const double floor = 1e-6 / static_cast<double>(rows);  // the grad atol, in per-token units
        if (err > floor) f.worst_ulp_beyond_atol = std::max(f.worst_ulp_beyond_atol, err / ulp_size(e, dtype));
      }
    }
  }
  return f;
}

Case bench_case(const MultiGpuBenchOptions& o) {
  const nlohmann::json case_json = {
      {"name", "bench-gpus"},
      {"shape", {{"tokens", o.tokens}, {"vocab", o.vocab}}},
      {"loss", {{"label_smoothing", o.label_smoothing}}},
      {"inputs", {{"seed", 7}, {"dtype", std::string(to_string(o.dtype))}, {"scale", 2.0}}}};
  return parse_case(case_json, "<bench --gpus>");
}

CrossEntropyConstants correct_constants(double alpha, std::int64_t vocab) {
  const auto a = static_cast<float>(alpha);
  const auto v = static_cast<float>(vocab);
  return CrossEntropyConstants{1.0f - a + a / v, a / v, 1.0f - a + a / v, a / v, 0.0f, 0.0f, 0, 0, 0};
}

}  // namespace

nlohmann::json bench_multi_gpu(const MultiGpuBenchOptions& o) {
  if (!built_with_nccl()) throw InternalError("bench --gpus: this build has no NCCL (not found at configure time)");
  const int visible = visible_devices();
  if (o.gpus < 2 || o.gpus > visible) {
    throw InternalError("bench --gpus " + std::to_string(o.gpus) + ": " + std::to_string(visible) +
                        " CUDA GPU(s) visible (needs 2 or more)");
  }
  const Case c = bench_case(o);
  const InputSource inputs(c);
  const StorageType type = storage_of(o.dtype);
  const std::size_t element = dtype_size(o.dtype);
  const CrossEntropyConstants k = correct_constants(o.label_smoothing, o.vocab);
  const std::vector<std::size_t> sizes = sweep_sizes();
  const auto step_messages =
      std::vector<std::size_t>{static_cast<std::size_t>(o.tokens) * sizeof(float),
                               static_cast<std::size_t>(o.tokens) * sizeof(float) * (o.label_smoothing > 0.0 ? 3 : 2)};

  nlohmann::json result;
  std::vector<nlohmann::json> per_gpu(static_cast<std::size_t>(o.gpus));
  ThreadWorldOptions world_options;
  world_options.ranks = o.gpus;
  world_options.timeout_seconds = 600.0;
  run_thread_ranks(world_options, [&](Communicator& world) {
    const int device = world.rank();
    require_device(device);
    LV_CUDA(cudaSetDevice(device));
    cudaDeviceProp prop{};
    LV_CUDA(cudaGetDeviceProperties(&prop, device));
    const VocabRange vocab = vocab_range(o.vocab, o.gpus, world.rank());
    Shard shard(c, inputs, vocab, type, element);
    const double copy_tb_s = bench_timing::copy_bandwidth_tb_per_s(o.repeats, shard.stream());
    // The two kernels of the shard alone (every GPU at once), against 3 bytes per logit: pass 1 reads the
    // logits, pass 2 reads them again and writes the gradient.
    world.barrier();
    const double kernel_ms = bench_timing::time_ms(o.repeats, shard.stream(), [&](int i) {
      shard.stats_kernel(i % 2, k);
      shard.grad_kernel(i % 2, k);
    });
    const double floor_ms =
        3.0 * static_cast<double>(element) * static_cast<double>(o.tokens * vocab.size()) / (copy_tb_s * 1e12) * 1e3;
    per_gpu[static_cast<std::size_t>(world.rank())] = {
        {"gpu", device},          {"device", prop.name}, {"vocab_columns", vocab.size()}, {"copy_tb_per_s", copy_tb_s},
        {"kernel_ms", kernel_ms}, {"floor_ms", floor_ms}};
    const double slowest_kernel_ms = slowest(world, kernel_ms);
    const double slowest_floor_ms = slowest(world, floor_ms);

    std::unique_ptr<Communicator> tp = make_nccl_group(world, device, world_options.timeout_seconds, NcclRole::tp);
    const std::vector<double> sweep_ms = sweep_collectives(world, *tp, o.repeats, sizes);
    const LinearModel model = fit(sizes, sweep_ms);
    const std::vector<double> message_ms = sweep_collectives(world, *tp, o.repeats, step_messages);
    std::vector<float> loss(static_cast<std::size_t>(o.tokens));
    const StepTimes step = time_steps(shard, world, *tp, o.repeats, k, o.label_smoothing, o.vocab, loss);
    run_step(shard, *tp, 0, k, o.label_smoothing, o.vocab, loss);  // set 0 (the case's seed): the one checked
    const CheckFigures check = check_sampled_rows(shard, world, c, inputs, loss, o.dtype);
    if (world.rank() != 0) return;

    nlohmann::json sweep = nlohmann::json::array();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      sweep.push_back({{"bytes_per_rank", sizes[i]},
                       {"ms", sweep_ms[i]},
                       {"model_ms", model.predict_ms(static_cast<double>(sizes[i]))}});
    }
    nlohmann::json messages = nlohmann::json::array();
    double model_step_collectives = 0.0;
    for (std::size_t i = 0; i < step_messages.size(); ++i) {
      const double predicted = model.predict_ms(static_cast<double>(step_messages[i]));
      model_step_collectives += predicted;
      messages.push_back({{"what", i == 0 ? "row maxima" : "packed sums"},
                          {"bytes_per_rank", step_messages[i]},
                          {"ms", message_ms[i]},
                          {"model_ms", predicted}});
    }
    const double sum_ms = slowest_kernel_ms + model_step_collectives;
    const bool pass = check.worst_ulp_beyond_atol <= 1.0 && check.worst_loss_relative <= 1e-5;
    result = {{"gpus", o.gpus},
              {"per_gpu", per_gpu},
              {"shape", {{"tokens", o.tokens}, {"vocab", o.vocab}}},
              {"dtype", std::string(to_string(o.dtype))},
              {"label_smoothing", o.label_smoothing},
              {"repeats", o.repeats},
              {"kernels",
               {{"ms", slowest_kernel_ms},
                {"floor_ms", slowest_floor_ms},
                {"floor_bytes_per_logit", 3.0 * static_cast<double>(element)},
                {"percent_of_floor", 100.0 * slowest_floor_ms / slowest_kernel_ms}}},
              {"collectives",
               {{"path", "NCCL all-gather staged through the GPU, reduced in rank order on the host"},
                {"sweep", sweep},
                {"model", {{"latency_us", model.latency_ms * 1e3}, {"bandwidth_gb_per_s", 1e-6 / model.ms_per_byte}}},
                {"step_messages", messages}}},
              {"step",
               {{"ms", step.total},
                {"statistics_ms", step.statistics},
                {"collectives_ms", step.collectives},
                {"host_ms", step.host},
                {"gradient_ms", step.gradient},
                {"kernels_plus_model_ms", sum_ms},
                {"ratio_to_sum", step.total / sum_ms}}},
              {"check",
               {{"rows_sampled", check.rows_sampled},
                {"worst_ulp_beyond_atol", check.worst_ulp_beyond_atol},
                {"worst_loss_relative", check.worst_loss_relative},
                {"pass", pass}}}};
  });
  release_nccl_endpoints();
  return result;
}

}  // namespace lossverify::cuda
