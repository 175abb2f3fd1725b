// The catalogued bugs of docs/spec.md §7 show exactly the signal it predicts, measured on the ranks' raw
// outputs against the correct implementation's on the same case; and they stay invisible where they
// must (a layout bug on a layout that cannot expose it, a smoothing bug without smoothing).
//
// Tolerances: every gradient element is one or two float32 products of a per-token weight (rounded from
// double to float) and a per-element value, so the ratio of a buggy to a correct element is the ratio of
// the weights up to about four roundings of 2^-24 (2.4e-7): rtol 1e-6 unless the ratio is a power of two,
// which float32 carries exactly.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;

namespace {

constexpr double kRatioRtol = 1e-6;

RankRun ranks_of(const Case& c, const InputSource& inputs, const std::string& name) {
  const Implementation* impl = find_implementation(name);
  REQUIRE(impl != nullptr);
  RunOptions options;
  options.threads = 2;
  return execute_ranks(c, inputs, *impl, options);
}

// Calls f(buggy rank output, correct rank output, local row, global column) for every gradient element of a
// non-padding row. Both runs have the same rank assignments (they depend on the case only).
void for_each_element(const RankRun& buggy, const RankRun& right,
                      const std::function<void(const RankOutput&, const RankOutput&, std::int64_t, std::int64_t)>& f) {
  REQUIRE(buggy.outputs.size() == right.outputs.size());
  for (std::size_t k = 0; k < buggy.outputs.size(); ++k) {
    const RankOutput& b = buggy.outputs[k];
    const RankOutput& g = right.outputs[k];
    REQUIRE(b.rows() == g.rows());
    for (std::int64_t i = 0; i < b.rows(); ++i) {
      REQUIRE(b.token_of(i) == g.token_of(i));
      if (b.token_of(i) < 0) continue;
      for (std::int64_t v = b.assignment.vocab.begin; v < b.assignment.vocab.end; ++v) f(b, g, i, v);
    }
  }
}

// buggy = ratio(rank, row) x correct, elementwise; returns how many nonzero elements were compared.
std::int64_t check_grad_ratio(const RankRun& buggy, const RankRun& right,
                              const std::function<double(const RankOutput&, std::int64_t)>& ratio,
                              double rtol = kRatioRtol) {
  std::int64_t compared = 0;
  for_each_element(buggy, right, [&](const RankOutput& b, const RankOutput& g, std::int64_t i, std::int64_t v) {
    const double expected = ratio(b, i) * g.grad_at(i, v);
    if (g.grad_at(i, v) == 0.0) {
      CHECK(b.grad_at(i, v) == 0.0);  // masked rows stay exactly 0
      return;
    }
    ++compared;
    if (std::fabs(b.grad_at(i, v) - expected) > rtol * std::fabs(expected)) {
      CAPTURE(b.assignment.world_rank);
      CAPTURE(b.token_of(i));
      CAPTURE(v);
      CHECK(b.grad_at(i, v) == doctest::Approx(expected).epsilon(rtol));
    }
  });
  return compared;
}

std::int64_t global_valid_tokens(const Case& c, const InputSource& inputs) {
  std::int64_t n = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) n += inputs.is_valid(t);
  return n;
}

// Valid tokens among a rank's rows (all micro-batches).
std::int64_t rank_valid_tokens(const RankOutput& out, const InputSource& inputs) {
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < out.rows(); ++i) n += out.token_of(i) >= 0 && inputs.is_valid(out.token_of(i));
  return n;
}

nlohmann::json kd_json(std::int64_t tokens, std::int64_t vocab, int tp, double temperature) {
  auto j = testing::case_json(tokens, vocab, tp);
  j["loss"] = {{"kind", "kd"}, {"temperature", temperature}};
  j["inputs"]["teacher"] = {{"mean", 0.5}, {"scale", 3.0}};
  return j;
}

// H(softmax(z / T)) = -sum_v P_v log P_v, in double.
double entropy_of_softmax(const std::vector<double>& z, double temperature) {
  double m = z[0] / temperature;
  for (double zv : z) m = std::max(m, zv / temperature);
  double s = 0.0;
  for (double zv : z) s += std::exp(zv / temperature - m);
  const double lse = m + std::log(s);
  double entropy = 0.0;
  for (double zv : z) entropy -= std::exp(zv / temperature - lse) * (zv / temperature - lse);
  return entropy;
}

}  // namespace

TEST_CASE("full_vocab_through_tp_adds_ln_tp_to_every_token_loss_and_divides_non_target_gradients_by_tp") {
  for (int tp : {2, 3, 4}) {
    CAPTURE(tp);
    auto j = testing::case_json(24, 203, tp);  // alpha = 0, z-loss 0 (the defaults)
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const RankRun buggy = ranks_of(c, inputs, "full-vocab-through-tp");
    const double ln_tp = std::log(static_cast<double>(tp));
    for (std::size_t k = 0; k < right.outputs.size(); ++k) {
      const RankOutput& b = buggy.outputs[k];
      const RankOutput& g = right.outputs[k];
      for (std::int64_t i = 0; i < g.rows(); ++i) {
        CAPTURE(g.token_of(i));
        // float32 losses below 16 (ulp 9.5e-7), each a few roundings off (measured up to 9.6e-7): 1e-5 absolute.
        CHECK(std::fabs(static_cast<double>(b.token_loss[static_cast<std::size_t>(i)]) -
                        static_cast<double>(g.token_loss[static_cast<std::size_t>(i)]) - ln_tp) <= 1e-5);
      }
    }
    // Off the target column the gradient is p / TP: p comes from exp(x - M - log(TP S)), whose float32
    // log differs from log S + ln TP by an ulp of lse (measured up to 1.1e-6 relative after exp): 1e-5.
    std::int64_t compared = 0;
    for_each_element(buggy, right, [&](const RankOutput& b, const RankOutput& g, std::int64_t i, std::int64_t v) {
      if (v == inputs.label(g.token_of(i))) return;
      ++compared;
      const double expected = g.grad_at(i, v) / tp;
      if (std::fabs(b.grad_at(i, v) - expected) > 1e-5 * std::fabs(expected)) {
        CHECK(b.grad_at(i, v) == doctest::Approx(expected).epsilon(1e-5));
      }
    });
    CHECK(compared == 24 * 202);
  }
}

