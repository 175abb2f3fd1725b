#include "lossverify/checks/checks.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <tuple>

#include "lossverify/checks/tolerances.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/stage_trace.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/comm/communicator.hpp"
#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/impl/cuda/gpu_reference.hpp"
#include "lossverify/impl/cpu/sharded_loss.hpp"
#include <cstring>

namespace lossverify {

std::string_view to_string(Verdict v) {
  switch (v) {
    case Verdict::pass:
      return "pass";
    case Verdict::fail:
      return "fail";
    case Verdict::not_applicable:
      return "not_applicable";
  }
  return "?";
}

const std::vector<CheckInfo>& check_catalogue() {
  static const std::vector<CheckInfo> list = {
      {"loss", "per-token losses of every rank and the logged (reduced) loss vs the float64 reference"},
      {"grad", "every effective gradient element vs the reference: abs/rel error, ULP in the output dtype, "
               "mismatches per rank, worst (token, column, rank)"},
      {"rank_agreement", "all TP ranks of a token report the same loss (needs no reference)"},
      {"finite", "census of NaN, +-Inf and subnormal values per tensor and rank; fails on any non-finite value"},
      {"row_sum", "invariant: sum over the vocabulary of a token's gradient = w_t 2 w_z lse (0 without z-loss; "
                  "0 for KD); not applicable with softcap"},
      {"stats", "logged statistics (the valid-token count) of every rank vs the global count"},
      {"invariance", "the same case at several rank layouts gives the same losses and gradients (sweeps)"},
  };
  return list;
}

namespace {

double margin_of(double error, double tolerance) {
  if (std::isnan(error)) return std::numeric_limits<double>::infinity();
  if (error == 0.0) return 0.0;
  if (tolerance <= 0.0) return std::numeric_limits<double>::infinity();
  return error / tolerance;
}

bool earlier(const ElementRecord& a, const ElementRecord& b) {
  return std::tie(a.token, a.column, a.rank) < std::tie(b.token, b.column, b.rank);
}

// Smallest positive value of the output dtype: no output can be closer to the exact value than this.
double output_quantum(DType dtype) {
  switch (dtype) {
    case DType::fp16:
      return 0x1p-24;
    case DType::bf16:
      return 0x1p-133;
    case DType::fp32:
    default:
      return 0x1p-149;
  }
}

}  // namespace

void ErrorStats::add(const ElementRecord& r) {
  // Equal values (both +inf included) agree; inf against a finite value is an infinite error.
  const double error = r.got == r.expected ? 0.0 : std::fabs(r.got - r.expected);
  add_with_margin(r, margin_of(error, r.tolerance), !(error <= r.tolerance));  // NaN counts as a mismatch
}

void ErrorStats::add_with_margin(const ElementRecord& r, double m, bool mismatch) {
  ++compared_;
  const double error = r.got == r.expected ? 0.0 : std::fabs(r.got - r.expected);
  if (mismatch) ++mismatches_;
  if (std::isnan(error)) {
    max_abs_ = std::numeric_limits<double>::infinity();
  } else {
    max_abs_ = std::max(max_abs_, error);
    if (r.expected != 0.0) max_rel_ = std::max(max_rel_, error / std::fabs(r.expected));
  }
  if (!worst_ || m > max_margin_ || (m == max_margin_ && earlier(r, *worst_))) {
    max_margin_ = m;
    worst_ = r;
  }
}

void ErrorStats::merge(const ErrorStats& o) {
  compared_ += o.compared_;
  mismatches_ += o.mismatches_;
  max_abs_ = std::max(max_abs_, o.max_abs_);
  max_rel_ = std::max(max_rel_, o.max_rel_);
  max_ulp_ = std::max(max_ulp_, o.max_ulp_);
  if (o.worst_ && (!worst_ || o.max_margin_ > max_margin_ ||
                   (o.max_margin_ == max_margin_ && earlier(*o.worst_, *worst_)))) {
    worst_ = o.worst_;
    max_margin_ = o.max_margin_;
  }
}

nlohmann::json ErrorStats::to_json() const {
  return {{"compared", compared_},     {"mismatches", mismatches_}, {"max_abs_error", max_abs_},
          {"max_rel_error", max_rel_}, {"margin", max_margin_}};
}


PackedStats ErrorStats::pack() const {
  PackedStats p{};
  p.compared = compared_;
  p.mismatches = mismatches_;
  p.max_ulp = max_ulp_;
  p.max_abs = max_abs_;
  p.max_rel = max_rel_;
  p.margin = max_margin_;
  p.has_worst = worst_.has_value();
  if (worst_) {
    p.worst = {worst_->token,    worst_->column,   worst_->rank,     worst_->padding_sequence,
               worst_->padding_position, worst_->expected, worst_->got, worst_->tolerance};
  }
  return p;
}

ErrorStats ErrorStats::unpack(const PackedStats& p) {
  ErrorStats s;
  s.compared_ = p.compared;
  s.mismatches_ = p.mismatches;
  s.max_ulp_ = p.max_ulp;
  s.max_abs_ = p.max_abs;
  s.max_rel_ = p.max_rel;
  s.max_margin_ = p.margin;
  if (p.has_worst) {
    s.worst_ = ElementRecord{p.worst.token,    p.worst.column,           static_cast<int>(p.worst.rank),
                             p.worst.expected, p.worst.got,              p.worst.tolerance,
                             p.worst.padding_sequence, p.worst.padding_position};
  }
  return s;
}

namespace {

struct FiniteCensus {
  std::int64_t nan = 0;
  std::int64_t pos_inf = 0;
  std::int64_t neg_inf = 0;
  std::int64_t subnormal = 0;
  std::int64_t nonfinite() const { return nan + pos_inf + neg_inf; }
  // `value` is exactly representable in the dtype it was stored in, so no rounding is needed.
  void count(double value, double smallest_normal_value) {
    if (std::isnan(value)) {
      ++nan;
    } else if (std::isinf(value)) {
      ++(value > 0 ? pos_inf : neg_inf);
    } else if (value != 0.0 && std::fabs(value) < smallest_normal_value) {
      ++subnormal;
    }
  }
  void add(const FiniteCensus& o) {
    nan += o.nan;
    pos_inf += o.pos_inf;
    neg_inf += o.neg_inf;
    subnormal += o.subnormal;
  }
  nlohmann::json to_json() const {
    return {{"nan", nan}, {"pos_inf", pos_inf}, {"neg_inf", neg_inf}, {"subnormal", subnormal}};
  }
};

CheckResult make_result(const std::string& name, const ErrorStats& stats, Tolerance tol, std::string what) {
  CheckResult r;
  r.name = name;
  r.tolerance = tol;
  r.metrics = stats.to_json();
  r.worst = stats.worst();
  r.margin = stats.margin();
  r.verdict = stats.compared() == 0 ? Verdict::not_applicable
              : stats.mismatches() == 0 ? Verdict::pass
                                        : Verdict::fail;
  r.summary = std::move(what);
  return r;
}

// Element check of one gradient value against the reference, in effective units.
// ULP mode (16-bit outputs): the distance to the exact value in units of the dtype's spacing there,
// measured on the rank's own (local) value against reference / framework scale, or within the floor.
struct GradJudge {
  Tolerance tolerance;
  DType dtype;
  double framework_scale;
  double quantum;

