#include "lossverify/checks/checks.hpp"

#include <algorithm>
#include <cmath>

#include "lossverify/case/tolerances.hpp"
#include "lossverify/checks/element_judge.hpp"
#include "lossverify/kind_api/registry.hpp"

namespace lossverify {

namespace {

// One layout's answers against the first layout's, element by element; "token scale" here is the largest
// gradient magnitude of the row.
ErrorStats compare_layouts(const Case& c, const Tolerance& tol, const LayoutSnapshot& base, const LayoutSnapshot& other,
                           int k) {
  const DType dtype = c.inputs.dtype;
  const double quantum = output_quantum(dtype);
  ErrorStats stats;
  for (std::size_t t = 0; t < base.token_loss.size(); ++t) {
    const double e = base.token_loss[t];
    stats.add({static_cast<std::int64_t>(t), -1, k, e, other.token_loss[t], 1e-5 + 2e-5 * std::fabs(e)});
  }
  stats.add({-1, -1, k, base.logged_loss, other.logged_loss, 1e-5 + 4e-5 * std::fabs(base.logged_loss)});
  stats.add(
      {-1, -1, k, static_cast<double>(base.logged_valid_tokens), static_cast<double>(other.logged_valid_tokens), 0.5});
  if (base.effective_grad.empty() || other.effective_grad.empty()) return stats;
  const std::size_t vocab = static_cast<std::size_t>(c.shape.vocab);
  for (std::size_t t = 0; t < base.token_loss.size(); ++t) {
    // A token within rounding of a clip edge (an infinite scale): either reading is right, in any layout.
    if (t < base.token_grad_scale.size() && std::isinf(base.token_grad_scale[t])) continue;
    double row_scale = 0.0;
    for (std::size_t v = 0; v < vocab; ++v)
      row_scale = std::max(row_scale, std::fabs(double(base.effective_grad[t * vocab + v])));
    // A kind that scales its gradient tolerance per token (the policy loss) is held to that scale here too.
    if (t < base.token_grad_scale.size()) row_scale = std::max(row_scale, double(base.token_grad_scale[t]));
    for (std::size_t v = 0; v < vocab; ++v) {
      const double e = base.effective_grad[t * vocab + v];
      const double g = other.effective_grad[t * vocab + v];
      const double error = e == g ? 0.0 : std::fabs(g - e);
      const double floor = tol.atol * row_scale + quantum;
      const double by_rule = tol.max_ulp > 0
                                 ? std::min(error / (tol.max_ulp * ulp_size(e, dtype)), margin_of(error, floor))
                                 : margin_of(error, floor + tol.rtol * std::fabs(e));
      const double m = std::isnan(by_rule) || !std::isfinite(e) ? exact_or_infinite(error) : by_rule;
      stats.add_with_margin({static_cast<std::int64_t>(t), static_cast<std::int64_t>(v), k, e, g, floor}, m,
                            !(m <= 1.0));
    }
  }
  return stats;
}

}  // namespace

InvarianceCheck::InvarianceCheck(const Case& c) : case_(c), tolerance_(effective_tolerance(c, "invariance")) {}

void InvarianceCheck::add(LayoutSnapshot snapshot, const std::string& layout_name, const std::string& layout_class) {
  const auto base = bases_.find(layout_class);
  if (base == bases_.end()) {
    gradients_compared_ = (bases_.empty() || gradients_compared_) && !snapshot.effective_grad.empty();
    bases_.emplace(layout_class, Base{std::move(snapshot), layout_name});
    return;
  }
  ++layouts_;
  const ErrorStats stats = compare_layouts(case_, tolerance_, base->second.snapshot, snapshot, layouts_);
  gradients_compared_ = gradients_compared_ && !snapshot.effective_grad.empty();
  per_layout_.push_back({{"layout", layout_name},
                         {"against", base->second.name},
                         {"margin", stats.margin()},
                         {"mismatches", stats.mismatches()}});
  stats_.merge(stats);
}

CheckResult InvarianceCheck::result() const {
  if (bases_.empty()) return make_result("invariance", stats_, tolerance_, "no layouts");
  CheckResult r = make_result("invariance", stats_, tolerance_,
                              "every layout reproduces the first layout's losses, logged values and gradients");
  r.metrics["layouts"] = per_layout_;
  r.metrics["gradients_compared"] = gradients_compared_;
  if (r.verdict == Verdict::not_applicable) r.summary = "a single layout: nothing to compare";
  if (bases_.size() > 1) {
    r.metrics["layout_classes"] = bases_.size();
    r.summary = "each layout reproduces the first of its class: " + std::string(kind_of(case_.loss).invariance_rule());
  }
  return r;
}

CheckResult invariance_check(const Case& c, const std::vector<LayoutSnapshot>& snapshots,
                             const std::vector<std::string>& layout_names) {
  InvarianceCheck check(c);
  for (std::size_t k = 0; k < snapshots.size(); ++k) check.add(snapshots[k], layout_names[k]);
  return check.result();
}

}  // namespace lossverify