TEST_CASE("kd_no_t2_and_kd_double_t2_scale_kd_loss_and_gradient_by_inverse_t2_and_t2") {
  for (double temperature : {2.0, 0.7}) {
    CAPTURE(temperature);
    const Case c = testing::make_case(kd_json(24, 101, 2, temperature));
    REQUIRE(kd_options(c.loss).t2_scaling);
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const double t2 = temperature * temperature;
    for (const auto& [name, ratio] : std::map<std::string, double>{{"kd-no-t2", 1.0 / t2}, {"kd-double-t2", t2}}) {
      CAPTURE(name);
      const RankRun buggy = ranks_of(c, inputs, name);
      // At T = 2 the ratio is a power of two: float32 carries it exactly.
      const double rtol = temperature == 2.0 ? 0.0 : kRatioRtol;
      CHECK(check_grad_ratio(
                buggy, right, [&](const RankOutput&, std::int64_t) { return ratio; }, rtol) == 24 * 101);
      for (std::size_t k = 0; k < right.outputs.size(); ++k) {
        for (std::size_t i = 0; i < right.outputs[k].token_loss.size(); ++i) {
          const double expected = ratio * static_cast<double>(right.outputs[k].token_loss[i]);
          CHECK(static_cast<double>(buggy.outputs[k].token_loss[i]) ==
                doctest::Approx(expected).epsilon(std::max(rtol, 1e-15)));
        }
      }
    }
  }
}

TEST_CASE("kd_cross_entropy_value_reports_t2_times_the_teacher_entropy_when_student_equals_teacher") {
  for (double temperature : {1.0, 2.0, 0.7}) {
    CAPTURE(temperature);
    auto j = kd_json(16, 97, 2, temperature);
    j["inputs"]["teacher"] = {{"same_as_student", true}};
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const RankRun buggy = ranks_of(c, inputs, "kd-cross-entropy-value");
    std::vector<double> x(97);
    for (std::size_t k = 0; k < right.outputs.size(); ++k) {
      const RankOutput& b = buggy.outputs[k];
      const RankOutput& g = right.outputs[k];
      CHECK(g.reduced_loss == 0.0f);
      CHECK(b.reduced_loss > 0.0f);
      for (std::int64_t i = 0; i < g.rows(); ++i) {
        CAPTURE(g.token_of(i));
        // KL(P || P) = 0 exactly: equal packed sums and maxima make every term of kl_from_sums 0.
        CHECK(g.token_loss[static_cast<std::size_t>(i)] == 0.0f);
        // H(P, P) = H(P) with P = softmax(x / T), in double from the rounded inputs.
        inputs.logits(g.token_of(i), 0, 97, x.data());
        const double expected = temperature * temperature * entropy_of_softmax(x, temperature);
        CHECK(b.token_loss[static_cast<std::size_t>(i)] > 0.0f);
        // float32 lane sums over 97 terms of an O(ln V) quantity (measured error ~3e-7): 1e-5 relative.
        CHECK(static_cast<double>(b.token_loss[static_cast<std::size_t>(i)]) ==
              doctest::Approx(expected).epsilon(1e-5));
      }
    }
    // The gradient is right: Q - P = 0 exactly in both.
    for (std::size_t k = 0; k < right.outputs.size(); ++k) {
      CHECK(buggy.outputs[k].grad == right.outputs[k].grad);
      for (std::int64_t i = 0; i < right.outputs[k].rows(); ++i) {
        for (std::int64_t v = right.outputs[k].assignment.vocab.begin; v < right.outputs[k].assignment.vocab.end; ++v) {
          CHECK(right.outputs[k].grad_at(i, v) == 0.0);
        }
      }
    }
  }
}

TEST_CASE("kd_cross_entropy_value_adds_t2_times_the_teacher_entropy_to_the_loss_and_leaves_the_gradient_right") {
  // H(P, Q) = KL(P || Q) + H(P): with a teacher unlike the student the loss is off by T^2 H(P), P the teacher's.
  const double temperature = 2.0;
  const Case c = testing::make_case(kd_json(16, 97, 2, temperature));
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "kd-cross-entropy-value");
  std::vector<double> y(97);
  for (std::size_t k = 0; k < right.outputs.size(); ++k) {
    const RankOutput& b = buggy.outputs[k];
    const RankOutput& g = right.outputs[k];
    CHECK(b.grad == g.grad);  // the backward never used the reported value
    for (std::int64_t i = 0; i < g.rows(); ++i) {
      CAPTURE(g.token_of(i));
      inputs.teacher_logits(g.token_of(i), 0, 97, y.data());
      const double expected = temperature * temperature * entropy_of_softmax(y, temperature);
      const double got = static_cast<double>(b.token_loss[static_cast<std::size_t>(i)]) -
                         static_cast<double>(g.token_loss[static_cast<std::size_t>(i)]);
      // Both float32 losses are O(T^2 ln V): 1e-5 of the larger.
      CHECK(std::fabs(got - expected) <=
            1e-5 * std::fabs(static_cast<double>(b.token_loss[static_cast<std::size_t>(i)])));
    }
  }
}

TEST_CASE("overwrites_input_hands_over_the_softmax_as_the_gradient_and_leaves_the_loss_right") {
  // The softmax p of every row, rounded to the output dtype, where the gradient should be: rows sum to ~1.
  auto j = testing::case_json(16, 97, 2);
  j["loss"] = {{"label_smoothing", 0.1}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "overwrites-input");
  std::vector<double> x(97);
  std::vector<double> row_sum(16, 0.0);
  for (std::size_t k = 0; k < right.outputs.size(); ++k) {
    CHECK(buggy.outputs[k].token_loss == right.outputs[k].token_loss);
    CHECK(buggy.outputs[k].reduced_loss == right.outputs[k].reduced_loss);
  }
  for_each_element(buggy, right, [&](const RankOutput& b, const RankOutput&, std::int64_t i, std::int64_t v) {
    const std::int64_t t = b.token_of(i);
    inputs.logits(t, 0, 97, x.data());
    double m = x[0], s = 0.0;
    for (double xv : x) m = std::max(m, xv);
    for (double xv : x) s += std::exp(xv - m);
    const double p = std::exp(x[static_cast<std::size_t>(v)] - m) / s;
    CHECK(b.grad_at(i, v) == doctest::Approx(p).epsilon(1e-5));  // float32 exp and sums
    row_sum[static_cast<std::size_t>(t)] += b.grad_at(i, v);
  });
  for (double sum : row_sum) CHECK(sum == doctest::Approx(1.0).epsilon(1e-5));
}

