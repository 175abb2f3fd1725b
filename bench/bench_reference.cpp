// Throughput of the float64 reference and of the Philox input generator, in logits per second, on one
// thread and on all threads, beside a naive scalar loop of the same loss and gradient (std::exp per
// element, Neumaier sums, q_v evaluated per column: the reference as it was written before it was
// vectorized). Prints a table, the speed-ups and how far apart the two answers are; no pass/fail.
//   bench_reference [tokens] [vocab]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/loss_reference.hpp"

using namespace lossverify;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Figures {
  double generate = 0.0;         // logits per second, generation only
  double reference = 0.0;        // logits per second, reference on a generated row (generation excluded)
  double naive = 0.0;            // logits per second, the naive scalar loop on the same row
  double loss_difference = 0.0;  // largest |reference - naive| / |naive| over the token losses
  double grad_difference = 0.0;  // largest |reference - naive| over the gradient, relative to its largest value
};

// Cross-entropy with label smoothing (PyTorch convention) and z-loss, mean over the tokens, one row:
// the loss, and the gradient into grad. Scalar code straight from the definitions.
double naive_cross_entropy(const Case& c, std::int64_t label, double weight, const std::vector<double>& x,
                           std::vector<double>& grad) {
  const double n = static_cast<double>(x.size());
  const double alpha = cross_entropy_options(c.loss).label_smoothing;
  auto q = [&](std::size_t v) {
    return (1.0 - alpha) * (static_cast<std::int64_t>(v) == label ? 1.0 : 0.0) + alpha / n;
  };
  double max = -std::numeric_limits<double>::infinity();
  for (double v : x) max = std::max(max, v);
  CompensatedSum sum_exp;
  CompensatedSum sum_qx;
  for (std::size_t v = 0; v < x.size(); ++v) {
    sum_exp.add(std::exp(x[v] - max));
    sum_qx.add(q(v) * x[v]);
  }
  const double lse = max + std::log(sum_exp.value());
  const double z_factor = 1.0 + 2.0 * cross_entropy_options(c.loss).z_loss_weight * lse;
  for (std::size_t v = 0; v < x.size(); ++v) grad[v] = weight * (std::exp(x[v] - lse) * z_factor - q(v));
  return lse - sum_qx.value() + cross_entropy_options(c.loss).z_loss_weight * lse * lse;
}

Figures measure(const Case& c, int threads) {
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const auto n = c.shape.tokens;
  const auto vocab = c.shape.vocab;
  double generate_seconds = 0.0;
  double reference_seconds = 0.0;
  double naive_seconds = 0.0;
  double loss_difference = 0.0;
  double grad_difference = 0.0;
  double sink = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sink) \
    reduction(max : generate_seconds, reference_seconds, naive_seconds, loss_difference, grad_difference)
  {
    std::vector<double> row(static_cast<std::size_t>(vocab)), grad(static_cast<std::size_t>(vocab));
    std::vector<double> naive_grad(static_cast<std::size_t>(vocab));
    double g = 0.0;
    double r = 0.0;
    double s = 0.0;
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < n; ++t) {
      const double t0 = now();
      inputs.logits(t, 0, vocab, row.data());
      const double t1 = now();
      const double loss = reference.evaluate(t, row, {}, grad).loss;
      const double t2 = now();
      const double naive = naive_cross_entropy(c, inputs.label(t), reference.token_weight(t), row, naive_grad);
      s += now() - t2;
      r += t2 - t1;
      g += t1 - t0;
      sink += loss + grad[static_cast<std::size_t>(t % vocab)] + naive_grad[static_cast<std::size_t>(t % vocab)];
      loss_difference = std::max(loss_difference, std::fabs(loss - naive) / std::fabs(naive));
      double largest = 0.0;
      double difference = 0.0;
      for (std::size_t v = 0; v < grad.size(); ++v) {
        largest = std::max(largest, std::fabs(naive_grad[v]));
        difference = std::max(difference, std::fabs(grad[v] - naive_grad[v]));
      }
      grad_difference = std::max(grad_difference, difference / largest);
    }
    generate_seconds = g;
    reference_seconds = r;
    naive_seconds = s;
  }
  if (sink == 42.0) std::puts("");  // keep the work observable
  const double logits = static_cast<double>(n) * static_cast<double>(vocab);
  return {logits / generate_seconds, logits / reference_seconds, logits / naive_seconds, loss_difference,
          grad_difference};
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 512;
  const std::int64_t vocab = argc > 2 ? std::atoll(argv[2]) : 131072;
  const nlohmann::json j = {{"name", "bench"},
                            {"shape", {{"tokens", tokens}, {"vocab", vocab}}},
                            {"loss", {{"label_smoothing", 0.1}, {"z_loss_weight", 1e-4}}},
                            {"inputs", {{"seed", 1}, {"dtype", "fp32"}, {"scale", 2.0}}}};
  const Case c = parse_case(j, "<bench>");
  const int all = omp_get_max_threads();
  const Figures one = measure(c, 1);
  const Figures many = measure(c, all);
  std::printf("reference throughput, N=%lld V=%lld (float64 logits per second)\n", static_cast<long long>(tokens),
              static_cast<long long>(vocab));
  std::printf("%-34s %14s %14s %9s\n", "stage", "1 thread", "all threads", "speed-up");
  std::printf("%-34s %14.3e %14.3e %8.2fx\n", "Philox generation (float64 rows)", one.generate, many.generate,
              many.generate / one.generate);
  std::printf("%-34s %14.3e %14.3e %8.2fx\n", "naive scalar loop (loss + gradient)", one.naive, many.naive,
              many.naive / one.naive);
  std::printf("%-34s %14.3e %14.3e %8.2fx\n", "reference loss + gradient", one.reference, many.reference,
              many.reference / one.reference);
  std::printf("reference / naive: %.2fx on 1 thread, %.2fx on all threads\n", one.reference / one.naive,
              many.reference / many.naive);
  std::printf("largest difference from the naive loop: loss %.2e relative, gradient %.2e of the row's largest\n",
              std::max(one.loss_difference, many.loss_difference), std::max(one.grad_difference, many.grad_difference));
  std::printf("threads: %d\n", all);
  return 0;
}
