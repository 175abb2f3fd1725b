// The float64 reference against MPFR (256-bit) on rows built to be hard: huge gaps between logits,
// near-ties at the last bit, subnormal and underflowing probabilities, logits of 1e4, cancellation between
// the log-sum-exp and the target term, KD with a peaked teacher. The exact values are computed from the
// definitions (docs/spec.md §3) on the same float64 inputs.
//
// Each value is held to a bound written from the reference's error analysis, in units of u = 2^-53:
//   exp                      1.2 ulp (the vectorized polynomial) or std::exp's own below -708
//   lse                      k u (1 + |lse|)
//   cross-entropy loss       k u (1 + |lse| + |sum_v q_v x_v| + w_z lse^2)      (absolute: the loss is a difference)
//   gradient element v       k u w (p_v |1 + 2 w_z lse| (1 + |x_v| + |lse|) + q_v) + k 2^-1074 w
//                            (p_v = exp(x_v - lse) carries the rounding of its argument; with a softcap c,
//                            times sech^2(x_v / c), plus |d_v| (2 + 2 |x_v / c|) for that factor's own rounding)
//   KD loss, gradient        the same terms over P_v and Q_v
// with k = 16. The last test shows that the measure rejects an answer off by 1e-12.
#include <doctest/doctest.h>
#include <mpfr.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/reference/row_sums.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

constexpr mpfr_prec_t kBits = 256;
constexpr double kU = 0x1p-53;
constexpr double kK = 16.0;
constexpr double kSmallest = 0x1p-1074;

// An MPFR number with value semantics enough for the sums below.
class Big {
 public:
  Big() { mpfr_init2(v_, kBits), mpfr_set_zero(v_, 1); }
  explicit Big(double x) { mpfr_init2(v_, kBits), mpfr_set_d(v_, x, MPFR_RNDN); }
  Big(const Big& o) { mpfr_init2(v_, kBits), mpfr_set(v_, o.v_, MPFR_RNDN); }
  Big& operator=(const Big& o) {
    mpfr_set(v_, o.v_, MPFR_RNDN);
    return *this;
  }
  ~Big() { mpfr_clear(v_); }
  double to_double() const { return mpfr_get_d(v_, MPFR_RNDN); }
  friend Big operator+(const Big& a, const Big& b) { return apply(mpfr_add, a, b); }
  friend Big operator-(const Big& a, const Big& b) { return apply(mpfr_sub, a, b); }
  friend Big operator*(const Big& a, const Big& b) { return apply(mpfr_mul, a, b); }
  friend Big operator/(const Big& a, const Big& b) { return apply(mpfr_div, a, b); }
  friend Big exp(const Big& a) { return apply1(mpfr_exp, a); }
  friend Big log(const Big& a) { return apply1(mpfr_log, a); }
  friend Big tanh(const Big& a) { return apply1(mpfr_tanh, a); }
  friend Big sech(const Big& a) { return apply1(mpfr_sech, a); }

 private:
  template <class F>
  static Big apply(F f, const Big& a, const Big& b) {
    Big r;
    f(r.v_, a.v_, b.v_, MPFR_RNDN);
    return r;
  }
  template <class F>
  static Big apply1(F f, const Big& a) {
    Big r;
    f(r.v_, a.v_, MPFR_RNDN);
    return r;
  }
  mpfr_t v_;
};

// Distance of `got` from the exact value in ulps of the double nearest to it.
double ulps(double got, const Big& exact) {
  const double e = exact.to_double();
  const double spacing = std::max(std::nextafter(std::fabs(e), INFINITY) - std::fabs(e), kSmallest);
  return std::fabs((Big(got) - exact).to_double()) / spacing;
}

struct Row {
  const char* name;
  std::vector<double> student;
  std::vector<double> teacher;  // KD only
};

struct CrossEntropySettings {
  double alpha = 0.0;
  bool megatron = false;
  double z_weight = 0.0;
  double softcap = 0.0;
};

// Rows of 1031 columns (two blocks and a tail: every path of the vectorized code) built to be hard.
constexpr std::size_t kVocab = 1031;

