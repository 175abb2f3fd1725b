#include "lossverify/checks/checks.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "lossverify/checks/tolerances.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/cross_entropy_reference.hpp"

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
      {"row_sum", "invariant: sum over the vocabulary of a token's gradient = w_t 2 w_z lse (0 without z-loss)"},
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
  void count(double value, DType dtype) {
    if (std::isnan(value)) {
      ++nan;
    } else if (std::isinf(value)) {
      ++(value > 0 ? pos_inf : neg_inf);
    } else if (is_subnormal_in(value, dtype)) {
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

CheckResult finite_check(const std::vector<RankOutput>& ranks) {
  CheckResult r;
  r.name = "finite";
  nlohmann::json per_rank = nlohmann::json::array();
  FiniteCensus total_grad;
  FiniteCensus total_loss;
  std::optional<ElementRecord> first;
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const RankOutput& out = ranks[k];
    FiniteCensus grad;
    FiniteCensus loss;
    std::vector<double> row(static_cast<std::size_t>(out.columns()));
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      out.grad_row(i, row.data());
      for (std::int64_t v = 0; v < out.columns(); ++v) {
        const double g = row[static_cast<std::size_t>(v)];
        grad.count(g, out.dtype);
        if (!std::isfinite(g) && !first) {
          first = ElementRecord{out.assignment.tokens[static_cast<std::size_t>(i)], out.assignment.vocab.begin + v,
                                out.assignment.world_rank, 0.0, g, 0.0};
        }
      }
      const double l = out.token_loss[static_cast<std::size_t>(i)];
      loss.count(l, DType::fp32);
      if (!std::isfinite(l) && !first) {
        first = ElementRecord{out.assignment.tokens[static_cast<std::size_t>(i)], -1, out.assignment.world_rank, 0.0,
                              l, 0.0};
      }
    }
    FiniteCensus reduced;
    if (out.has_reduced_loss) reduced.count(out.reduced_loss, DType::fp32);
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

std::vector<CheckResult> verify(const Case& c, const InputSource& inputs, const std::vector<RankOutput>& ranks,
                                int threads) {
  const std::int64_t n = c.shape.tokens;
  const std::int64_t vocab = c.shape.vocab;
  const CrossEntropyReference reference(c, inputs);

  // Which ranks hold each token, and a coverage check: the holders' columns must tile [0, V) exactly.
  std::vector<std::vector<Holder>> holders(static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const auto& tokens = ranks[k].assignment.tokens;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      holders[static_cast<std::size_t>(tokens[i])].push_back({static_cast<int>(k), static_cast<std::int64_t>(i)});
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
  const Tolerance tol_grad = effective_tolerance(c, "grad");
  const Tolerance tol_row = effective_tolerance(c, "row_sum");
  const DType dtype = c.inputs.dtype;
  const double quantum = output_quantum(dtype);
  const double z_weight = c.loss.z_loss_weight;

  std::vector<double> reference_loss(static_cast<std::size_t>(n), 0.0);
  StreamStats total;
  total.grad_mismatches_per_rank.assign(ranks.size(), 0);

#pragma omp parallel num_threads(threads)
  {
    StreamStats local;
    local.grad_mismatches_per_rank.assign(ranks.size(), 0);
    std::vector<double> logits(static_cast<std::size_t>(vocab));
    std::vector<double> grad_ref(static_cast<std::size_t>(vocab));
    std::vector<double> grad_got;
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t t = 0; t < n; ++t) {
      inputs.logits(t, 0, vocab, logits.data());
      const ReferenceToken ref = reference.evaluate(t, logits, grad_ref);
      reference_loss[static_cast<std::size_t>(t)] = ref.loss;
      const auto& h = holders[static_cast<std::size_t>(t)];
      CompensatedSum row_sum;
      CompensatedSum row_abs;
      double first_loss = 0.0;
      for (std::size_t j = 0; j < h.size(); ++j) {
        const RankOutput& out = ranks[static_cast<std::size_t>(h[j].rank_index)];
        const int rank = out.assignment.world_rank;
        const double got_loss = out.token_loss[static_cast<std::size_t>(h[j].row)];
        local.loss.add({t, -1, rank, ref.loss, got_loss, tol_loss.atol + tol_loss.rtol * std::fabs(ref.loss)});
        if (j == 0) {
          first_loss = got_loss;
        } else {
          local.agreement.add({t, -1, rank, first_loss, got_loss,
                               tol_agree.atol + tol_agree.rtol * std::fabs(first_loss)});
        }
        const VocabRange range = out.assignment.vocab;
        grad_got.resize(static_cast<std::size_t>(range.size()));
        out.grad_row(h[j].row, grad_got.data());
        const double weight_floor = tol_grad.atol * std::fabs(ref.weight) + quantum;
        for (std::int64_t v = range.begin; v < range.end; ++v) {
          const double got = grad_got[static_cast<std::size_t>(v - range.begin)];
          const double expected = grad_ref[static_cast<std::size_t>(v)];
          const double tol = weight_floor + tol_grad.rtol * std::fabs(expected);
          const double error = std::fabs(got - expected);
          if (!(error <= tol)) ++local.grad_mismatches_per_rank[static_cast<std::size_t>(h[j].rank_index)];
          local.grad.add({t, v, rank, expected, got, tol});
          row_sum.add(got);
          row_abs.add(std::fabs(got));
        }
        if (dtype != DType::fp32) {
          for (std::int64_t v = range.begin; v < range.end; ++v) {
            local.grad.add_ulp(ulp_distance(grad_got[static_cast<std::size_t>(v - range.begin)],
                                            grad_ref[static_cast<std::size_t>(v)], dtype));
          }
        }
      }
      // SPEC 3 invariant: sum_v dl/dx_v = 2 w_z lse per token, times the token's weight in L.
      const double expected_sum = ref.valid ? ref.weight * 2.0 * z_weight * ref.lse : 0.0;
      local.row_sum.add({t, -1, h.empty() ? -1 : ranks[static_cast<std::size_t>(h[0].rank_index)].assignment.world_rank,
                         expected_sum, row_sum.value(),
                         tol_row.atol * std::fabs(ref.weight) + tol_row.rtol * row_abs.value() + quantum});
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
  if (c.loss.reduction != Reduction::none) {
    reference_reduced = reference.reduced_loss(reference_loss);
    const Tolerance tol_reduced = effective_tolerance(c, "reduced_loss");
    // The absolute floor scales with sum_t |w_t|: 1 for mean, N_v for sum.
    const double weight_total = c.loss.reduction == Reduction::mean ? (reference.valid_tokens() > 0 ? 1.0 : 0.0)
                                                                    : static_cast<double>(reference.valid_tokens());
    for (const RankOutput& out : ranks) {
      reduced.add({-1, -1, out.assignment.world_rank, reference_reduced, out.reduced_loss,
                   tol_reduced.atol * std::max(weight_total, 1.0) + tol_reduced.rtol * std::fabs(reference_reduced)});
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
      const Tolerance t = effective_tolerance(c, "reduced_loss");
      r.metrics["reduced"]["tolerance"] = {{"atol", t.atol}, {"rtol", t.rtol}};
    }
    results.push_back(std::move(r));
  }
  {
    CheckResult r = make_result("grad", total.grad, tol_grad, "effective gradient vs the float64 reference");
    if (dtype != DType::fp32) r.metrics["max_ulp"] = total.grad.max_ulp();
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
  results.push_back(finite_check(ranks));
  results.push_back(make_result("row_sum", total.row_sum, tol_row, "sum_v grad = w_t 2 w_z lse for every token"));
  return results;
}

}  // namespace lossverify