  double judge(double got_local, double expected, double token_scale, bool& mismatch, std::int64_t& ulp) const {
    const double got = got_local * framework_scale;
    const double error = got == expected ? 0.0 : std::fabs(got - expected);
    const double floor = tolerance.atol * token_scale + quantum * framework_scale;
    if (tolerance.max_ulp > 0) {
      const double local_expected = expected / framework_scale;
      const double local_error = got_local == local_expected ? 0.0 : std::fabs(got_local - local_expected);
      const double spacing = ulp_size(local_expected, dtype);
      // A stored value closer than half a spacing is round(expected): distance 0, no need to count.
      ulp = local_error < 0.5 * spacing ? 0 : ulp_distance(got_local, local_expected, dtype);
      const double by_ulp = local_error / (tolerance.max_ulp * spacing);
      const double m = std::min(by_ulp, margin_of(error, floor));
      mismatch = !(m <= 1.0);
      return std::isnan(error) ? std::numeric_limits<double>::infinity() : m;
    }
    const double tol = floor + tolerance.rtol * std::fabs(expected);
    mismatch = !(error <= tol);
    return margin_of(error, tol);
  }
  double tolerance_at(double expected, double token_scale) const {
    return tolerance.atol * token_scale + quantum * framework_scale + tolerance.rtol * std::fabs(expected);
  }
};


// A loss a framework stored in 16 bits (torch's cross_entropy and Liger return the loss in the logits'
// dtype) is judged as 16-bit gradients are: within the dtype's max_ulp units of its spacing at the exact
// value, where a correctly rounded value is within half a unit; the float32 tolerance still applies when wider.
double stored_loss_tolerance(double float32_tolerance, double expected, DType stored) {
  if (stored == DType::fp32) return float32_tolerance;
  const int max_ulp = default_tolerance("grad", stored).tolerance.max_ulp;
  return std::max(float32_tolerance, max_ulp * ulp_size(expected, stored));
}

// A rank's rows x columns of inputs, kept in the input dtype (exact) between verification passes so
// they are generated once; widened to float64 on use.
class ShardCache {
 public:
  ShardCache(DType dtype, std::int64_t rows, std::int64_t cols)
      : dtype_(dtype), cols_(cols), bytes_(static_cast<std::size_t>(rows * cols) * dtype_size(dtype)) {}
  template <class Fill>
  void store(std::int64_t row, Fill fill) {
    dispatch_dtype(dtype_, [&](auto type) {
      using T = typename decltype(type)::type;
      fill(reinterpret_cast<T*>(bytes_.data()) + row * cols_);
    });
  }
  void widen(std::int64_t row, double* out) const {
    dispatch_dtype(dtype_, [&](auto type) {
      using T = typename decltype(type)::type;
      const T* in = reinterpret_cast<const T*>(bytes_.data()) + row * cols_;
      for (std::int64_t v = 0; v < cols_; ++v) out[v] = static_cast<double>(static_cast<float>(in[v]));
    });
  }

 private:
  DType dtype_;
  std::int64_t cols_;
  std::vector<std::byte> bytes_;
};

// All-gathers fixed-size values over a communicator, in rank order.
template <class T>
std::vector<T> gather_all(Communicator& comm, const T& mine) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<T> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&mine, all.data(), sizeof(T));
  return all;
}
template <class T>
std::vector<T> gather_all(Communicator& comm, const std::vector<T>& mine) {
  std::vector<T> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.all_gather(mine.data(), all.data(), mine.size() * sizeof(T));
  return all;
}

// gather_all, where a group of one needs no copy (a 16K-row shard's partials are 1 MB of fresh pages).
template <class T>
const std::vector<T>& gather_all(Communicator& comm, const std::vector<T>& mine, std::vector<T>& storage) {
  if (comm.size() == 1) return mine;
  storage = gather_all(comm, mine);
  return storage;
}

// Every rank's statistics merged in rank order: the same result on every rank and every backend.
ErrorStats merge_over(Communicator& world, const ErrorStats& local) {
  const std::vector<PackedStats> all = gather_all(world, local.pack());
  ErrorStats merged = ErrorStats::unpack(all[0]);
  for (std::size_t r = 1; r < all.size(); ++r) merged.merge(ErrorStats::unpack(all[r]));
  return merged;
}

}  // namespace