TEST_CASE("mtp_local_count_ratio_weights_each_micro_batch_by_its_local_main_over_mtp_counts") {
  // Megatron's per-token MTP: weight (N_rk + E_rk) / (N_rk (N_v + S)) where the reference has 1 / N_v.
  auto j = testing::case_json(0, 97, 2);
  j["shape"].erase("tokens");
  j["batch"] = {{"sequence_lengths", {23, 4, 6, 17, 3, 11}}, {"labels", "next_token"}};
  j["inputs"]["ignore_fraction"] = 0.1;
  j["layout"] = {{"tp", 2}, {"dp", 2}, {"ga", 2}};
  j["framework"] = {{"grad_reduce", "sum"}, {"ga_reduce", "sum"}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "mtp-local-count-ratio");
  const auto valid_total = static_cast<double>(global_valid_tokens(c, inputs));
  const auto sequences = static_cast<double>(inputs.batch().sequences().size());
  auto ratio = [&](const RankOutput& out, std::int64_t row) {
    const auto& begin = out.assignment.micro_batch_begin;
    std::size_t k = 0;
    while (begin[k + 1] <= row) ++k;
    double valid = 0.0, ends = 0.0;
    for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i) {
      const LocalRow& r = out.assignment.rows[static_cast<std::size_t>(i)];
      if (r.token < 0) continue;
      valid += inputs.is_valid(r.token);
      ends += r.position == inputs.batch().sequences()[static_cast<std::size_t>(r.sequence)].length - 1;
    }
    return (valid + ends) / (valid * (valid_total + sequences)) * valid_total;
  };
  CHECK(check_grad_ratio(buggy, right, ratio) > 0);
  // Unequal counts make some micro-batch's ratio differ from 1 by far more than rounding.
  bool off = false;
  for (const RankOutput& out : buggy.outputs) {
    for (std::int64_t i = 0; i < out.rows(); ++i) off = off || std::fabs(ratio(out, i) - 1.0) > 0.05;
  }
  CHECK(off);
}

TEST_CASE("mtp_local_count_ratio_at_cp_2_counts_each_cp_rank_s_own_main_loss_tokens") {
  // At CP > 1 process_mtp_loss rolls the main mask across the chunk boundaries and counts this CP rank's part:
  // the main mask at position p is the MTP (case) mask at p - 1 and position 0 is valid, over the padded
  // sequence. The weight of a micro-batch is (its main count / its MTP count) / (the step's main count).
  auto j = testing::case_json(0, 97, 2);
  j["shape"].erase("tokens");
  j["batch"] = {{"sequence_lengths", {23, 4, 6, 17, 3, 11}}, {"labels", "next_token"}};
  j["inputs"]["ignore_fraction"] = 0.4;  // masked tokens at chunk boundaries move counts between CP ranks
  j["layout"] = {{"tp", 1}, {"cp", 2}, {"dp", 1}, {"ga", 2}};
  j["framework"] = {{"grad_reduce", "sum"}, {"ga_reduce", "sum"}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "mtp-local-count-ratio");
  const auto valid_total = static_cast<double>(global_valid_tokens(c, inputs));
  auto main_valid = [&](const LocalRow& r) {
    const Sequence& seq = inputs.batch().sequences()[static_cast<std::size_t>(r.sequence)];
    return r.position == 0 || (r.position - 1 < seq.length && inputs.is_valid(seq.begin + r.position - 1));
  };
  double main_total = 0.0;
  for (const RankOutput& out : buggy.outputs) {
    for (const LocalRow& r : out.assignment.rows) main_total += main_valid(r);
  }
  auto ratio = [&](const RankOutput& out, std::int64_t row) {
    const auto& begin = out.assignment.micro_batch_begin;
    std::size_t k = 0;
    while (begin[k + 1] <= row) ++k;
    double valid = 0.0, main = 0.0;
    for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i) {
      const LocalRow& r = out.assignment.rows[static_cast<std::size_t>(i)];
      main += main_valid(r);
      valid += r.token >= 0 && inputs.is_valid(r.token);
    }
    return main / (valid * main_total) * valid_total;
  };
  CHECK(main_total == doctest::Approx(valid_total + 6.0));  // one more main token per sequence, over the step
  CHECK(check_grad_ratio(buggy, right, ratio) > 0);
}

TEST_CASE("kd_tp_grad_sum_multiplies_every_gradient_element_by_tp_and_leaves_the_loss_right") {
  // fp32, T = 3: the switch scales the gradient's float32 factor T^(s-1) by TP, exact for TP = 2 and 4.
  for (int tp : {2, 4}) {
    CAPTURE(tp);
    const Case c = testing::make_case(kd_json(24, 203, tp, 3.0));
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const RankRun buggy = ranks_of(c, inputs, "kd-tp-grad-sum");
    CHECK(check_grad_ratio(
              buggy, right, [&](const RankOutput&, std::int64_t) { return tp; }, 0.0) > 0);
    for (std::size_t k = 0; k < right.outputs.size(); ++k) {
      CHECK(buggy.outputs[k].token_loss == right.outputs[k].token_loss);
      CHECK(buggy.outputs[k].reduced_loss == right.outputs[k].reduced_loss);
    }
  }
}

TEST_CASE("kd_untracked_allreduce_keeps_row_sums_at_zero_while_elements_follow_the_pr_1499_formula") {
  // T = 2: a = x / 2 is exact in float32, so the local argmax of the kernel is the argmax of x.
  const double temperature = 2.0;
  const int tp = 4;
  const std::int64_t vocab = 203;
  const std::int64_t tokens = 16;
  const Case c = testing::make_case(kd_json(tokens, vocab, tp, temperature));
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "kd-untracked-allreduce");
  const double weight = 1.0 / static_cast<double>(tokens);  // mean over all-valid tokens
  const double grad_scale = weight * temperature;           // w T^(s-1), s = 2
  // float32 compute of values |g| <= 1 in units of w T^(s-1): 1e-5 of that unit is ~100 roundings.
  const double tol = 1e-5 * grad_scale;
  std::vector<double> x(static_cast<std::size_t>(vocab)), y(static_cast<std::size_t>(vocab));
  for (std::int64_t t = 0; t < tokens; ++t) {
    CAPTURE(t);
    inputs.logits(t, 0, vocab, x.data());
    inputs.teacher_logits(t, 0, vocab, y.data());
    double max_a = -INFINITY, max_b = -INFINITY;
    for (std::int64_t v = 0; v < vocab; ++v) {
      max_a = std::max(max_a, x[static_cast<std::size_t>(v)] / temperature);
      max_b = std::max(max_b, y[static_cast<std::size_t>(v)] / temperature);
    }
    double sa = 0.0, sb = 0.0;
    for (std::int64_t v = 0; v < vocab; ++v) {
      sa += std::exp(x[static_cast<std::size_t>(v)] / temperature - max_a);
      sb += std::exp(y[static_cast<std::size_t>(v)] / temperature - max_b);
    }
    auto q = [&](std::int64_t v) { return std::exp(x[static_cast<std::size_t>(v)] / temperature - max_a) / sa; };
    auto p = [&](std::int64_t v) { return std::exp(y[static_cast<std::size_t>(v)] / temperature - max_b) / sb; };
    double row_sum = 0.0;
    double abs_sum = 0.0;
    double max_error = 0.0;
    for (int r = 0; r < tp; ++r) {
      const RankOutput& b = buggy.outputs[static_cast<std::size_t>(r)];
      const RankOutput& g = right.outputs[static_cast<std::size_t>(r)];
      REQUIRE(b.token_of(t) == t);
      const VocabRange shard = b.assignment.vocab;
      double shard_p = 0.0, shard_q = 0.0;
      std::int64_t argmax = shard.begin;
      for (std::int64_t v = shard.begin; v < shard.end; ++v) {
        shard_p += p(v);
        shard_q += q(v);
        if (x[static_cast<std::size_t>(v)] > x[static_cast<std::size_t>(argmax)]) argmax = v;
      }
      for (std::int64_t v = shard.begin; v < shard.end; ++v) {
        // g_j = P_r Q_j - P_j + [j = local argmax] P_r (1 - Q_r)   (docs/spec.md §7)
        double expected = shard_p * q(v) - p(v);
        if (v == argmax) expected += shard_p * (1.0 - shard_q);
        CAPTURE(v);
        CHECK(std::fabs(b.grad_at(t, v) - grad_scale * expected) <= tol);
        row_sum += b.grad_at(t, v);
        abs_sum += std::fabs(b.grad_at(t, v));
        max_error = std::max(max_error, std::fabs(b.grad_at(t, v) - g.grad_at(t, v)));
      }
    }
    // Row sums over the whole vocabulary stay 0 (each shard's terms cancel), up to float32 rounding ...
    CHECK(std::fabs(row_sum) <= 1e-5 * abs_sum);
    // ... while elements are wrong far beyond it.
    CHECK(max_error > 100.0 * tol);
  }
}

