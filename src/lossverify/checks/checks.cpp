#include "lossverify/checks/checks.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "lossverify/checks/tolerances.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/loss_reference.hpp"

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
  ++compared_;
  // Equal values (both +inf included) agree; inf against a finite value is an infinite error.
  const double error = r.got == r.expected ? 0.0 : std::fabs(r.got - r.expected);
  const double m = margin_of(error, r.tolerance);
  if (!(error <= r.tolerance)) ++mismatches_;  // NaN counts as a mismatch
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

namespace {

struct Holder {
  int rank_index;
  std::int64_t row;
};

// Per-thread accumulators of the streamed checks.
struct StreamStats {
  ErrorStats loss;
  ErrorStats grad;
  ErrorStats agreement;
  ErrorStats row_sum;
  std::vector<std::int64_t> grad_mismatches_per_rank;
};

struct FiniteCensus {
  std::int64_t nan = 0;
  std::int64_t pos_inf = 0;
  std::int64_t neg_inf = 0;
  std::int64_t subnormal = 0;
  std::int64_t nonfinite() const { return nan + pos_inf + neg_inf; }
  // `value` is exactly representable in `dtype` (a stored output), so no rounding is needed.
  void count(double value, double smallest_normal_value) {
    if (std::isnan(value)) {
      ++nan;
    } else if (std::isinf(value)) {
      ++(value > 0 ? pos_inf : neg_inf);
    } else if (value != 0.0 && std::fabs(value) < smallest_normal_value) {
      ++subnormal;
    }
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

CheckResult finite_check(const std::vector<RankOutput>& ranks, int threads) {
  CheckResult r;
  r.name = "finite";
  nlohmann::json per_rank = nlohmann::json::array();
  FiniteCensus total_grad;
  FiniteCensus total_loss;
  std::optional<ElementRecord> first;
  const double fp32_normal = smallest_normal(DType::fp32);
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const RankOutput& out = ranks[k];
    const double grad_normal = smallest_normal(out.dtype);
    FiniteCensus grad;
    FiniteCensus loss;
    // Rows in parallel; the first non-finite element is the one with the lowest row, then column.
    std::int64_t first_row = out.rows();
    std::int64_t first_column = 0;
#pragma omp parallel num_threads(threads)
    {
      FiniteCensus local;
      std::int64_t local_row = out.rows();
      std::int64_t local_column = 0;
      std::vector<double> row(static_cast<std::size_t>(out.columns()));
#pragma omp for schedule(static)
      for (std::int64_t i = 0; i < out.rows(); ++i) {
        out.grad_row(i, row.data());
        for (std::int64_t v = 0; v < out.columns(); ++v) {
          const double g = row[static_cast<std::size_t>(v)];
          local.count(g, grad_normal);
          if (!std::isfinite(g) && i < local_row) {
            local_row = i;
            local_column = v;
          }
        }
      }
#pragma omp critical(lossverify_finite)
      {
        grad.nan += local.nan;
        grad.pos_inf += local.pos_inf;
        grad.neg_inf += local.neg_inf;
        grad.subnormal += local.subnormal;
        if (local_row < first_row) {
          first_row = local_row;
          first_column = local_column;
        }
      }
    }
    if (!first && first_row < out.rows()) {
      first = ElementRecord{out.token_of(first_row), out.assignment.vocab.begin + first_column,
                            out.assignment.world_rank, 0.0, out.grad_at(first_row, out.assignment.vocab.begin + first_column),
                            0.0};
    }
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      const double l = out.token_loss[static_cast<std::size_t>(i)];
      loss.count(l, fp32_normal);
      if (!std::isfinite(l) && !first) first = ElementRecord{out.token_of(i), -1, out.assignment.world_rank, 0.0, l, 0.0};
    }
    FiniteCensus reduced;
    if (out.has_reduced_loss) reduced.count(out.reduced_loss, fp32_normal);
    auto census = [](const FiniteCensus& f) {
      return nlohmann::json{{"nan", f.nan}, {"pos_inf", f.pos_inf}, {"neg_inf", f.neg_inf}, {"subnormal", f.subnormal}};
    };
    if (grad.nonfinite() + grad.subnormal + loss.nonfinite() + loss.subnormal + reduced.nonfinite() > 0) {
      per_rank.push_back({{"rank", out.assignment.world_rank},
                          {"grad", census(grad)},
                          {"token_loss", census(loss)},
                          {"reduced_loss", census(reduced)}});
    }
    total_grad.nan += grad.nan;
    total_grad.pos_inf += grad.pos_inf;
    total_grad.neg_inf += grad.neg_inf;
    total_grad.subnormal += grad.subnormal;
    total_loss.nan += loss.nan + reduced.nan;
    total_loss.pos_inf += loss.pos_inf + reduced.pos_inf;
    total_loss.neg_inf += loss.neg_inf + reduced.neg_inf;
    total_loss.subnormal += loss.subnormal;
  }
  const std::int64_t bad = total_grad.nonfinite() + total_loss.nonfinite();
  r.metrics = {{"nonfinite", bad},
               {"grad", {{"nan", total_grad.nan}, {"pos_inf", total_grad.pos_inf}, {"neg_inf", total_grad.neg_inf},
                         {"subnormal", total_grad.subnormal}}},
               {"loss", {{"nan", total_loss.nan}, {"pos_inf", total_loss.pos_inf}, {"neg_inf", total_loss.neg_inf},
                         {"subnormal", total_loss.subnormal}}},
               {"per_rank", per_rank}};
  r.verdict = bad == 0 ? Verdict::pass : Verdict::fail;
  r.margin = bad == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  r.worst = first;
  r.summary = bad == 0 ? "no NaN or Inf in any rank's outputs"
                       : std::to_string(bad) + " non-finite values (the reference is finite everywhere)";
  return r;
}

}  // namespace