std::vector<Row> hard_rows() {
  std::vector<Row> rows;
  std::mt19937_64 random(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto row = [&](const char* name, auto value) {
    Row r{name, std::vector<double>(kVocab), {}};
    for (std::size_t v = 0; v < kVocab; ++v) r.student[v] = value(v);
    rows.push_back(r);
  };
  row("huge gap: one logit 0, the rest at -800 (probabilities below the smallest double)",
      [](std::size_t v) { return v == 3 ? 0.0 : -800.0; });
  row("subnormal probabilities: x_v in (-750, -705)",
      [](std::size_t v) { return v == 0 ? 0.0 : -705.0 - 45.0 * static_cast<double>(v) / kVocab; });
  row("near-ties at the last bit", [](std::size_t v) { return 3.0 + static_cast<double>(v % 7) * 0x1p-51; });
  row("all equal", [](std::size_t) { return 0.25; });
  row("logits of 1e4 with a spread of 30", [&](std::size_t) { return 1e4 + 30.0 * normal(random); });
  row("logits of -1e4", [&](std::size_t) { return -1e4 + 5.0 * normal(random); });
  row("one dominant logit (loss near 0: lse and the target term cancel)",
      [](std::size_t v) { return v == 5 ? 40.0 : 0.0; });
  row("gaussian, scale 8", [&](std::size_t) { return 8.0 * normal(random); });
  row("alternating +-700", [](std::size_t v) { return v % 2 ? 700.0 : -700.0; });
  return rows;
}

// Exact cross-entropy of a row with its label at `label` (docs/spec.md §3), and the bounds of the checks.
struct ExactRow {
  Big lse;
  Big loss;
  std::vector<Big> grad;
  double loss_bound = 0.0;
  std::vector<double> grad_bound;
};

ExactRow exact_cross_entropy(const std::vector<double>& x, std::int64_t label, const CrossEntropySettings& s,
                             double weight) {
  const auto n = static_cast<double>(x.size());
  auto q = [&](std::size_t v) {
    const double hit = static_cast<std::int64_t>(v) == label ? 1.0 : 0.0;
    return s.megatron ? Big(1.0 - s.alpha) * Big(hit) + Big(s.alpha) / Big(n - 1.0) * Big(1.0 - hit)
                      : Big(1.0 - s.alpha) * Big(hit) + Big(s.alpha) / Big(n);
  };
  std::vector<Big> z(x.size());
  for (std::size_t v = 0; v < x.size(); ++v) {
    z[v] = s.softcap > 0.0 ? Big(s.softcap) * tanh(Big(x[v]) / Big(s.softcap)) : Big(x[v]);
  }
  Big sum_exp;
  Big sum_qz;
  for (std::size_t v = 0; v < x.size(); ++v) {
    sum_exp = sum_exp + exp(z[v]);
    sum_qz = sum_qz + q(v) * z[v];
  }
  ExactRow r;
  r.lse = log(sum_exp);
  const Big z_w(s.z_weight);
  r.loss = r.lse - sum_qz + z_w * r.lse * r.lse;
  const double lse = r.lse.to_double();
  r.loss_bound = kK * kU * (1.0 + std::fabs(lse) + std::fabs(sum_qz.to_double()) + s.z_weight * lse * lse);
  const Big z_factor = Big(1.0) + Big(2.0) * z_w * r.lse;
  for (std::size_t v = 0; v < x.size(); ++v) {
    const Big p = exp(z[v] - r.lse);
    Big d = p * z_factor - q(v);
    double chain = 1.0;
    double chain_error = 0.0;  // sech^2(y) carries the rounding of y = x / c: relative 2 |y| u, and its own
    if (s.softcap > 0.0) {     // d/dx c tanh(x / c) = sech^2(x / c)
      const Big sh = sech(Big(x[v]) / Big(s.softcap));
      chain = (sh * sh).to_double();
      chain_error = std::fabs((d * sh * sh).to_double()) * (2.0 + 2.0 * std::fabs(x[v] / s.softcap));
      d = d * sh * sh;
    }
    r.grad.push_back(Big(weight) * d);
    const double pv = p.to_double();
    r.grad_bound.push_back(
        kK * kU * weight *
            (chain *
                 (pv * std::fabs(z_factor.to_double()) * (1.0 + std::fabs(x[v]) + std::fabs(lse)) + q(v).to_double()) +
             chain_error) +
        kK * kSmallest * weight);
  }
  return r;
}

nlohmann::json cross_entropy_case(const CrossEntropySettings& s) {
  auto j = testing::case_json(4, static_cast<std::int64_t>(kVocab), 1);
  j["loss"] = {{"label_smoothing", s.alpha},
               {"smoothing_convention", s.megatron ? "megatron" : "pytorch"},
               {"z_loss_weight", s.z_weight},
               {"softcap", s.softcap}};
  return j;
}

// The largest error over its bound, and where.
struct Worst {
  double ratio = 0.0;
  std::string where;
  void note(double r, const std::string& what) {
    if (r > ratio) ratio = r, where = what;
  }
};

// Runs every hard row through the reference as each valid token of a case with these settings, the answer
// scaled by (1 + perturb), and returns the largest error over its bound.
Worst worst_cross_entropy(const CrossEntropySettings& s, double perturb = 0.0) {
  const Case c = testing::make_case(cross_entropy_case(s));
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  Worst worst;
  std::vector<double> grad(kVocab);
  for (const Row& row : hard_rows()) {
    for (std::int64_t token = 0; token < c.shape.tokens; ++token) {
      if (!inputs.is_valid(token)) continue;
      const std::string at = std::string(row.name) + ", label " + std::to_string(inputs.label(token));
      const ReferenceToken got = reference.evaluate(token, row.student, {}, grad);
      const ExactRow exact = exact_cross_entropy(row.student, inputs.label(token), s, got.weight);
      const double loss = got.loss * (1.0 + perturb);
      worst.note(std::fabs((Big(loss) - exact.loss).to_double()) / exact.loss_bound, "loss: " + at);
      worst.note(
          std::fabs((Big(got.lse) - exact.lse).to_double()) / (kK * kU * (1.0 + std::fabs(exact.lse.to_double()))),
          "lse: " + at);
      for (std::size_t v = 0; v < kVocab; ++v) {
        const double g = grad[v] * (1.0 + perturb);
        worst.note(std::fabs((Big(g) - exact.grad[v]).to_double()) / exact.grad_bound[v],
                   "gradient column " + std::to_string(v) + ": " + at);
      }
    }
  }
  return worst;
}

void check_cross_entropy(const CrossEntropySettings& s) {
  const Worst worst = worst_cross_entropy(s);
  CAPTURE(worst.where);
  CHECK(worst.ratio <= 1.0);
  MESSAGE("largest error / bound ", worst.ratio, " at ", worst.where);
}

}  // namespace

