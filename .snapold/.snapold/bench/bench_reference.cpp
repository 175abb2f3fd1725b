// Throughput of the float64 reference and of the Philox input generator, in logits per second, on one
// thread and on all threads. Prints a table and the parallel speed-up; no pass/fail.
//   bench_reference [tokens] [vocab]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lossverify/inputs/input_source.hpp"
#include "lossverify/reference/loss_reference.hpp"

using namespace lossverify;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Figures {
  double generate = 0.0;   // logits per second, generation only
  double reference = 0.0;  // logits per second, reference on a generated row (generation excluded)
};

Figures measure(const Case& c, int threads) {
  const InputSource inputs(c);
  const LossReference reference(c, inputs);
  const auto n = c.shape.tokens;
  const auto vocab = c.shape.vocab;
  double generate_seconds = 0.0;
  double reference_seconds = 0.0;
  double sink = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sink) reduction(max : generate_seconds, reference_seconds)
  {
    std::vector<double> row(static_cast<std::size_t>(vocab)), grad(static_cast<std::size_t>(vocab));
    double g = 0.0;
    double r = 0.0;
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < n; ++t) {
      const double t0 = now();
      inputs.logits(t, 0, vocab, row.data());
      const double t1 = now();
      sink += reference.evaluate(t, row, {}, grad).loss + grad[static_cast<std::size_t>(t % vocab)];
      r += now() - t1;
      g += t1 - t0;
    }
    generate_seconds = g;
    reference_seconds = r;
  }
  if (sink == 42.0) std::puts("");  // keep the work observable
  const double logits = static_cast<double>(n) * static_cast<double>(vocab);
  return {logits / generate_seconds, logits / reference_seconds};
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
  std::printf("%-34s %14.3e %14.3e %8.2fx\n", "reference loss + gradient", one.reference, many.reference,
              many.reference / one.reference);
  std::printf("threads: %d\n", all);
  return 0;
}