namespace {

// Element check of one gradient value against the reference, in effective units.
// ULP mode (16-bit outputs): within max_ulp of round(reference) in the output dtype, measured on the
// rank's own (local) value against reference / framework scale, or within the absolute floor.
struct GradJudge {
  Tolerance tolerance;
  DType dtype;
  double framework_scale;
  double quantum;

  // Returns the margin; sets mismatch.
  double judge(double got_local, double expected, double token_scale, bool& mismatch, std::int64_t& ulp) const {
    const double got = got_local * framework_scale;
    const double error = got == expected ? 0.0 : std::fabs(got - expected);
    const double floor = tolerance.atol * token_scale + quantum * framework_scale;
    if (tolerance.max_ulp > 0) {
      // Real-valued distance in units of the dtype's spacing at the exact value: a correctly rounded
      // output is within 0.5, a misrounded one within 1.
      const double local_expected = expected / framework_scale;
      const double local_error = got_local == local_expected ? 0.0 : std::fabs(got_local - local_expected);
      const double spacing = ulp_size(local_expected, dtype);
      // A stored value closer than half a spacing is round(expected): distance 0, no need to count.
      ulp = local_error < 0.5 * spacing ? 0 : ulp_distance(got_local, local_expected, dtype);
      const double by_ulp = local_error / (tolerance.max_ulp * spacing);
      const double by_floor = margin_of(error, floor);
      const double m = std::min(by_ulp, by_floor);
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

constexpr std::int64_t kSnapshotElementLimit = std::int64_t{1} << 25;

}  // namespace

std::vector<CheckResult> verify(const Case& c, const InputSource& inputs, const std::vector<RankOutput>& ranks,
                                int threads, LayoutSnapshot* snapshot) {
  const std::int64_t n = c.shape.tokens;
  const std::int64_t vocab = c.shape.vocab;
  const LossReference reference(c, inputs);
  const bool kd = c.loss.kind == LossKind::kd;

  // Which ranks hold each token, and a coverage check: the holders' columns must tile [0, V) exactly.
  std::vector<std::vector<Holder>> holders(static_cast<std::size_t>(n));
  std::vector<Holder> padding_rows;
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    for (std::int64_t i = 0; i < ranks[k].rows(); ++i) {
      const std::int64_t t = ranks[k].token_of(i);
      if (t < 0) {
        padding_rows.push_back({static_cast<int>(k), i});
      } else {
        holders[static_cast<std::size_t>(t)].push_back({static_cast<int>(k), i});
      }
    }
  }
  for (std::int64_t t = 0; t < n; ++t) {
    auto& h = holders[static_cast<std::size_t>(t)];
    std::sort(h.begin(), h.end(), [&](const Holder& a, const Holder& b) {
      return ranks[static_cast<std::size_t>(a.rank_index)].assignment.vocab.begin <
             ranks[static_cast<std::size_t>(b.rank_index)].assignment.vocab.begin;
    });
    std::int64_t next = 0;
    for (const Holder& x : h) {
      const VocabRange r = ranks[static_cast<std::size_t>(x.rank_index)].assignment.vocab;
      if (r.begin != next) {
        throw InternalError("token " + std::to_string(t) + ": rank shards do not tile the vocabulary at column " +
                            std::to_string(next));
      }
      next = r.end;
    }
    if (next != vocab) throw InternalError("token " + std::to_string(t) + ": vocabulary not covered");
  }

  const Tolerance tol_loss = effective_tolerance(c, "loss");
  const Tolerance tol_agree = effective_tolerance(c, "rank_agreement");
  const Tolerance tol_row = effective_tolerance(c, "row_sum");
  const DType dtype = c.inputs.dtype;
  const double framework_scale = c.framework.gradient_scale(c.layout);
  const GradJudge judge{effective_tolerance(c, "grad"), dtype, framework_scale, output_quantum(dtype)};
  const double z_weight = c.loss.z_loss_weight;
  // Natural scale of a token's loss and gradient: T^s and T^(s-1) for KD, 1 for cross-entropy.
  const double kd_power = c.loss.t2_scaling ? 2.0 : 0.0;
  const double loss_scale = kd ? std::pow(c.loss.temperature, kd_power) : 1.0;
  const double grad_scale = kd ? std::pow(c.loss.temperature, kd_power - 1.0) : 1.0;
  const bool row_sum_applies = c.loss.softcap == 0.0;
  const bool keep_grads = snapshot != nullptr && n * vocab <= kSnapshotElementLimit;
  if (snapshot != nullptr) {
    snapshot->token_loss.assign(static_cast<std::size_t>(n), 0.0f);
    snapshot->effective_grad.assign(keep_grads ? static_cast<std::size_t>(n * vocab) : 0, 0.0f);
  }

  std::vector<double> reference_loss(static_cast<std::size_t>(n), 0.0);
  StreamStats total;
  total.grad_mismatches_per_rank.assign(ranks.size(), 0);

#pragma omp parallel num_threads(threads)
  {
    StreamStats local;
    local.grad_mismatches_per_rank.assign(ranks.size(), 0);
    std::vector<double> logits(static_cast<std::size_t>(vocab));
    std::vector<double> teacher(kd ? static_cast<std::size_t>(vocab) : 0);
    std::vector<double> grad_ref(static_cast<std::size_t>(vocab));
    std::vector<double> grad_got;
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t t = 0; t < n; ++t) {
      inputs.logits(t, 0, vocab, logits.data());
      if (kd) inputs.teacher_logits(t, 0, vocab, teacher.data());
      const ReferenceToken ref = reference.evaluate(t, logits, teacher, grad_ref);
      reference_loss[static_cast<std::size_t>(t)] = ref.loss;
      const auto& h = holders[static_cast<std::size_t>(t)];
      const double token_scale = std::fabs(ref.weight) * grad_scale;
      CompensatedSum row_sum;
      CompensatedSum row_abs;
      double first_loss = 0.0;
      for (std::size_t j = 0; j < h.size(); ++j) {
        const RankOutput& out = ranks[static_cast<std::size_t>(h[j].rank_index)];
        const int rank = out.assignment.world_rank;
        const double got_loss = out.token_loss[static_cast<std::size_t>(h[j].row)];
        local.loss.add({t, -1, rank, ref.loss, got_loss,
                        tol_loss.atol * loss_scale + tol_loss.rtol * std::fabs(ref.loss)});
        if (j == 0) {
          first_loss = got_loss;
          if (snapshot != nullptr) snapshot->token_loss[static_cast<std::size_t>(t)] = static_cast<float>(got_loss);
        } else {
          local.agreement.add({t, -1, rank, first_loss, got_loss,
                               tol_agree.atol * loss_scale + tol_agree.rtol * std::fabs(first_loss)});
        }
        const VocabRange range = out.assignment.vocab;
        grad_got.resize(static_cast<std::size_t>(range.size()));
        out.grad_row(h[j].row, grad_got.data());
        for (std::int64_t v = range.begin; v < range.end; ++v) {
          const double got_local = grad_got[static_cast<std::size_t>(v - range.begin)];
          const double expected = grad_ref[static_cast<std::size_t>(v)];
          bool mismatch = false;
          std::int64_t ulp = 0;
          const double m = judge.judge(got_local, expected, token_scale, mismatch, ulp);
          if (mismatch) ++local.grad_mismatches_per_rank[static_cast<std::size_t>(h[j].rank_index)];
          const double got = got_local * framework_scale;
          local.grad.add_with_margin({t, v, rank, expected, got, judge.tolerance_at(expected, token_scale)}, m,
                                     mismatch);
          local.grad.add_ulp(ulp);
          row_sum.add(got);
          row_abs.add(std::fabs(got));
          if (keep_grads) snapshot->effective_grad[static_cast<std::size_t>(t * vocab + v)] = static_cast<float>(got);
        }
      }
      if (row_sum_applies) {
        // SPEC 3 invariant: sum_v dl/dx_v = 2 w_z lse per token (0 for KD), times the token's weight in L.
        const double expected_sum = (ref.valid && !kd) ? ref.weight * 2.0 * z_weight * ref.lse : 0.0;
        local.row_sum.add({t, -1,
                           h.empty() ? -1 : ranks[static_cast<std::size_t>(h[0].rank_index)].assignment.world_rank,
                           expected_sum, row_sum.value(),
                           tol_row.atol * token_scale + tol_row.rtol * row_abs.value() + judge.quantum * framework_scale});
      }
    }
    // CP padding rows are masked: zero loss and an exactly zero gradient on every rank.
#pragma omp for schedule(dynamic, 16)
    for (std::size_t j = 0; j < padding_rows.size(); ++j) {
      const RankOutput& out = ranks[static_cast<std::size_t>(padding_rows[j].rank_index)];
      const LocalRow& row = out.assignment.rows[static_cast<std::size_t>(padding_rows[j].row)];
      ElementRecord loss_record{-1, -1, out.assignment.world_rank, 0.0,
                                out.token_loss[static_cast<std::size_t>(padding_rows[j].row)], 0.0,
                                row.sequence, row.position};
      local.loss.add(loss_record);
      const VocabRange range = out.assignment.vocab;
      grad_got.resize(static_cast<std::size_t>(range.size()));
      out.grad_row(padding_rows[j].row, grad_got.data());
      for (std::int64_t v = range.begin; v < range.end; ++v) {
        ElementRecord r{-1, v, out.assignment.world_rank, 0.0,
                        grad_got[static_cast<std::size_t>(v - range.begin)] * framework_scale, 0.0, row.sequence,
                        row.position};
        const bool mismatch = r.got != 0.0;
        if (mismatch) ++local.grad_mismatches_per_rank[static_cast<std::size_t>(padding_rows[j].rank_index)];
        local.grad.add_with_margin(r, mismatch ? std::numeric_limits<double>::infinity() : 0.0, mismatch);
      }
    }
#pragma omp critical(lossverify_merge)
    {
      total.loss.merge(local.loss);
      total.grad.merge(local.grad);
      total.agreement.merge(local.agreement);
      total.row_sum.merge(local.row_sum);
      for (std::size_t k = 0; k < ranks.size(); ++k) {
        total.grad_mismatches_per_rank[k] += local.grad_mismatches_per_rank[k];
      }
    }
  }