std::vector<CheckResult> verify_rank(const Case& c, const InputSource& inputs, const RankOutput& out,
                                     RankGroups& groups, Communicator& world, int threads, LayoutSnapshot* snapshot,
                                     ErrorMap* error_map, std::shared_ptr<cuda::OracleShard> gpu_oracle) {
  const std::int64_t n = c.shape.tokens;
  const std::int64_t vocab = c.shape.vocab;
  const bool kd = c.loss.kind == LossKind::kd;
  const int world_rank = out.assignment.world_rank;
  StageTrace trace("rank " + std::to_string(world_rank) + " verify");
  // The rank's progress beacon, captured here on the rank thread: the row loops beat it (OpenMP workers
  // included), so that the deadlock guard sees a rank that is verifying as busy, not hung.
  ProgressBeacon* const beacon = ProgressBeacon::current();
  trace.mark("0 reference");
  const LossReference reference(c, inputs);
  const VocabRange range = out.assignment.vocab;
  const std::int64_t rows = out.rows();
  const std::int64_t cols = range.size();
  const int tp_size = groups.tp.size();
  const bool tp_leader = groups.tp.rank() == 0;
  trace.mark("0 coverage");

  // Coverage: the TP group's columns tile [0, V); every token is held by exactly one TP group.
  {
    const std::int64_t mine[2] = {range.begin, range.end};
    std::vector<std::int64_t> all(static_cast<std::size_t>(2 * tp_size));
    groups.tp.all_gather(mine, all.data(), sizeof(mine));
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    for (int r = 0; r < tp_size; ++r) ranges.push_back({all[static_cast<std::size_t>(2 * r)], all[static_cast<std::size_t>(2 * r + 1)]});
    std::sort(ranges.begin(), ranges.end());
    std::int64_t next = 0;
    for (const auto& [b, e] : ranges) {
      if (b != next) throw InternalError("rank " + std::to_string(world_rank) + ": TP shards do not tile the vocabulary at column " + std::to_string(next));
      next = e;
    }
    if (next != vocab) throw InternalError("rank " + std::to_string(world_rank) + ": TP shards do not cover the vocabulary");
    std::vector<std::int64_t> holders(static_cast<std::size_t>(n), 0);
    if (tp_leader) {
      for (std::int64_t i = 0; i < rows; ++i) {
        if (out.token_of(i) >= 0) ++holders[static_cast<std::size_t>(out.token_of(i))];
      }
    }
    world.allreduce_sum(std::span<std::int64_t>(holders));
    for (std::int64_t t = 0; t < n; ++t) {
      if (holders[static_cast<std::size_t>(t)] != 1) {
        throw InternalError("token " + std::to_string(t) + " is held by " + std::to_string(holders[static_cast<std::size_t>(t)]) +
                            " TP groups, expected exactly one");
      }
    }
  }

  const Tolerance tol_loss = effective_tolerance(c, "loss");
  const Tolerance tol_agree = effective_tolerance(c, "rank_agreement");
  const Tolerance tol_row = effective_tolerance(c, "row_sum");
  const DType dtype = c.inputs.dtype;
  const double framework_scale = c.framework.gradient_scale(c.layout);
  const GradJudge judge{effective_tolerance(c, "grad"), dtype, framework_scale, output_quantum(dtype)};
  const double kd_power = c.loss.t2_scaling ? 2.0 : 0.0;
  const double loss_scale = kd ? std::pow(c.loss.temperature, kd_power) : 1.0;
  const double grad_scale = kd ? std::pow(c.loss.temperature, kd_power - 1.0) : 1.0;
  const bool row_sum_applies = c.loss.softcap == 0.0;

  trace.mark("1 partials");
  // 1. This rank's rows x columns, kept in the input dtype (exact), and the reference partials.
  // The per-row arrays of stages 1-3 (allocated together: on the GPU path after the comparison is queued,
  // while the GPU works, since first touching 2 MB of fresh pages is not free).
  std::vector<double> partials;
  std::vector<RowStats> stats;
  std::vector<double> reference_loss;
  // per row: compensated sum of the effective gradient (value, error), and the sum of magnitudes
  std::vector<double> row_sums;
  // per global token: this rank's largest gradient margin, then its loss margin (max-reduced below)
  std::vector<double> token_margins;
  auto allocate_row_arrays = [&] {
    partials.assign(static_cast<std::size_t>(rows * RowPartial::kDoubles), 0.0);
    stats.assign(static_cast<std::size_t>(rows), RowStats{});
    reference_loss.assign(static_cast<std::size_t>(rows), 0.0);
    row_sums.assign(static_cast<std::size_t>(3 * rows), 0.0);
    token_margins.assign(error_map != nullptr ? static_cast<std::size_t>(2 * n) : 0, 0.0);
  };
  std::vector<char> valid(static_cast<std::size_t>(rows), 0);
  // (Left empty when the shard stays on the GPU: the GPU reference reads it there.)
  const bool host_shard = out.device_shard == nullptr;
  ShardCache student_cache(dtype, host_shard ? rows : 0, cols);
  ShardCache teacher_cache(dtype, kd && host_shard ? rows : 0, cols);
  auto generate_row = [&](std::int64_t i) {
    const std::int64_t t = out.token_of(i);
    student_cache.store(i, [&](auto* row) { inputs.logits(t, range.begin, range.end, row); });
    if (kd) teacher_cache.store(i, [&](auto* row) { inputs.teacher_logits(t, range.begin, range.end, row); });
  };
  auto load_row = [&](std::int64_t i, std::vector<double>& student, std::vector<double>& teacher) {
    student_cache.widen(i, student.data());
    if (kd) teacher_cache.widen(i, teacher.data());
  };
  // On the GPU where the rank's gradient stayed there (the CUDA backend with the GPU reference), else here.
  // The GPU oracle generates its own copy of the inputs; it reads nothing of the rank but its gradient.
  const bool on_device = out.device_shard != nullptr;
  if (on_device && snapshot != nullptr) throw InternalError("the GPU reference keeps no snapshot for sweeps");
  std::shared_ptr<cuda::OracleShard> oracle = gpu_oracle;
  if (on_device && !oracle) oracle = cuda::make_oracle_shard(c, inputs, out.assignment, cuda::device_of(*out.device_shard));
  std::vector<std::int64_t> row_labels(on_device ? static_cast<std::size_t>(rows) : 0, -1);
  cuda::GpuCompareInputs compare_in;  // on_device: filled while the partials are computed
  compare_in.atol = judge.tolerance.atol;
  compare_in.rtol = judge.tolerance.rtol;
  compare_in.max_ulp = judge.tolerance.max_ulp;
  compare_in.framework_scale = framework_scale;
  compare_in.quantum = judge.quantum;
  compare_in.grad_scale = grad_scale;
  compare_in.smallest_normal = smallest_normal(out.dtype);
  // Whole rows of cross-entropy: the comparison takes each row's lse from the partials on the device, so
  // it is queued right behind them, and the host's combine (stage 2) runs while the GPU compares.
  const bool compare_early = on_device && tp_size == 1 && !kd;
  if (on_device) {
    std::vector<int> device_valid;
    cuda::reference_rows(c, inputs, out.assignment, row_labels, device_valid);
    std::copy(device_valid.begin(), device_valid.end(), valid.begin());
    trace.mark("1 partials: gpu");
    cuda::gpu_reference_partials_launch(*oracle, c, row_labels, device_valid);
    // While the GPU computes the partials: the comparison's per-row inputs that do not need them.
    trace.mark("1 partials: compare inputs");
    compare_in.kind.assign(static_cast<std::size_t>(rows), 1);
    compare_in.labels = row_labels;
    compare_in.lse.assign(static_cast<std::size_t>(rows), 0.0);
    compare_in.teacher_lse.assign(static_cast<std::size_t>(rows), 0.0);
    compare_in.weight.assign(static_cast<std::size_t>(rows), 0.0);
    for (std::int64_t i = 0; i < rows; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::int64_t t = out.token_of(i);
      if (t < 0) {
        compare_in.kind[k] = 2;
      } else if (valid[k]) {
        compare_in.kind[k] = 0;
        compare_in.weight[k] = reference.token_weight(t);
      }
    }
    if (compare_early) {
      trace.mark("1 partials: compare launch");
      cuda::gpu_reference_compare_launch(*oracle, *out.device_shard, c, compare_in, true);
    }
    trace.mark("1 partials: row arrays");
    allocate_row_arrays();
    trace.mark("1 partials: wait");
    cuda::gpu_reference_partials_wait(*oracle, partials);
  } else {
    allocate_row_arrays();
#pragma omp parallel num_threads(threads)
    {
      std::vector<double> student(static_cast<std::size_t>(cols));
      std::vector<double> teacher(kd ? static_cast<std::size_t>(cols) : 0);
  #pragma omp for schedule(dynamic, 4)
      for (std::int64_t i = 0; i < rows; ++i) {
        beat_row(beacon, i);
        const std::int64_t t = out.token_of(i);
        if (t < 0 || !inputs.is_valid(t)) continue;
        valid[static_cast<std::size_t>(i)] = 1;
        generate_row(i);
        load_row(i, student, teacher);
        const RowPartial p = reference.partial(t, range.begin, student, teacher);
        p.store(&partials[static_cast<std::size_t>(i * RowPartial::kDoubles)]);
      }
    }
  }
  trace.mark("2 combine");
  // 2. Row statistics: the TP group's partials combined in column order.
  std::vector<double> gathered_partials;
  const std::vector<double>& all_partials = gather_all(groups.tp, partials, gathered_partials);
  trace.mark("2 combine: rows");
  std::vector<RowPartial> row_parts(static_cast<std::size_t>(tp_size));
  for (std::int64_t i = 0; i < rows; ++i) {
    if (!valid[static_cast<std::size_t>(i)]) continue;
    for (int r = 0; r < tp_size; ++r) {
      row_parts[static_cast<std::size_t>(r)] =
          RowPartial::load(&all_partials[static_cast<std::size_t>((r * rows + i) * RowPartial::kDoubles)]);
    }
    stats[static_cast<std::size_t>(i)] = reference.combine(row_parts);
  }
  trace.mark("2 combine: losses");

  if (kd) {
    std::vector<double> kl(static_cast<std::size_t>(2 * rows), 0.0);
    if (on_device) {
      std::vector<double> lse(static_cast<std::size_t>(rows), 0.0), teacher_lse(static_cast<std::size_t>(rows), 0.0);
      std::vector<int> device_valid(static_cast<std::size_t>(rows), 0);
      for (std::int64_t i = 0; i < rows; ++i) {
        const auto k = static_cast<std::size_t>(i);
        device_valid[k] = valid[k];
        lse[k] = stats[k].lse;
        teacher_lse[k] = stats[k].teacher_lse;
      }
      kl = cuda::gpu_reference_kl(*oracle, c, lse, teacher_lse, device_valid);
    } else
#pragma omp parallel num_threads(threads)
    {
      std::vector<double> student(static_cast<std::size_t>(cols));
      std::vector<double> teacher(static_cast<std::size_t>(cols));
#pragma omp for schedule(dynamic, 4)
      for (std::int64_t i = 0; i < rows; ++i) {
        beat_row(beacon, i);
        if (!valid[static_cast<std::size_t>(i)]) continue;
        load_row(i, student, teacher);
        const auto [sum, error] = reference.kl_partial(stats[static_cast<std::size_t>(i)], student, teacher);
        kl[static_cast<std::size_t>(2 * i)] = sum;
        kl[static_cast<std::size_t>(2 * i + 1)] = error;
      }
    }
    const std::vector<double> all_kl = gather_all(groups.tp, kl);
    for (std::int64_t i = 0; i < rows; ++i) {
      if (!valid[static_cast<std::size_t>(i)]) continue;
      CompensatedSum total;
      for (int r = 0; r < tp_size; ++r) {
        total.add(all_kl[static_cast<std::size_t>(r * 2 * rows + 2 * i)]);
        total.add(all_kl[static_cast<std::size_t>(r * 2 * rows + 2 * i + 1)]);
      }
      reference_loss[static_cast<std::size_t>(i)] = reference.kd_loss(total.value());
    }
  } else {
    for (std::int64_t i = 0; i < rows; ++i) {
      if (valid[static_cast<std::size_t>(i)]) {
        reference_loss[static_cast<std::size_t>(i)] = reference.cross_entropy_loss(stats[static_cast<std::size_t>(i)]);
      }
    }
  }

  if (on_device && !compare_early) {
    // The comparison runs on the GPU while the host computes the logged loss (stage 5).
    trace.mark("2 compare launch");
    cuda::GpuCompareInputs& in = compare_in;
    for (std::int64_t i = 0; i < rows; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (in.kind[k] == 0) {
        in.lse[k] = stats[k].lse;
        in.teacher_lse[k] = stats[k].teacher_lse;
      }
    }
    cuda::gpu_reference_compare_launch(*oracle, *out.device_shard, c, in, false);
  }

  trace.mark("5 logged");
  // 5. The reference's logged loss: every token's reference loss, summed in token order on every rank.
  std::vector<double> token_losses(static_cast<std::size_t>(n), 0.0);
  if (tp_leader) {
    for (std::int64_t i = 0; i < rows; ++i) {
      if (out.token_of(i) >= 0) token_losses[static_cast<std::size_t>(out.token_of(i))] = reference_loss[static_cast<std::size_t>(i)];
    }
  }
  world.allreduce_sum(std::span<double>(token_losses));  // one nonzero term per token: exact
  const double reference_reduced = c.loss.reduction != Reduction::none ? reference.reduced_loss(token_losses) : 0.0;
  ErrorStats reduced_local;
  const Tolerance tol_reduced = effective_tolerance(c, "reduced_loss");
  if (c.loss.reduction != Reduction::none) {
    // The absolute floor scales with sum_t |w_t|: 1 for mean, N_v for sum.
    const double weight_total = c.loss.reduction == Reduction::mean ? 1.0 : static_cast<double>(reference.valid_tokens());
    reduced_local.add({-1, -1, world_rank, reference_reduced, out.reduced_loss,
                       stored_loss_tolerance(tol_reduced.atol * loss_scale * std::max(weight_total, 1.0) +
                                                 tol_reduced.rtol * std::fabs(reference_reduced),
                                             reference_reduced, out.reduced_loss_dtype)});
  }
  ErrorStats stats_local;
  stats_local.add({-1, -1, world_rank, static_cast<double>(reference.valid_tokens()),
                   static_cast<double>(out.logged_valid_tokens), 0.5});

  trace.mark("3 elements");
  // 3. Every element of this rank against the reference.
  ErrorStats loss_stats;
  ErrorStats grad_stats;
  std::int64_t grad_mismatches = 0;
  const bool keep_grads = snapshot != nullptr && n * vocab <= kSnapshotElementLimit;
  std::span<const cuda::RowComparison> compared_rows;
  std::int64_t grad_lookups = 0;  // GPU reference: elements judged by a code-table lookup
  // A row's loss against the reference, into `into`: CP padding must be exactly zero, a token within its
  // tolerance (its margin also goes to the error map).
  auto judge_row_loss = [&](std::int64_t i, ErrorStats& into) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = out.token_of(i);
    const double got_loss = out.token_loss[k];
    if (t < 0) {
      const LocalRow& row = out.assignment.rows[k];
      into.add({-1, -1, world_rank, 0.0, got_loss, 0.0, row.sequence, row.position});
      return;
    }
    const double ref_loss = reference_loss[k];
    const double loss_tolerance = stored_loss_tolerance(
        tol_loss.atol * loss_scale + tol_loss.rtol * std::fabs(ref_loss), ref_loss, out.token_loss_dtype);
    into.add({t, -1, world_rank, ref_loss, got_loss, loss_tolerance});
    if (!token_margins.empty()) {
      token_margins[static_cast<std::size_t>(n + t)] = margin_of(got_loss == ref_loss ? 0.0 : std::fabs(got_loss - ref_loss), loss_tolerance);
    }
  };
  if (on_device) {
    // The losses first: they do not need the comparison, which the GPU may still be running.
    trace.mark("3 elements: losses");
    for (std::int64_t i = 0; i < rows; ++i) judge_row_loss(i, loss_stats);
    trace.mark("3 elements: wait");
    compared_rows = cuda::gpu_reference_compare_wait(*oracle);
    trace.mark("3 elements: rows");
    for (std::int64_t i = 0; i < rows; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::int64_t t = out.token_of(i);
      const LocalRow& row = out.assignment.rows[k];
      const cuda::RowComparison& rc = compared_rows[k];
      PackedStats packed{};
      packed.compared = rc.compared;
      packed.mismatches = rc.mismatches;
      packed.max_ulp = rc.max_ulp;
      packed.has_worst = rc.compared > 0;
      packed.max_abs = rc.max_abs;
      packed.max_rel = rc.max_rel;
      packed.margin = rc.margin;
      packed.worst = {t, range.begin + rc.worst_column, world_rank, t < 0 ? row.sequence : -1, t < 0 ? row.position : -1,
                      rc.worst_expected, rc.worst_got, rc.worst_tolerance};
      grad_stats.merge(ErrorStats::unpack(packed));
      grad_mismatches += rc.mismatches;
      grad_lookups += rc.lookups;
      if (t < 0) continue;
      row_sums[3 * k] = rc.sum;
      row_sums[3 * k + 1] = rc.sum_error;
      row_sums[3 * k + 2] = rc.magnitude;
      if (!token_margins.empty()) token_margins[static_cast<std::size_t>(t)] = rc.margin;
    }
  } else