TEST_CASE("mean_over_all_rows_scales_gradient_and_logged_loss_by_valid_over_non_padding_tokens") {
  // cp = 2 pads the sequences (7 -> 8, 10 -> 12, 5 -> 8); padding rows must not count in N.
  auto j = testing::case_json(0, 64, 2);
  j.erase("shape");
  j["shape"] = {{"vocab", 64}};
  j["batch"] = {{"sequence_lengths", {7, 10, 5}}};
  j["layout"] = {{"tp", 2}, {"cp", 2}};
  j["inputs"]["ignore_fraction"] = 0.25;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "mean-over-all-rows");
  const std::int64_t n = 22;
  REQUIRE(c.shape.tokens == n);
  const std::int64_t n_valid = global_valid_tokens(c, inputs);
  REQUIRE(n_valid < n);
  std::int64_t padding = 0;
  for (const RankOutput& out : right.outputs) {
    for (std::int64_t i = 0; i < out.rows(); ++i) padding += out.token_of(i) < 0;
  }
  CHECK(padding == 2 * 6);  // (1 + 2 + 3) padding rows per TP coordinate
  const double ratio = static_cast<double>(n_valid) / static_cast<double>(n);
  CHECK(check_grad_ratio(buggy, right, [&](const RankOutput&, std::int64_t) { return ratio; }) > 0);
  for (std::size_t k = 0; k < right.outputs.size(); ++k) {
    // A sum of positive float32 terms: relative error below n 2^-24 = 1.3e-6.
    CHECK(static_cast<double>(buggy.outputs[k].reduced_loss) ==
          doctest::Approx(ratio * static_cast<double>(right.outputs[k].reduced_loss)).epsilon(1e-5));
  }
}

TEST_CASE("none_divides_grad_divides_the_gradient_by_the_token_count") {
  auto j = testing::case_json(0, 64, 2);
  j["shape"] = {{"vocab", 64}};
  j["batch"] = {{"sequence_lengths", {7, 10}}};
  j["layout"] = {{"tp", 2}, {"cp", 2}};
  j["loss"] = {{"reduction", "none"},
               {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.25}, {"high", 4.0}}}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "none-divides-grad");
  const double n = 17.0;  // non-padding tokens; the cp = 2 padding (7 -> 8, 10 -> 12) does not count
  CHECK(check_grad_ratio(buggy, right, [&](const RankOutput&, std::int64_t) { return 1.0 / n; }) > 0);
  // The per-token losses are untouched.
  for (std::size_t k = 0; k < right.outputs.size(); ++k)
    CHECK(buggy.outputs[k].token_loss == right.outputs[k].token_loss);
}

TEST_CASE("grad_output_first_scales_row_t_by_g0_over_gt") {
  auto j = testing::case_json(24, 64, 2);
  j["loss"] = {{"reduction", "none"},
               {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.25}, {"high", 4.0}}}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "grad-output-first");
  // One DP rank: every rank's first row is token 0, so g_0 is token 0's upstream weight.
  const double g0 = inputs.upstream_weight(0);
  double smallest = g0, largest = g0;
  for (std::int64_t t = 0; t < 24; ++t) {
    smallest = std::min(smallest, inputs.upstream_weight(t));
    largest = std::max(largest, inputs.upstream_weight(t));
  }
  REQUIRE(largest > 2.0 * smallest);  // non-uniform weights, or the bug would hide
  CHECK(check_grad_ratio(buggy, right, [&](const RankOutput& out, std::int64_t i) {
          return g0 / inputs.upstream_weight(out.token_of(i));
        }) == 24 * 64);
}

TEST_CASE("dp_local_mean_gives_token_weight_1_over_r_n_r_with_unequal_rank_counts") {
  // Halving sequences 32/16/8/4, round robin over dp = 4: rank r holds sequence r, whose next-token labels give
  // N_r = 31, 15, 7, 3 valid tokens (the last position is masked).
  auto j = testing::case_json(0, 64, 2);
  j["shape"] = {{"vocab", 64}};
  j["batch"] = {{"generator", {{"kind", "halving"}, {"count", 4}, {"first", 32}}}};
  j["layout"] = {{"tp", 2}, {"dp", 4}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "dp-local-mean");
  const double scale = c.framework.gradient_scale(c.layout);  // 1/4: gradients averaged over DP x CP
  const double ranks = static_cast<double>(c.layout.dp) * c.layout.cp;
  const double n_valid = static_cast<double>(global_valid_tokens(c, inputs));
  CHECK(n_valid == 31 + 15 + 7 + 3);
  std::map<int, std::int64_t> counts;
  for (const RankOutput& out : right.outputs) counts[out.assignment.coordinates.dp] = rank_valid_tokens(out, inputs);
  CHECK(counts == std::map<int, std::int64_t>{{0, 31}, {1, 15}, {2, 7}, {3, 3}});
  // Effective gradient = scale x local. The correct one is (1/N_v) dl/dx, so dl/dx = N_v scale g, and the buggy
  // effective gradient must be 1/(R N_r) dl/dx.
  std::int64_t compared = 0;
  for_each_element(buggy, right, [&](const RankOutput& b, const RankOutput& g, std::int64_t i, std::int64_t v) {
    const double token_gradient = n_valid * scale * g.grad_at(i, v);
    if (token_gradient == 0.0) return;
    ++compared;
    const double n_r = static_cast<double>(counts[b.assignment.coordinates.dp]);
    const double expected = token_gradient / (ranks * n_r);
    if (std::fabs(scale * b.grad_at(i, v) - expected) > kRatioRtol * std::fabs(expected)) {
      CHECK(scale * b.grad_at(i, v) == doctest::Approx(expected).epsilon(kRatioRtol));
    }
  });
  CHECK(compared == 56 * 64);
  // The logged loss is the average of the ranks' own means: sum_t l_t / (R N_r(t)).
  double expected_loss = 0.0;
  for (const RankOutput& out : right.outputs) {
    if (out.assignment.coordinates.tp != 0) continue;
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      expected_loss += static_cast<double>(out.token_loss[static_cast<std::size_t>(i)]) /
                       (ranks * static_cast<double>(counts[out.assignment.coordinates.dp]));
    }
  }
  for (const RankOutput& out : buggy.outputs) {
    CHECK(static_cast<double>(out.reduced_loss) == doctest::Approx(expected_loss).epsilon(1e-5));
    CHECK(static_cast<double>(out.reduced_loss) !=
          doctest::Approx(static_cast<double>(right.outputs[0].reduced_loss)).epsilon(1e-3));
  }
}

