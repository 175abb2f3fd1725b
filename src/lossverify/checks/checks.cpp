#include "lossverify/checks/checks.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "lossverify/checks/element_judge.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/registry.hpp"

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
      {"grad",
       "every effective gradient element vs the reference: abs/rel error, ULP in the output dtype, "
       "mismatches per rank, worst (token, column, rank)"},
      {"rank_agreement", "all TP ranks of a token report the same loss (needs no reference)"},
      {"finite", "census of NaN, +-Inf and subnormal values per tensor and rank; fails on any non-finite value"},
      {"row_sum",
       "invariant: sum over the vocabulary of a token's gradient = w_t 2 w_z lse (0 without z-loss; "
       "0 for KD and the policy loss); not applicable with softcap"},
      {"stats",
       "logged statistics of every rank: the valid-token count vs the global count, and a kind's own (the policy "
       "loss's clip fractions, KL, entropy) vs the reference's token-means"},
      {"invariance", "the same case at several rank layouts gives the same losses and gradients (sweeps)"},
  };
  static const std::vector<CheckInfo> with_kinds = [] {
    std::vector<CheckInfo> all = list;
    for (const LossKind* kind : loss_kinds()) {
      for (const std::string& quantity : kind->token_quantities()) {
        all.push_back({quantity, "per-token " + quantity + " of every rank vs the float64 reference (" +
                                     std::string(kind->name()) + ")"});
      }
      if (const std::string_view values = kind->scope_values_name(); !values.empty()) {
        all.push_back({std::string(values), "each rank's " + std::string(values) +
                                                " of every micro-batch scope vs the float64 reference's (" +
                                                std::string(kind->name()) + ")"});
      }
    }
    for (const Stage* stage : stages()) {
      for (const std::string& gradient : stage->gradients()) {
        all.push_back({gradient, "the stage's gradient " + gradient + " of every token vs the float64 reference (" +
                                     std::string(stage->name()) + ")"});
      }
      for (const std::string& parameter : stage->parameters()) {
        all.push_back({parameter, "each rank's shard of the stage's parameter gradient " + parameter +
                                      ", summed over its tokens, vs the float64 sum (" + std::string(stage->name()) +
                                      ")"});
      }
    }
    return all;
  }();
  return with_kinds;
}

namespace {

bool earlier(const ElementRecord& a, const ElementRecord& b) {
  return std::tie(a.token, a.column, a.rank) < std::tie(b.token, b.column, b.rank);
}

}  // namespace

void ErrorStats::add(const ElementRecord& r) {
  // Equal values (both +inf included) agree; inf against a finite value is an infinite error.
  const double error = r.got == r.expected ? 0.0 : std::fabs(r.got - r.expected);
  add_with_margin(r, margin_of(error, r.tolerance), mismatch_of(error, r.tolerance));  // NaN counts as a mismatch
}

void ErrorStats::add_with_margin(const ElementRecord& r, double m, bool mismatch) {
  count(r.got, r.expected, mismatch);
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
  if (o.worst_ &&
      (!worst_ || o.max_margin_ > max_margin_ || (o.max_margin_ == max_margin_ && earlier(*o.worst_, *worst_)))) {
    worst_ = o.worst_;
    max_margin_ = o.max_margin_;
  }
}

nlohmann::json ErrorStats::to_json() const {
  return {{"compared", compared_},
          {"mismatches", mismatches_},
          {"max_abs_error", max_abs_},
          {"max_rel_error", max_rel_},
          {"margin", max_margin_}};
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
    p.worst = {worst_->token,    worst_->column, worst_->rank,     worst_->padding_sequence, worst_->padding_position,
               worst_->expected, worst_->got,    worst_->tolerance};
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
    s.worst_ =
        ElementRecord{p.worst.token, p.worst.column,    static_cast<int>(p.worst.rank), p.worst.expected,
                      p.worst.got,   p.worst.tolerance, p.worst.padding_sequence,       p.worst.padding_position};
  }
  return s;
}

CheckResult make_result(const std::string& name, const ErrorStats& stats, Tolerance tol, std::string what) {
  CheckResult r;
  r.name = name;
  r.tolerance = tol;
  r.metrics = stats.to_json();
  r.worst = stats.worst();
  r.margin = stats.margin();
  r.verdict = stats.compared() == 0 ? Verdict::not_applicable : stats.mismatches() == 0 ? Verdict::pass : Verdict::fail;
  r.summary = std::move(what);
  return r;
}

}  // namespace lossverify