#pragma omp parallel num_threads(threads)
  {
    ErrorStats local_loss;
    ErrorStats local_grad;
    std::int64_t local_mismatches = 0;
    std::vector<double> student(static_cast<std::size_t>(cols));
    std::vector<double> teacher(kd ? static_cast<std::size_t>(cols) : 0);
    std::vector<double> expected(static_cast<std::size_t>(cols));
    std::vector<double> got(static_cast<std::size_t>(cols));
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t i = 0; i < rows; ++i) {
      beat_row(beacon, i);
      const auto k = static_cast<std::size_t>(i);
      const std::int64_t t = out.token_of(i);
      const LocalRow& row = out.assignment.rows[k];
      const double got_loss = out.token_loss[k];
      out.grad_row(i, got.data());
      judge_row_loss(i, local_loss);
      if (t < 0) {
        // CP padding: masked, so zero loss and an exactly zero gradient.
        for (std::int64_t v = 0; v < cols; ++v) {
          const double g = got[static_cast<std::size_t>(v)] * framework_scale;
          const bool mismatch = g != 0.0;
          local_mismatches += mismatch;
          local_grad.add_with_margin({-1, range.begin + v, world_rank, 0.0, g, 0.0, row.sequence, row.position},
                                     mismatch ? std::numeric_limits<double>::infinity() : 0.0, mismatch);
        }
        continue;
      }
      double row_margin = 0.0;
      const double weight = valid[k] ? reference.token_weight(t) : 0.0;
      if (valid[k]) {
        load_row(i, student, teacher);
        reference.gradient(t, stats[k], range.begin, student, teacher, expected);
      } else {
        std::fill(expected.begin(), expected.end(), 0.0);
      }
      const double token_scale = std::fabs(weight) * grad_scale;
      CompensatedSum sum;
      CompensatedSum magnitude;
      for (std::int64_t v = 0; v < cols; ++v) {
        const double got_local = got[static_cast<std::size_t>(v)];
        const double e = expected[static_cast<std::size_t>(v)];
        bool mismatch = false;
        std::int64_t ulp = 0;
        const double m = judge.judge(got_local, e, token_scale, mismatch, ulp);
        local_mismatches += mismatch;
        const double g = got_local * framework_scale;
        local_grad.add_with_margin({t, range.begin + v, world_rank, e, g, judge.tolerance_at(e, token_scale)}, m, mismatch);
        local_grad.add_ulp(ulp);
        if (!(m <= row_margin)) row_margin = m;  // NaN margins count as the worst
        sum.add(g);
        magnitude.add(std::fabs(g));
        if (keep_grads) snapshot->effective_grad[static_cast<std::size_t>(t * vocab + range.begin + v)] = static_cast<float>(g);
      }
      row_sums[3 * k] = sum.sum();
      row_sums[3 * k + 1] = sum.error();
      row_sums[3 * k + 2] = magnitude.value();
      if (!token_margins.empty()) {
        token_margins[static_cast<std::size_t>(t)] = std::isnan(row_margin) ? std::numeric_limits<double>::infinity() : row_margin;
      }
      if (snapshot != nullptr && tp_leader) snapshot->token_loss[static_cast<std::size_t>(t)] = static_cast<float>(got_loss);
    }
