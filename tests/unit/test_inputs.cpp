#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/layout/vocab_range.hpp"
#include "test_support.hpp"

using namespace lossverify;

TEST_CASE("portable_log_and_sincos_agree_with_the_c_library_to_float64_accuracy") {
  for (int i = 1; i < 20000; ++i) {
    const double u = std::pow(0.9993, i);  // spans (0, 1) down to ~1e-6
    CHECK(std::fabs(detail::portable_log(u) - std::log(u)) <= 4e-16 * std::fabs(std::log(u)) + 1e-16);
  }
  CHECK(detail::portable_log(1.1102230246251565e-16) ==
        doctest::Approx(std::log(1.1102230246251565e-16)).epsilon(1e-15));
  for (int i = 0; i < 20000; ++i) {
    const double turns = (i + 0.5) / 20000.0;
    double s = 0;
    double c = 0;
    detail::portable_sincos_turns(turns, &s, &c);
    CHECK(std::fabs(s - std::sin(2 * M_PI * turns)) < 1e-15);
    CHECK(std::fabs(c - std::cos(2 * M_PI * turns)) < 1e-15);
  }
}

TEST_CASE("generated_logits_have_the_requested_moments") {
  double sum = 0;
  double sum_sq = 0;
  const int n = 200000;
  for (int k = 0; k < n / 2; ++k) {
    double a = 0;
    double b = 0;
    logit_pair(7, InputStream::student_logits, 3, static_cast<std::uint32_t>(k), LogitDistribution::normal, 1.0, 2.0,
               &a, &b);
    sum += a + b;
    sum_sq += (a - 1) * (a - 1) + (b - 1) * (b - 1);
  }
  CHECK(sum / n == doctest::Approx(1.0).epsilon(0.02));
  CHECK(std::sqrt(sum_sq / n) == doctest::Approx(2.0).epsilon(0.01));
}

TEST_CASE("a_shard_generated_by_any_rank_count_is_bit_identical_to_the_whole_row") {
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    const Case c = testing::make_case(testing::case_json(8, 1001, 1, dtype));
    const InputSource inputs(c);
    for (std::int64_t t = 0; t < 8; ++t) {
      std::vector<double> whole(1001);
      inputs.logits(t, 0, 1001, whole.data());
      for (int tp : {1, 2, 3, 4, 7, 8, 13}) {
        for (int r = 0; r < tp; ++r) {
          const VocabRange range = vocab_range(1001, tp, r);
          std::vector<double> wide(static_cast<std::size_t>(range.size()));
          inputs.logits(t, range.begin, range.end, wide.data());
          CHECK(std::memcmp(wide.data(), whole.data() + range.begin, wide.size() * sizeof(double)) == 0);
          if (std::string(dtype) == "fp32") {
            std::vector<float> narrow(static_cast<std::size_t>(range.size()));
            inputs.logits(t, range.begin, range.end, narrow.data());
            for (std::size_t k = 0; k < narrow.size(); ++k) CHECK(static_cast<double>(narrow[k]) == wide[k]);
          } else if (std::string(dtype) == "bf16") {
            std::vector<Eigen::bfloat16> narrow(static_cast<std::size_t>(range.size()));
            inputs.logits(t, range.begin, range.end, narrow.data());
            for (std::size_t k = 0; k < narrow.size(); ++k) {
              CHECK(static_cast<double>(static_cast<float>(narrow[k])) == wide[k]);
            }
          } else {
            std::vector<Eigen::half> narrow(static_cast<std::size_t>(range.size()));
            inputs.logits(t, range.begin, range.end, narrow.data());
            for (std::size_t k = 0; k < narrow.size(); ++k) {
              CHECK(static_cast<double>(static_cast<float>(narrow[k])) == wide[k]);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("the_same_seed_gives_the_same_inputs_and_another_seed_different_ones") {
  auto j = testing::case_json(4, 64, 1);
  const Case a = testing::make_case(j);
  j["inputs"]["seed"] = 1235;
  const Case b = testing::make_case(j);
  std::vector<double> ra(64), rb(64), ra2(64);
  InputSource(a).logits(2, 0, 64, ra.data());
  InputSource(a).logits(2, 0, 64, ra2.data());
  InputSource(b).logits(2, 0, 64, rb.data());
  CHECK(ra == ra2);
  CHECK(ra != rb);
}

TEST_CASE("labels_lie_in_0_v_and_the_ignored_fraction_is_honoured") {
  auto j = testing::case_json(20000, 50, 1);
  j["inputs"]["ignore_fraction"] = 0.25;
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  std::int64_t ignored = 0;
  std::vector<int> histogram(50, 0);
  for (std::int64_t t = 0; t < 20000; ++t) {
    const auto l = inputs.label(t);
    if (l == -100) {
      ++ignored;
      continue;
    }
    REQUIRE(l >= 0);
    REQUIRE(l < 50);
    ++histogram[static_cast<std::size_t>(l)];
  }
  CHECK(static_cast<double>(ignored) / 20000.0 == doctest::Approx(0.25).epsilon(0.05));
  for (int count : histogram) CHECK(count > 200);  // ~300 expected in each bin
}

TEST_CASE("hand_written_rows_and_labels_override_the_generator") {
  auto j = testing::case_json(4, 4, 2);
  j["inputs"]["overrides"] = {{{"token", 1}, {"logits", {0.0, 240.0, -1.5, 3.0}}, {"label", 2}}};
  const Case c = testing::make_case(j);
  const InputSource inputs(c);
  std::vector<double> row(4);
  inputs.logits(1, 0, 4, row.data());
  CHECK(row == std::vector<double>{0.0, 240.0, -1.5, 3.0});
  CHECK(inputs.label(1) == 2);
}