  std::vector<CheckResult> results;

  // loss: per-token values and the logged loss of every rank.
  ErrorStats reduced;
  double reference_reduced = 0.0;
  const Tolerance tol_reduced = effective_tolerance(c, "reduced_loss");
  if (c.loss.reduction != Reduction::none) {
    reference_reduced = reference.reduced_loss(reference_loss);
    // The absolute floor scales with sum_t |w_t|: 1 for mean, N_v for sum.
    const double weight_total = c.loss.reduction == Reduction::mean ? 1.0 : static_cast<double>(reference.valid_tokens());
    for (const RankOutput& out : ranks) {
      reduced.add({-1, -1, out.assignment.world_rank, reference_reduced, out.reduced_loss,
                   tol_reduced.atol * loss_scale * std::max(weight_total, 1.0) +
                       tol_reduced.rtol * std::fabs(reference_reduced)});
    }
  }
  {
    ErrorStats both = total.loss;
    both.merge(reduced);
    CheckResult r = make_result("loss", both, tol_loss, "per-token and logged losses vs the float64 reference");
    r.metrics = {{"per_token", total.loss.to_json()}, {"margin", both.margin()}};
    if (c.loss.reduction != Reduction::none) {
      r.metrics["reduced"] = reduced.to_json();
      r.metrics["reduced"]["expected"] = reference_reduced;
      r.metrics["reduced"]["tolerance"] = {{"atol", tol_reduced.atol}, {"rtol", tol_reduced.rtol}};
    }
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("grad", total.grad, judge.tolerance, "effective gradient vs the float64 reference");
    if (dtype != DType::fp32) r.metrics["max_ulp"] = total.grad.max_ulp();
    r.metrics["framework_scale"] = framework_scale;
    nlohmann::json per_rank = nlohmann::json::array();
    for (std::size_t k = 0; k < ranks.size(); ++k) {
      per_rank.push_back({{"rank", ranks[k].assignment.world_rank}, {"mismatches", total.grad_mismatches_per_rank[k]}});
    }
    r.metrics["mismatches_per_rank"] = per_rank;
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("rank_agreement", total.agreement, tol_agree,
                                "TP ranks of each token report the same loss");
    if (r.verdict == Verdict::not_applicable) r.summary = "one TP rank per token: nothing to compare";
    results.push_back(std::move(r));
  }
  results.push_back(finite_check(ranks, threads));
  {
    CheckResult r = make_result("row_sum", total.row_sum, tol_row, "sum_v grad = w_t 2 w_z lse for every token");
    if (!row_sum_applies) r.summary = "softcap changes the invariant: not applicable";
    results.push_back(std::move(r));
  }
  {
    // stats: the logged valid-token count of every rank is the global count; any difference fails.
    ErrorStats stats;
    for (const RankOutput& out : ranks) {
      stats.add({-1, -1, out.assignment.world_rank, static_cast<double>(reference.valid_tokens()),
                 static_cast<double>(out.logged_valid_tokens), 0.5});
    }
    CheckResult r = make_result("stats", stats, Tolerance{0.5, 0.0, 0}, "logged valid-token count vs the global count");
    r.metrics["expected_valid_tokens"] = reference.valid_tokens();
    results.push_back(std::move(r));
  }
  if (snapshot != nullptr && !ranks.empty()) {
    snapshot->logged_loss = ranks.front().reduced_loss;
    snapshot->logged_valid_tokens = ranks.front().logged_valid_tokens;
  }
  return results;
}

CheckResult invariance_check(const Case& c, const std::vector<LayoutSnapshot>& snapshots,
                             const std::vector<std::string>& layout_names) {
  const Tolerance tol = effective_tolerance(c, "invariance");
  const DType dtype = c.inputs.dtype;
  ErrorStats stats;
  nlohmann::json per_layout = nlohmann::json::array();
  if (snapshots.empty()) return make_result("invariance", stats, tol, "no layouts");
  const LayoutSnapshot& base = snapshots.front();
  const double quantum = output_quantum(dtype);
  // Compared element by element; "token scale" here is the largest gradient magnitude of the row.
  for (std::size_t k = 1; k < snapshots.size(); ++k) {
    const LayoutSnapshot& other = snapshots[k];
    ErrorStats layout_stats;
    for (std::size_t t = 0; t < base.token_loss.size(); ++t) {
      const double e = base.token_loss[t];
      layout_stats.add({static_cast<std::int64_t>(t), -1, static_cast<int>(k), e, other.token_loss[t],
                        1e-5 + 2e-5 * std::fabs(e)});
    }
    layout_stats.add({-1, -1, static_cast<int>(k), base.logged_loss, other.logged_loss,
                      1e-5 + 4e-5 * std::fabs(base.logged_loss)});
    layout_stats.add({-1, -1, static_cast<int>(k), static_cast<double>(base.logged_valid_tokens),
                      static_cast<double>(other.logged_valid_tokens), 0.5});
    if (!base.effective_grad.empty() && !other.effective_grad.empty()) {
      const std::size_t vocab = static_cast<std::size_t>(c.shape.vocab);
      for (std::size_t t = 0; t < base.token_loss.size(); ++t) {
        double row_scale = 0.0;
        for (std::size_t v = 0; v < vocab; ++v) row_scale = std::max(row_scale, std::fabs(double(base.effective_grad[t * vocab + v])));
        for (std::size_t v = 0; v < vocab; ++v) {
          const double e = base.effective_grad[t * vocab + v];
          const double g = other.effective_grad[t * vocab + v];
          const double error = e == g ? 0.0 : std::fabs(g - e);
          const double floor = tol.atol * row_scale + quantum;
          double m = 0.0;
          bool mismatch = false;
          if (tol.max_ulp > 0) {
            const double by_ulp = error / (tol.max_ulp * ulp_size(e, dtype));
            m = std::min(by_ulp, margin_of(error, floor));
          } else {
            m = margin_of(error, floor + tol.rtol * std::fabs(e));
          }
          mismatch = !(m <= 1.0);
          layout_stats.add_with_margin({static_cast<std::int64_t>(t), static_cast<std::int64_t>(v), static_cast<int>(k),
                                        e, g, floor},
                                       m, mismatch);
        }
      }
    }
    per_layout.push_back({{"layout", layout_names[k]}, {"against", layout_names[0]}, {"margin", layout_stats.margin()},
                          {"mismatches", layout_stats.mismatches()}});
    stats.merge(layout_stats);
  }
  CheckResult r = make_result("invariance", stats, tol,
                              "every layout reproduces the first layout's losses, logged values and gradients");
  r.metrics["layouts"] = per_layout;
  r.metrics["gradients_compared"] = !base.effective_grad.empty();
  if (r.verdict == Verdict::not_applicable) r.summary = "a single layout: nothing to compare";
  return r;
}

}  // namespace lossverify