TEST_CASE("ga_microbatch_mean_gives_token_weight_1_over_ga_n_k") {
  // Halving 16/8/4/2 round robin over one DP rank and ga = 2: micro-batch 0 holds sequences 0 and 2 (15 + 3 valid),
  // micro-batch 1 sequences 1 and 3 (7 + 1 valid).
  auto j = testing::case_json(0, 48, 1);
  j["shape"] = {{"vocab", 48}};
  j["batch"] = {{"generator", {{"kind", "halving"}, {"count", 4}, {"first", 16}}}};
  j["layout"] = {{"tp", 1}, {"ga", 2}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "ga-microbatch-mean");
  const double n_valid = static_cast<double>(global_valid_tokens(c, inputs));
  REQUIRE(n_valid == 26.0);
  const RankOutput& out = right.outputs[0];
  const std::int64_t split = out.assignment.micro_batch_begin[1];
  CHECK(check_grad_ratio(buggy, right, [&](const RankOutput&, std::int64_t i) {
          const double n_k = i < split ? 18.0 : 8.0;
          return n_valid / (2.0 * n_k);  // (1/(GA N_k)) / (1/N_v)
        }) > 0);
}

// The valid tokens of each micro-batch of a rank's rows, from the inputs (not from the implementation's plan).
std::vector<std::int64_t> micro_batch_valid_tokens(const RankOutput& out, const InputSource& inputs) {
  const auto& begin = out.assignment.micro_batch_begin;
  std::vector<std::int64_t> n(begin.size() - 1, 0);
  for (std::size_t k = 0; k + 1 < begin.size(); ++k) {
    for (std::int64_t i = begin[k]; i < begin[k + 1]; ++i)
      n[k] += out.token_of(i) >= 0 && inputs.is_valid(out.token_of(i));
  }
  return n;
}

std::size_t micro_batch_of(const RankOutput& out, std::int64_t row) {
  const auto& begin = out.assignment.micro_batch_begin;
  std::size_t k = 0;
  while (row >= begin[k + 1]) ++k;
  return k;
}

TEST_CASE("microbatch_local_mean_gives_token_weight_1_over_dp_cp_ga_n_rk") {
  // Halving sequences 32/16/8/4 round robin over dp = 2 and ga = 2, each split over cp = 2: rank (dp, cp) holds
  // in micro-batch k its two chunks of one sequence, so n(r, k) differs between every rank and micro-batch.
  auto j = testing::case_json(0, 64, 2);
  j["shape"] = {{"vocab", 64}};
  j["batch"] = {{"generator", {{"kind", "halving"}, {"count", 4}, {"first", 32}}}};
  j["layout"] = {{"tp", 2}, {"cp", 2}, {"dp", 2}, {"ga", 2}};
  j["framework"] = {{"grad_reduce", "avg"}, {"ga_reduce", "sum"}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "microbatch-local-mean");
  const double scale = c.framework.gradient_scale(c.layout);  // 1/(DP CP)
  const double divisor = static_cast<double>(c.layout.dp) * c.layout.cp * c.layout.ga;
  const double n_valid = static_cast<double>(global_valid_tokens(c, inputs));
  std::map<int, std::vector<std::int64_t>> counts;  // world rank -> n(r, k)
  std::set<std::int64_t> distinct;
  for (const RankOutput& out : right.outputs) {
    counts[out.assignment.world_rank] = micro_batch_valid_tokens(out, inputs);
    for (std::int64_t n : counts[out.assignment.world_rank]) distinct.insert(n);
  }
  REQUIRE(distinct.size() >= 4);  // unequal counts, or the bug would hide
  // The correct effective gradient is (1/N_v) dl/dx; the buggy one must be dl/dx / (DP CP GA n(r, k)).
  std::int64_t compared = 0;
  for_each_element(buggy, right, [&](const RankOutput& b, const RankOutput& g, std::int64_t i, std::int64_t v) {
    const double token_gradient = n_valid * scale * g.grad_at(i, v);
    if (token_gradient == 0.0) return;
    ++compared;
    const double n_rk = static_cast<double>(counts[b.assignment.world_rank][micro_batch_of(b, i)]);
    const double expected = token_gradient / (divisor * n_rk);
    if (std::fabs(scale * b.grad_at(i, v) - expected) > kRatioRtol * std::fabs(expected)) {
      CAPTURE(b.assignment.world_rank);
      CHECK(scale * b.grad_at(i, v) == doctest::Approx(expected).epsilon(kRatioRtol));
    }
  });
  CHECK(compared == static_cast<std::int64_t>(n_valid) * 64);
  // The logged loss: sum_t l_t / (DP CP GA n(r(t), k(t))).
  double expected_loss = 0.0;
  for (const RankOutput& out : right.outputs) {
    if (out.assignment.coordinates.tp != 0) continue;
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      if (out.token_of(i) < 0 || !inputs.is_valid(out.token_of(i))) continue;
      expected_loss += static_cast<double>(out.token_loss[static_cast<std::size_t>(i)]) /
                       (divisor * static_cast<double>(counts[out.assignment.world_rank][micro_batch_of(out, i)]));
    }
  }
  for (const RankOutput& out : buggy.outputs) {
    CHECK(static_cast<double>(out.reduced_loss) == doctest::Approx(expected_loss).epsilon(1e-5));
    CHECK(static_cast<double>(out.reduced_loss) !=
          doctest::Approx(static_cast<double>(right.outputs[0].reduced_loss)).epsilon(1e-3));
  }
}