#pragma omp critical(lossverify_verify_merge)
    {
      loss_stats.merge(local_loss);
      grad_stats.merge(local_grad);
      grad_mismatches += local_mismatches;
    }
  }

  trace.mark("4 tp checks");
  // 4. Across the TP group: rank agreement and the row-sum invariant, judged by the TP leader.
  ErrorStats agreement_stats;
  ErrorStats row_sum_stats;
  {
    std::vector<double> gathered_sums;
    std::vector<float> gathered_losses;
    const std::vector<double>& all_sums = gather_all(groups.tp, row_sums, gathered_sums);
    const std::vector<float>& all_losses = gather_all(groups.tp, out.token_loss, gathered_losses);
    const std::vector<int> tp_world = gather_all(groups.tp, world_rank);  // collective: every TP rank calls it
    if (tp_leader) {
      for (std::int64_t i = 0; i < rows; ++i) {
        const auto k = static_cast<std::size_t>(i);
        const std::int64_t t = out.token_of(i);
        if (t < 0) continue;
        const double first = all_losses[k];
        for (int r = 1; r < tp_size; ++r) {
          agreement_stats.add({t, -1, tp_world[static_cast<std::size_t>(r)], first,
                               all_losses[static_cast<std::size_t>(r * rows + i)],
                               tol_agree.atol * loss_scale + tol_agree.rtol * std::fabs(first)});
        }
        if (!row_sum_applies) continue;
        CompensatedSum total;
        CompensatedSum magnitude;
        for (int r = 0; r < tp_size; ++r) {
          total.add(all_sums[static_cast<std::size_t>(r * 3 * rows + 3 * i)]);
          total.add(all_sums[static_cast<std::size_t>(r * 3 * rows + 3 * i + 1)]);
          magnitude.add(all_sums[static_cast<std::size_t>(r * 3 * rows + 3 * i + 2)]);
        }
        // docs/spec.md §3 invariant: sum_v dl/dx_v = 2 w_z lse per token (0 for KD), times the token's weight in L.
        const double weight = valid[k] ? reference.token_weight(t) : 0.0;
        const double expected_sum = (valid[k] && !kd) ? weight * 2.0 * c.loss.z_loss_weight * stats[k].lse : 0.0;
        row_sum_stats.add({t, -1, world_rank, expected_sum, total.value(),
                           tol_row.atol * std::fabs(weight) * grad_scale + tol_row.rtol * magnitude.value() +
                               judge.quantum * framework_scale});
      }
    }
  }

  trace.mark("6 census");
  // 6. The finite census of this rank.
  FiniteCensus grad_census;
  FiniteCensus loss_census;
  FiniteCensus reduced_census;
  std::optional<ElementRecord> first_bad;
  {
    const double grad_normal = smallest_normal(out.dtype);
    const double fp32_normal = smallest_normal(DType::fp32);
    std::vector<double> g(on_device ? 0 : static_cast<std::size_t>(cols));
    for (std::int64_t i = 0; i < rows; ++i) {
      beat_row(beacon, i);
      if (on_device) {
        const cuda::RowComparison& rc = compared_rows[static_cast<std::size_t>(i)];
        grad_census.add(FiniteCensus{rc.nan, rc.pos_inf, rc.neg_inf, rc.subnormal});
        if (rc.first_bad_column >= 0 && !first_bad) {
          first_bad = ElementRecord{out.token_of(i), range.begin + rc.first_bad_column, world_rank, 0.0, rc.first_bad_value, 0.0};
        }
      } else {
        out.grad_row(i, g.data());
      }
      for (std::int64_t v = 0; v < (on_device ? 0 : cols); ++v) {
        grad_census.count(g[static_cast<std::size_t>(v)], grad_normal);
        if (!std::isfinite(g[static_cast<std::size_t>(v)]) && !first_bad) {
          first_bad = ElementRecord{out.token_of(i), range.begin + v, world_rank, 0.0, g[static_cast<std::size_t>(v)], 0.0};
        }
      }
      const double l = out.token_loss[static_cast<std::size_t>(i)];
      loss_census.count(l, fp32_normal);
      if (!std::isfinite(l) && !first_bad) first_bad = ElementRecord{out.token_of(i), -1, world_rank, 0.0, l, 0.0};
    }
    if (out.has_reduced_loss) reduced_census.count(out.reduced_loss, fp32_normal);
  }

  trace.mark("7 merge");
  // 7. Merge over the world, in rank order.
  const ErrorStats loss_all = merge_over(world, loss_stats);
  const ErrorStats reduced_all = merge_over(world, reduced_local);
  const ErrorStats grad_all = merge_over(world, grad_stats);
  const ErrorStats agreement_all = merge_over(world, agreement_stats);
  const ErrorStats row_sum_all = merge_over(world, row_sum_stats);
  const ErrorStats stats_all = merge_over(world, stats_local);
  const std::vector<std::int64_t> mismatches_per_rank = gather_all(world, grad_mismatches);
  // (on_device is the same on every rank: one backend and one reference per run)
  const std::vector<std::int64_t> lookups_per_rank = on_device ? gather_all(world, grad_lookups) : std::vector<std::int64_t>{};
  struct CensusRecord {
    std::int64_t rank;
    std::int64_t values[12];
    std::int64_t has_bad;
    PackedElement bad;
  };
  CensusRecord mine{};
  mine.rank = world_rank;
  const FiniteCensus* parts[3] = {&grad_census, &loss_census, &reduced_census};
  for (int j = 0; j < 3; ++j) {
    mine.values[4 * j] = parts[j]->nan;
    mine.values[4 * j + 1] = parts[j]->pos_inf;
    mine.values[4 * j + 2] = parts[j]->neg_inf;
    mine.values[4 * j + 3] = parts[j]->subnormal;
  }
  if (first_bad) {
    mine.has_bad = 1;
    mine.bad = {first_bad->token, first_bad->column, first_bad->rank, -1, -1, 0.0, first_bad->got, 0.0};
  }
  const std::vector<CensusRecord> censuses = gather_all(world, mine);

  std::vector<CheckResult> results;
  {
    ErrorStats both = loss_all;
    both.merge(reduced_all);
    CheckResult r = make_result("loss", both, tol_loss, "per-token and logged losses vs the float64 reference");
    r.metrics = {{"per_token", loss_all.to_json()}, {"margin", both.margin()}};
    if (c.loss.reduction != Reduction::none) {
      r.metrics["reduced"] = reduced_all.to_json();
      r.metrics["reduced"]["expected"] = reference_reduced;
      r.metrics["reduced"]["tolerance"] = {{"atol", tol_reduced.atol}, {"rtol", tol_reduced.rtol}};
    }
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("grad", grad_all, judge.tolerance, "effective gradient vs the float64 reference");
    if (dtype != DType::fp32) r.metrics["max_ulp"] = grad_all.max_ulp();
    r.metrics["framework_scale"] = framework_scale;
    nlohmann::json per_rank = nlohmann::json::array();
    for (std::size_t k = 0; k < mismatches_per_rank.size(); ++k) {
      per_rank.push_back({{"rank", static_cast<int>(k)}, {"mismatches", mismatches_per_rank[k]}});
    }
    r.metrics["mismatches_per_rank"] = per_rank;
    if (on_device) {
      std::int64_t lookups = 0;
      for (const std::int64_t l : lookups_per_rank) lookups += l;
      r.metrics["judged_by_lookup"] = lookups;
    }
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("rank_agreement", agreement_all, tol_agree, "TP ranks of each token report the same loss");
    if (r.verdict == Verdict::not_applicable) r.summary = "one TP rank per token: nothing to compare";
    results.push_back(std::move(r));
  }
  {
    CheckResult r;
    r.name = "finite";
    FiniteCensus grad_total;
    FiniteCensus loss_total;
    nlohmann::json per_rank = nlohmann::json::array();
    for (const CensusRecord& cr : censuses) {
      FiniteCensus f[3];
      for (int j = 0; j < 3; ++j) {
        f[j] = FiniteCensus{cr.values[4 * j], cr.values[4 * j + 1], cr.values[4 * j + 2], cr.values[4 * j + 3]};
      }
      grad_total.add(f[0]);
      loss_total.add(f[1]);
      loss_total.add(f[2]);
      if (f[0].nonfinite() + f[0].subnormal + f[1].nonfinite() + f[1].subnormal + f[2].nonfinite() > 0) {
        per_rank.push_back({{"rank", cr.rank}, {"grad", f[0].to_json()}, {"token_loss", f[1].to_json()},
                            {"reduced_loss", f[2].to_json()}});
      }
      if (cr.has_bad && !r.worst) {
        r.worst = ElementRecord{cr.bad.token, cr.bad.column, static_cast<int>(cr.bad.rank), 0.0, cr.bad.got, 0.0};
      }
    }
    const std::int64_t bad = grad_total.nonfinite() + loss_total.nonfinite();
    r.metrics = {{"nonfinite", bad}, {"grad", grad_total.to_json()}, {"loss", loss_total.to_json()}, {"per_rank", per_rank}};
    r.verdict = bad == 0 ? Verdict::pass : Verdict::fail;
    r.margin = bad == 0 ? 0.0 : std::numeric_limits<double>::infinity();
    r.summary = bad == 0 ? "no NaN or Inf in any rank's outputs"
                         : std::to_string(bad) + " non-finite values (the reference is finite everywhere)";
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("row_sum", row_sum_all, tol_row, "sum_v grad = w_t 2 w_z lse for every token");
    if (!row_sum_applies) r.summary = "softcap changes the invariant: not applicable";
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("stats", stats_all, Tolerance{0.5, 0.0, 0}, "logged valid-token count vs the global count");
    r.metrics["expected_valid_tokens"] = reference.valid_tokens();
    results.push_back(std::move(r));
  }
  if (error_map != nullptr) {
    // (With one rank its margins are already the maxima.)
    if (world.size() > 1) world.allreduce_max(std::span<double>(token_margins));
    error_map->token_loss_margin.assign(token_margins.begin() + n, token_margins.end());
    token_margins.resize(static_cast<std::size_t>(n));
    error_map->token_grad_margin = std::move(token_margins);
    RankErrorCell cell;
    cell.rank = world_rank;
    cell.tp = out.assignment.coordinates.tp;
    cell.cp = out.assignment.coordinates.cp;
    cell.dp = out.assignment.coordinates.dp;
    cell.vocab_begin = range.begin;
    cell.vocab_end = range.end;
    cell.loss_margin = loss_stats.margin();
    cell.grad_margin = grad_stats.margin();
    cell.grad_mismatches = grad_mismatches;
    error_map->ranks = gather_all(world, cell);
  }
  if (snapshot != nullptr && world.rank() == 0) {
    snapshot->logged_loss = out.reduced_loss;
    snapshot->logged_valid_tokens = out.logged_valid_tokens;
  }
  return results;
}