TEST_CASE("reference_exp_is_within_1_2_ulp_of_mpfr_from_minus_750_to_709") {
  std::vector<double> x;
  for (double v = -750.0; v <= 709.5; v += 0.0137) x.push_back(v);
  for (double edge :
       {-745.2, -745.1, -744.5, -708.4, -708.0, -707.99, -1e-300, 0.0, 1e-300, 0x1p-30, 708.0, 709.0, 709.7, 709.78})
    x.push_back(edge);
  std::mt19937_64 random(3);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (int i = 0; i < 20000; ++i) x.push_back(uniform(random) * 0.35);  // the polynomial's own interval
  std::vector<double> y(x.size());
  for (std::size_t b = 0; b < x.size(); b += row_sums::kBlock) {
    row_sums::exp_block(&x[b], &y[b], std::min(row_sums::kBlock, x.size() - b));
  }
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    CAPTURE(x[i]);
    const double distance = ulps(y[i], exp(Big(x[i])));
    CHECK(distance <= 1.2);
    worst = std::max(worst, distance);
  }
  MESSAGE("exp: worst distance from MPFR ", worst, " ulp over ", x.size(), " arguments");
  const double special[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(), 710.0, -800.0};
  double out[5];
  row_sums::exp_block(special, out, 5);
  CHECK(std::isnan(out[0]));
  CHECK(out[1] == std::numeric_limits<double>::infinity());
  CHECK(out[2] == 0.0);
  CHECK(out[3] == std::exp(710.0));
  CHECK(out[4] == 0.0);
}