TEST_CASE("microbatch_local_mean_equals_dp_local_mean_at_ga_1") {
  auto j = testing::case_json(0, 64, 2);
  j["shape"] = {{"vocab", 64}};
  j["batch"] = {{"generator", {{"kind", "halving"}, {"count", 4}, {"first", 32}}}};
  j["layout"] = {{"tp", 2}, {"cp", 2}, {"dp", 2}};
  for (const char* ga_reduce : {"sum", "mean"}) {
    for (const char* grad_reduce : {"avg", "sum"}) {
      CAPTURE(ga_reduce);
      CAPTURE(grad_reduce);
      j["framework"] = {{"grad_reduce", grad_reduce}, {"ga_reduce", ga_reduce}};
      const Case c = testing::make_case(j);
      const InputSource inputs(c);
      const RankRun dp_local = ranks_of(c, inputs, "dp-local-mean");
      const RankRun mine = ranks_of(c, inputs, "microbatch-local-mean");
      CHECK(check_grad_ratio(mine, dp_local, [](const RankOutput&, std::int64_t) { return 1.0; }) > 0);
      for (std::size_t k = 0; k < mine.outputs.size(); ++k) {
        CHECK(mine.outputs[k].reduced_loss == doctest::Approx(dp_local.outputs[k].reduced_loss).epsilon(1e-6));
      }
    }
  }
  // At ga = 2 they part: each micro-batch has its own count.
  j["layout"]["ga"] = 2;
  j["framework"] = {{"grad_reduce", "avg"}, {"ga_reduce", "sum"}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  CHECK(ranks_of(c, inputs, "microbatch-local-mean").outputs[0].reduced_loss !=
        doctest::Approx(ranks_of(c, inputs, "dp-local-mean").outputs[0].reduced_loss).epsilon(1e-3));
}

TEST_CASE("cp_duplicated_loss_multiplies_the_effective_gradient_by_cp") {
  for (int cp : {2, 3}) {
    CAPTURE(cp);
    auto j = testing::case_json(0, 64, 2);
    j["shape"] = {{"vocab", 64}};
    j["batch"] = {{"sequence_lengths", {9, 14, 6}}};
    j["layout"] = {{"tp", 2}, {"cp", cp}};
    j["inputs"]["ignore_fraction"] = 0.1;
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const RankRun buggy = ranks_of(c, inputs, "cp-duplicated-loss");
    // Same framework scale on both sides, so effective ratio = local ratio; CP = 2 is exact in float32.
    CHECK(check_grad_ratio(
              buggy, right, [&](const RankOutput&, std::int64_t) { return static_cast<double>(cp); },
              cp == 2 ? 0.0 : kRatioRtol) > 0);
    // The logged loss is not touched: only the backward is duplicated.
    for (std::size_t k = 0; k < right.outputs.size(); ++k)
      CHECK(buggy.outputs[k].reduced_loss == right.outputs[k].reduced_loss);
  }
}

TEST_CASE("cp_stats_dp_only_logs_the_valid_count_of_one_cp_rank_instead_of_the_global_count") {
  auto j = testing::case_json(0, 32, 1);
  j["shape"] = {{"vocab", 32}};
  j["batch"] = {{"sequence_lengths", {9, 14, 6, 11}}};
  j["layout"] = {{"tp", 1}, {"cp", 2}, {"dp", 2}};
  j["inputs"]["ignore_fraction"] = 0.1;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  const RankRun right = ranks_of(c, inputs, "correct");
  const RankRun buggy = ranks_of(c, inputs, "cp-stats-dp-only");
  const std::int64_t n_valid = global_valid_tokens(c, inputs);
  // Valid tokens held by each CP coordinate, summed over DP: what a DP-only reduction yields.
  std::map<int, std::int64_t> per_cp;
  for (const RankOutput& out : right.outputs) per_cp[out.assignment.coordinates.cp] += rank_valid_tokens(out, inputs);
  REQUIRE(per_cp.size() == 2);
  CHECK(per_cp[0] + per_cp[1] == n_valid);
  for (std::size_t k = 0; k < right.outputs.size(); ++k) {
    CHECK(right.outputs[k].logged_valid_tokens == n_valid);
    CHECK(buggy.outputs[k].logged_valid_tokens == per_cp[buggy.outputs[k].assignment.coordinates.cp]);
    CHECK(buggy.outputs[k].logged_valid_tokens != n_valid);
    // The loss and gradient are right: only the statistic is wrong.
    CHECK(buggy.outputs[k].reduced_loss == right.outputs[k].reduced_loss);
    CHECK(buggy.outputs[k].grad == right.outputs[k].grad);
  }
}

TEST_CASE("rl_schedule_double_divide_divides_every_cross_entropy_and_kd_gradient_by_ga_and_leaves_the_loss_right") {
  // AReaL #1273 (the SFT loss of PR #1223 at 430a1f9c too): the loss is normalised over the whole step, and the
  // schedule divides it by the micro-batch count once more before backward. Every gradient element is 1/GA of
  // the correct one (exactly at GA = 2 and 4, whose powers of two float32 carries), the logged loss is right.
  auto ce = testing::case_json(0, 64, 2);
  ce["shape"] = {{"vocab", 64}};
  ce["batch"] = {{"sequence_lengths", {9, 14, 6, 11, 7, 12}}};
  ce["inputs"]["ignore_fraction"] = 0.1;
  ce["loss"] = {{"label_smoothing", 0.1}};
  auto kd = kd_json(0, 64, 2, 2.0);
  kd["shape"] = ce["shape"];
  kd["batch"] = ce["batch"];
  for (const auto& [kind, document] : std::map<std::string, nlohmann::json>{{"cross_entropy", ce}, {"kd", kd}}) {
    for (int ga : {2, 3}) {
      CAPTURE(kind);
      CAPTURE(ga);
      nlohmann::json j = document;
      j["layout"] = {{"tp", 2}, {"dp", 1}, {"ga", ga}};
      const Case c = testing::make_case(j);
      const InputSource inputs(c);
      const RankRun right = ranks_of(c, inputs, "correct");
      const RankRun buggy = ranks_of(c, inputs, "rl-schedule-double-divide");
      CHECK(check_grad_ratio(
                buggy, right, [&](const RankOutput&, std::int64_t) { return 1.0 / ga; }, ga == 2 ? 0.0 : kRatioRtol) >
            0);
      for (std::size_t k = 0; k < right.outputs.size(); ++k) {
        CHECK(buggy.outputs[k].token_loss == right.outputs[k].token_loss);
        CHECK(buggy.outputs[k].reduced_loss == right.outputs[k].reduced_loss);
      }
      const RunResult r = testing::run_with(c, "rl-schedule-double-divide");
      CHECK(r.verdict == Verdict::fail);
      CHECK(testing::check_named(r, "grad").verdict == Verdict::fail);
      CHECK(testing::check_named(r, "loss").verdict == Verdict::pass);
    }
  }
}

TEST_CASE("cp_loss_stat_dp_only_logs_each_cp_rank_s_own_slice_mean_over_dp_and_leaves_gradients_right") {
  // AReaL PR #1223 (430a1f9c): the stats tracker records the CP-split per-token losses and their mask and
  // reduces them over DP only, so CP rank c logs sum_{t in slice c} l_t / N_c (the slice's tokens over every
  // DP rank) instead of sum_t l_t / N_v; under reduction sum, its slice's sum.
  for (const std::string reduction : {"mean", "sum"}) {
    CAPTURE(reduction);
    auto j = testing::case_json(0, 64, 1);
    j["shape"] = {{"vocab", 64}};
    j["batch"] = {{"sequence_lengths", {9, 14, 6, 11, 21, 5}}};
    j["layout"] = {{"tp", 2}, {"cp", 2}, {"dp", 2}};
    j["inputs"]["ignore_fraction"] = 0.2;
    j["loss"] = {{"reduction", reduction}};
    const Case c = testing::make_case(j);
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const RankRun buggy = ranks_of(c, inputs, "cp-loss-stat-dp-only");
    // Per CP coordinate, over its DP ranks (one TP rank: the TP ranks of a token log the same loss): the
    // slice's valid tokens and the sum of their losses, in double.
    std::map<int, double> count, sum;
    for (const RankOutput& out : right.outputs) {
      if (out.assignment.coordinates.tp != 0) continue;
      for (std::int64_t i = 0; i < out.rows(); ++i) {
        const std::int64_t t = out.token_of(i);
        if (t < 0 || !inputs.is_valid(t)) continue;
        count[out.assignment.coordinates.cp] += 1.0;
        sum[out.assignment.coordinates.cp] += static_cast<double>(out.token_loss[static_cast<std::size_t>(i)]);
      }
    }
    REQUIRE(count.size() == 2);
    CHECK(count[0] + count[1] == static_cast<double>(global_valid_tokens(c, inputs)));
    for (std::size_t k = 0; k < right.outputs.size(); ++k) {
      const RankOutput& b = buggy.outputs[k];
      const int cp = b.assignment.coordinates.cp;
      const double expected = reduction == "mean" ? sum[cp] / count[cp] : sum[cp];
      CAPTURE(cp);
      // A float32 sum of about 60 positive terms: 1e-5 relative.
      CHECK(static_cast<double>(b.reduced_loss) == doctest::Approx(expected).epsilon(1e-5));
      CHECK(static_cast<double>(b.reduced_loss) !=
            doctest::Approx(static_cast<double>(right.outputs[k].reduced_loss)).epsilon(1e-3));
      // The gradients, the per-token losses and the logged count are right: only the logged loss is wrong.
      CHECK(b.grad == right.outputs[k].grad);
      CHECK(b.token_loss == right.outputs[k].token_loss);
      CHECK(b.logged_valid_tokens == right.outputs[k].logged_valid_tokens);
    }
    const RunResult r = testing::run_with(c, "cp-loss-stat-dp-only");
    CHECK(r.verdict == Verdict::fail);
    for (const CheckResult& check : r.checks) {
      CAPTURE(check.name);
      CHECK((check.verdict == Verdict::fail) == (check.name == "loss"));
    }
  }
}

namespace {

// Where a catalogued bug cannot show. Every catalogued implementation appears here except kd-cross-entropy-value
// and overwrites-input (their gradients are wrong wherever they apply),
// which shows whenever the teacher's entropy is nonzero (its gradient is right, tested above). `identical`: the switch
// leaves every computed number unchanged (equal outputs, not merely within tolerance); otherwise it only changes
// float32 rounding and the checks pass.
struct Invisible {
  const char* impl;
  const char* why;
  nlohmann::json document;
  bool identical;
};

nlohmann::json with(nlohmann::json j, const nlohmann::json& patch) {
  j.merge_patch(patch);
  return j;
}

std::vector<Invisible> invisible_cases() {
  const nlohmann::json ce = testing::case_json(24, 64, 2);
  const nlohmann::json smoothed =
      with(ce, {{"loss", {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}}}});
  const nlohmann::json kd = kd_json(24, 64, 2, 2.0);
  // Two DP ranks with equal valid counts (12 - 1 each), next-token labels.
  const nlohmann::json equal_dp = with(testing::case_json(0, 64, 1), {{"shape", {{"tokens", 24}, {"vocab", 64}}},
                                                                      {"batch", {{"sequence_lengths", {12, 12}}}},
                                                                      {"layout", {{"tp", 1}, {"dp", 2}}}});
  // CP = 2 on lengths divisible by 2 CP = 4 (no padding), next-token labels.
  const nlohmann::json cp2_aligned = with(testing::case_json(0, 64, 2), {{"shape", {{"tokens", 28}, {"vocab", 64}}},
                                                                         {"batch", {{"sequence_lengths", {8, 12, 8}}}},
                                                                         {"layout", {{"tp", 2}, {"cp", 2}}}});
  const nlohmann::json cp1_next_token =
      with(cp2_aligned, {{"batch", {{"sequence_lengths", {9, 12, 7}}}}, {"layout", {{"cp", 1}}}});
  const nlohmann::json none_weights = {
      {"loss",
       {{"reduction", "none"}, {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.25}, {"high", 4.0}}}}}};
  return {
      // Smoothing bugs need alpha > 0: at alpha = 0 both conventions and every V_p give q = one-hot.
      {"smoothing-partition-vocab", "alpha = 0", ce, true},
      {"smoothing-partition-vocab", "tp = 1: V_p = V", with(smoothed, {{"layout", {{"tp", 1}}}}), true},
      {"smoothing-log-after-exp", "alpha = 0", ce, true},
      {"smoothing-backward-partition", "alpha = 0", ce, true},
      {"smoothing-backward-partition", "tp = 1: V_p = V", with(smoothed, {{"layout", {{"tp", 1}}}}), true},
      {"smoothing-local-sum", "tp = 1: the local shard is the vocabulary (another summation order)",
       with(smoothed, {{"layout", {{"tp", 1}}}}), false},
      {"smoothing-convention-swap", "alpha = 0", ce, true},
      {"zloss-grad-after-smoothing", "z-loss weight 0: the factor is 1", smoothed, true},
      // overwrites-input has no such case: a cross-entropy gradient is never the softmax itself.
      {"zloss-on-ignored", "z-loss weight 0: ignored rows get 0 loss and 0 gradient",
       with(ce, {{"inputs", {{"ignore_fraction", 0.3}}}}), true},
      {"full-vocab-through-tp", "tp = 1: the gathered logits are the shard", with(smoothed, {{"layout", {{"tp", 1}}}}),
       true},
      {"no-max-shift", "logits of scale 2: exp(x) neither overflows nor underflows", ce, false},
      {"ignore-index-unmasked", "no ignored labels", ce, true},
      {"mean-over-all-rows", "no ignored labels and no padding: N_v = N", ce, true},
      {"none-divides-grad", "reduction mean", ce, true},
      {"grad-output-first", "reduction mean", ce, true},
      {"grad-output-first", "reduction none with all g_t = 1", with(ce, {{"loss", {{"reduction", "none"}}}}), true},
      {"grad-rounded-early", "fp32 output: rounding to the output dtype is the identity", with(ce, none_weights), true},
      {"kd-no-t2", "T = 1", with(kd, {{"loss", {{"temperature", 1.0}}}}), true},
      {"kd-double-t2", "T = 1", with(kd, {{"loss", {{"temperature", 1.0}}}}), true},
      {"kd-local-softmax", "tp = 1: the shard's softmax is the softmax", with(kd, {{"layout", {{"tp", 1}}}}), true},
      {"kd-untracked-allreduce", "tp = 1: P_r = Q_r = 1 up to rounding", with(kd, {{"layout", {{"tp", 1}}}}), false},
      {"kd-tp-grad-sum", "tp = 1: the sum over the TP ranks is the one rank's gradient",
       with(kd, {{"layout", {{"tp", 1}}}}), true},
      // Layout bugs need the layout dimension they live in, or unequal counts.
      {"dp-local-mean", "dp = cp = 1: N_r = N_v", ce, true},
      {"dp-local-mean", "dp = 2 with equal valid counts: 1/(2 N_r) = 1/N_v", equal_dp, true},
      {"ga-microbatch-mean", "ga = 1: N_k = N_v", ce, true},
      {"microbatch-local-mean", "dp = cp = ga = 1: n(r, k) = N_v", ce, true},
      {"microbatch-local-mean", "ga = 2 on one rank with equal micro-batch counts",
       with(equal_dp, {{"layout", {{"dp", 1}, {"ga", 2}}}}), true},
      {"mtp-local-count-ratio", "one micro-batch of one sequence: (N_v + 1) / (N_v (N_v + 1)) = 1/N_v", ce, true},
      {"mtp-local-count-ratio", "dp = 2 with equal counts, one sequence each", equal_dp, true},
      {"ga-microbatch-mean", "ga = 2 with equal valid counts", with(equal_dp, {{"layout", {{"dp", 1}, {"ga", 2}}}}),
       true},
      {"cp-duplicated-loss", "cp = 1", cp1_next_token, true},
      {"cp-stats-dp-only", "cp = 1: the DP group is the batch group", with(equal_dp, {{"layout", {{"tp", 2}}}}), true},
      {"cp-loss-stat-dp-only", "cp = 1: the DP group is the batch group, the slice the whole step",
       with(equal_dp, {{"layout", {{"tp", 2}}}}), true},
      {"rl-schedule-double-divide", "ga = 1: dividing by the micro-batch count again divides by 1", ce, true},
      {"rl-schedule-double-divide", "ga = 1 for KD", kd, true},
      {"cp-roll-after-split", "cp = 1: the local rows of a sequence are the whole sequence, in order", cp1_next_token,
       true},
      {"cp-roll-after-split", "independent labels: nothing to roll",
       with(cp2_aligned, {{"batch", {{"labels", "independent"}}}}), true},
      {"cp-pad-to-cp", "lengths divisible by 2 CP: padding to CP or 2 CP is the same", cp2_aligned, true},
  };
}

}  // namespace