namespace {

// One layout's answers against the first layout's, element by element; "token scale" here is the largest
// gradient magnitude of the row.
ErrorStats compare_layouts(const Case& c, const Tolerance& tol, const LayoutSnapshot& base,
                           const LayoutSnapshot& other, int k) {
  const DType dtype = c.inputs.dtype;
  const double quantum = output_quantum(dtype);
  ErrorStats stats;
  for (std::size_t t = 0; t < base.token_loss.size(); ++t) {
    const double e = base.token_loss[t];
    stats.add({static_cast<std::int64_t>(t), -1, k, e, other.token_loss[t], 1e-5 + 2e-5 * std::fabs(e)});
  }
  stats.add({-1, -1, k, base.logged_loss, other.logged_loss, 1e-5 + 4e-5 * std::fabs(base.logged_loss)});
  stats.add({-1, -1, k, static_cast<double>(base.logged_valid_tokens), static_cast<double>(other.logged_valid_tokens),
             0.5});
  if (base.effective_grad.empty() || other.effective_grad.empty()) return stats;
  const std::size_t vocab = static_cast<std::size_t>(c.shape.vocab);
  for (std::size_t t = 0; t < base.token_loss.size(); ++t) {
    double row_scale = 0.0;
    for (std::size_t v = 0; v < vocab; ++v) row_scale = std::max(row_scale, std::fabs(double(base.effective_grad[t * vocab + v])));
    for (std::size_t v = 0; v < vocab; ++v) {
      const double e = base.effective_grad[t * vocab + v];
      const double g = other.effective_grad[t * vocab + v];
      const double error = e == g ? 0.0 : std::fabs(g - e);
      const double floor = tol.atol * row_scale + quantum;
      const double m = tol.max_ulp > 0 ? std::min(error / (tol.max_ulp * ulp_size(e, dtype)), margin_of(error, floor))
                                       : margin_of(error, floor + tol.rtol * std::fabs(e));
      stats.add_with_margin({static_cast<std::int64_t>(t), static_cast<std::int64_t>(v), k, e, g, floor}, m, !(m <= 1.0));
    }
  }
  return stats;
}

}  // namespace