TEST_CASE("reference_lane_sums_are_compensated_to_the_last_bit") {
  // 1 + 1e-16 x 1000 + (-1): each small term is below half an ulp of 1, so a plain sum loses all of them.
  std::vector<double> terms{1.0};
  for (int i = 0; i < 1000; ++i) terms.push_back(1e-16);
  terms.push_back(-1.0);
  row_sums::LaneSum sum;
  sum.add(terms.data(), terms.size());
  const auto [value, error] = sum.result();
  CHECK(std::fabs(value + error - 1e-13) <= 1e-28);
}

TEST_CASE("reference_cross_entropy_matches_mpfr_on_hard_rows") { check_cross_entropy({}); }

TEST_CASE("reference_cross_entropy_with_smoothing_and_z_loss_matches_mpfr_on_hard_rows") {
  check_cross_entropy({0.1, false, 1e-4, 0.0});
  check_cross_entropy({0.2, true, 0.0, 0.0});
}

TEST_CASE("reference_cross_entropy_with_softcap_matches_mpfr_on_hard_rows") {
  check_cross_entropy({0.1, false, 0.0, 30.0});
}

TEST_CASE("reference_kd_matches_mpfr_with_a_peaked_teacher_and_underflowing_probabilities") {
  for (const double temperature : {1.0, 2.0, 0.5}) {
    auto j = testing::case_json(1, static_cast<std::int64_t>(kVocab), 1);
    j["loss"] = {{"kind", "kd"}, {"temperature", temperature}, {"t2_scaling", true}};
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const LossReference reference(c, inputs);
    std::vector<double> student(kVocab);
    std::vector<double> teacher(kVocab);
    for (std::size_t v = 0; v < kVocab; ++v) {
      student[v] = std::sin(static_cast<double>(v)) * 20.0;
      teacher[v] = v == 11 ? 50.0 : -700.0 + static_cast<double>(v % 13);  // peaked; P_v ~ e^-750/T elsewhere
    }
    std::vector<double> grad(kVocab);
    CAPTURE(temperature);
    const ReferenceToken got = reference.evaluate(0, student, teacher, grad);
    const Big t(temperature);
    Big sum_q;
    Big sum_p;
    for (std::size_t v = 0; v < kVocab; ++v) {
      sum_q = sum_q + exp(Big(student[v]) / t);
      sum_p = sum_p + exp(Big(teacher[v]) / t);
    }
    const Big lse = log(sum_q);
    const Big teacher_lse = log(sum_p);
    Big kl;
    double kl_bound = 0.0;
    for (std::size_t v = 0; v < kVocab; ++v) {
      const Big log_p = Big(teacher[v]) / t - teacher_lse;
      const Big log_q = Big(student[v]) / t - lse;
      const Big p = exp(log_p);
      kl = kl + p * (log_p - log_q);
      kl_bound +=
          p.to_double() * (1.0 + std::fabs((Big(teacher[v]) / t).to_double()) + std::fabs(teacher_lse.to_double()) +
                           std::fabs((Big(student[v]) / t).to_double()) + std::fabs(lse.to_double()));
    }
    const double t2 = temperature * temperature;
    CHECK(std::fabs((Big(got.loss) - Big(t2) * kl).to_double()) <= kK * kU * t2 * (kl_bound + 1.0));
    const double scale = got.weight * temperature;  // w T^(2-1)
    for (std::size_t v = 0; v < kVocab; ++v) {
      const Big q = exp(Big(student[v]) / t - lse);
      const Big p = exp(Big(teacher[v]) / t - teacher_lse);
      const Big exact = Big(scale) * (q - p);
      const double bound =
          kK * kU * scale *
              (q.to_double() * (1.0 + std::fabs(student[v] / temperature) + std::fabs(lse.to_double())) +
               p.to_double() * (1.0 + std::fabs(teacher[v] / temperature) + std::fabs(teacher_lse.to_double()))) +
          kK * kSmallest * scale;
      CAPTURE(v);
      CHECK(std::fabs((Big(grad[v]) - exact).to_double()) <= bound);
    }
  }
}

TEST_CASE("reference_accuracy_measure_rejects_an_answer_off_by_1e-12") {
  // The bounds above are tight enough to fail a reference that is wrong in the twelfth digit.
  const Worst worst = worst_cross_entropy({0.1, false, 1e-4, 0.0}, 1e-12);
  CAPTURE(worst.where);
  CHECK(worst.ratio > 1.0);
}