TEST_CASE("catalogued_bugs_are_invisible_where_spec_says_they_cannot_show") {
  for (const Invisible& entry : invisible_cases()) {
    CAPTURE(entry.impl);
    CAPTURE(entry.why);
    REQUIRE(find_implementation(entry.impl) != nullptr);
    const Case c = testing::make_case(entry.document);
    const std::string name = entry.impl;
    RunOptions options;
    options.threads = 2;
    options.implementation = name;
    const RunResult r = run_case(c, options);
    CHECK(r.verdict == Verdict::pass);
    for (const auto& check : r.checks) {
      CAPTURE(check.name);
      CHECK(check.verdict != Verdict::fail);
    }
    if (!entry.identical) continue;
    const InputSource inputs(c);
    const RankRun right = ranks_of(c, inputs, "correct");
    const RankRun buggy = ranks_of(c, inputs, name);
    for (std::size_t k = 0; k < right.outputs.size(); ++k) {
      const RankOutput& b = buggy.outputs[k];
      const RankOutput& g = right.outputs[k];
      CHECK(b.token_loss == g.token_loss);
      CHECK(b.has_reduced_loss == g.has_reduced_loss);
      CHECK(b.reduced_loss == g.reduced_loss);
      CHECK(b.logged_valid_tokens == g.logged_valid_tokens);
    }
    // Compared by value so that a -0 and a +0 count as equal.
    std::int64_t differing = 0;
    for_each_element(buggy, right, [&](const RankOutput& b, const RankOutput& g, std::int64_t i, std::int64_t v) {
      differing += b.grad_at(i, v) != g.grad_at(i, v);
    });
    CHECK(differing == 0);
  }
}