InvarianceCheck::InvarianceCheck(const Case& c) : case_(c), tolerance_(effective_tolerance(c, "invariance")) {}

void InvarianceCheck::add(LayoutSnapshot snapshot, const std::string& layout_name) {
  if (!base_) {
    base_ = std::move(snapshot);
    base_name_ = layout_name;
    gradients_compared_ = !base_->effective_grad.empty();
    return;
  }
  ++layouts_;
  const ErrorStats stats = compare_layouts(case_, tolerance_, *base_, snapshot, layouts_);
  gradients_compared_ = gradients_compared_ && !snapshot.effective_grad.empty();
  per_layout_.push_back({{"layout", layout_name}, {"against", base_name_}, {"margin", stats.margin()},
                         {"mismatches", stats.mismatches()}});
  stats_.merge(stats);
}

CheckResult InvarianceCheck::result() const {
  if (!base_) return make_result("invariance", stats_, tolerance_, "no layouts");
  CheckResult r = make_result("invariance", stats_, tolerance_,
                              "every layout reproduces the first layout's losses, logged values and gradients");
  r.metrics["layouts"] = per_layout_;
  r.metrics["gradients_compared"] = gradients_compared_;
  if (r.verdict == Verdict::not_applicable) r.summary = "a single layout: nothing to compare";
  return r;
}

CheckResult invariance_check(const Case& c, const std::vector<LayoutSnapshot>& snapshots,
                             const std::vector<std::string>& layout_names) {
  InvarianceCheck check(c);
  for (std::size_t k = 0; k < snapshots.size(); ++k) check.add(snapshots[k], layout_names[k]);
  return check.result();
}

}  // namespace lossverify