TEST_CASE("bugs_invisible_on_one_case_are_caught_once_the_case_can_expose_them") {
  // The other side of invisibility: the same switch is visible once the case can show it.
  const std::vector<std::pair<std::string, nlohmann::json>> exposed = {
      {"smoothing-convention-swap", with(testing::case_json(24, 64, 2), {{"loss", {{"label_smoothing", 0.1}}}})},
      {"kd-local-softmax", kd_json(24, 64, 2, 2.0)},
      {"cp-duplicated-loss", with(testing::case_json(0, 64, 1), {{"shape", {{"tokens", 24}, {"vocab", 64}}},
                                                                 {"batch", {{"sequence_lengths", {12, 12}}}},
                                                                 {"layout", {{"cp", 2}}}})},
      {"cp-roll-after-split", with(testing::case_json(0, 64, 1), {{"shape", {{"tokens", 24}, {"vocab", 64}}},
                                                                  {"batch", {{"sequence_lengths", {12, 12}}}},
                                                                  {"layout", {{"cp", 2}}}})},
      {"cp-pad-to-cp", with(testing::case_json(0, 64, 1), {{"shape", {{"tokens", 21}, {"vocab", 64}}},
                                                           {"batch", {{"sequence_lengths", {10, 11}}}},
                                                           {"layout", {{"cp", 2}}}})},
  };
  for (const auto& [name, document] : exposed) {
    CAPTURE(name);
    RunOptions options;
    options.threads = 2;
    options.implementation = name;
    CHECK(run_case(testing::make_case(document), options).verdict == Verdict::fail);
  }
}
