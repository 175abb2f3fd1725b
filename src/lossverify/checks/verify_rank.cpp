// verify_rank: one rank's outputs against its oracle, then the checks merged over the world (docs/spec.md §6).
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lossverify/case/tolerances.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/checks/element_judge.hpp"
#include "lossverify/comm/communicator.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/stage_trace.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify {

GradJudgement grad_judgement(const Case& c, std::int64_t step_valid_tokens, DType output_dtype) {
  GradJudgement j;
  j.tolerance = effective_tolerance(c, "grad");
  j.dtype = c.inputs.dtype;
  j.framework_scale = effective_gradient_scale(c, step_valid_tokens);
  j.quantum = output_quantum(c.inputs.dtype);
  j.grad_scale = kind_of(c.loss).grad_scale(c.loss);
  j.smallest_normal = smallest_normal(output_dtype);
  return j;
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

// A loss a framework stored in 16 bits (torch's cross_entropy and Liger return the loss in the logits'
// dtype) is judged as 16-bit gradients are: within the dtype's max_ulp units of its spacing at the exact
// value, where a correctly rounded value is within half a unit; the float32 tolerance still applies when wider.
double stored_loss_tolerance(double float32_tolerance, double expected, DType stored) {
  if (stored == DType::fp32) return float32_tolerance;
  const int max_ulp = default_tolerance("grad", stored).tolerance.max_ulp;
  return std::max(float32_tolerance, max_ulp * ulp_size(expected, stored));
}

// The precision the logged loss is judged at, and why: what the dump declares; else a value stored wider than
// the problem's 16-bit dtype but exactly one of its values (a 16-bit loss logged with .float() or .item()) is
// judged by that dtype's rule, so that no error larger than its precision passes; else its storage.
std::pair<DType, std::string> logged_loss_rule(const Case& c, const RankOutput& out) {
  if (out.reduced_loss_precision) {
    return {*out.reduced_loss_precision,
            std::string(to_string(*out.reduced_loss_precision)) + " (declared by the dump)"};
  }
  const DType problem = c.inputs.dtype;
  if (out.reduced_loss_dtype == DType::fp32 && problem != DType::fp32 && std::isfinite(out.reduced_loss) &&
      round_to_dtype(static_cast<double>(out.reduced_loss), problem) == static_cast<double>(out.reduced_loss)) {
    const std::string name(to_string(problem));
    return {problem, name + " (stored wider, but exactly a " + name + " value: a " + name +
                         " loss logged with .float() or .item())"};
  }
  return {out.reduced_loss_dtype, std::string(to_string(out.reduced_loss_dtype)) + " (as stored)"};
}

// Every rank's statistics merged as ErrorStats::merge merges them in rank order, through reductions of a
// fixed size, so that no rank holds the others' records: the counts summed, the extrema max-reduced, and
// the worst element the one with the largest margin, ties going to the earliest (token, column, rank).
// The same result on every rank and every backend.
ErrorStats merge_over(Communicator& world, const ErrorStats& local) {
  const PackedStats mine = local.pack();
  std::int64_t counts[2] = {mine.compared, mine.mismatches};
  world.allreduce_sum(std::span<std::int64_t>(counts));
  std::int64_t max_ulp[1] = {mine.max_ulp};
  world.allreduce_max(std::span<std::int64_t>(max_ulp));
  const double no_worst = -std::numeric_limits<double>::infinity();
  double extrema[3] = {mine.max_abs, mine.max_rel, mine.has_worst ? mine.margin : no_worst};
  world.allreduce_max(std::span<double>(extrema));
  PackedStats merged{};
  merged.compared = counts[0];
  merged.mismatches = counts[1];
  merged.max_ulp = max_ulp[0];
  merged.max_abs = extrema[0];
  merged.max_rel = extrema[1];
  merged.margin = extrema[2] == no_worst ? 0.0 : extrema[2];
  merged.has_worst = extrema[2] != no_worst;
  if (!merged.has_worst) return ErrorStats::unpack(merged);
  // The earliest position among the ranks whose worst has the largest margin: token, then column, then rank.
  bool contends = mine.has_worst && mine.margin == extrema[2];
  const std::int64_t position[3] = {mine.worst.token, mine.worst.column, mine.worst.rank};
  std::int64_t best[3] = {0, 0, 0};
  for (int k = 0; k < 3; ++k) {
    std::int64_t key[1] = {contends ? -position[k] : std::numeric_limits<std::int64_t>::min()};
    world.allreduce_max(std::span<std::int64_t>(key));
    best[k] = -key[0];
    contends = contends && position[k] == best[k];
  }
  // The winner's record reaches every rank bit for bit (x + 0 = x on the integers).
  std::int64_t record[5] = {};
  if (contends) {
    record[0] = mine.worst.padding_sequence;
    record[1] = mine.worst.padding_position;
    record[2] = std::bit_cast<std::int64_t>(mine.worst.expected);
    record[3] = std::bit_cast<std::int64_t>(mine.worst.got);
    record[4] = std::bit_cast<std::int64_t>(mine.worst.tolerance);
  }
  world.allreduce_sum(std::span<std::int64_t>(record));
  merged.worst = {best[0],
                  best[1],
                  best[2],
                  record[0],
                  record[1],
                  std::bit_cast<double>(record[2]),
                  std::bit_cast<double>(record[3]),
                  std::bit_cast<double>(record[4])};
  return ErrorStats::unpack(merged);
}

// Fixed-size records of every rank on world rank 0 only (elsewhere: empty).
template <class T>
std::vector<T> gather_on_root(Communicator& world, const T& mine) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<T> all(world.rank() == 0 ? static_cast<std::size_t>(world.size()) : 0);
  world.gather_to_root(&mine, all.data(), sizeof(T));
  return all;
}

// What every stage of one rank's verification reads.
struct RankContext {
  const Case& c;
  const RankOutput& out;
  Oracle& oracle;
  const LossReference& reference;
  RankGroups& groups;
  Communicator& world;
  std::int64_t tokens;
  std::int64_t rows;
  int column_ranks;    // the rank's columns group: the ranks holding slices of its rows
  bool column_leader;  // rank 0 of that group
  bool token_owner;    // counts its rows' tokens once over the world (the column leader of the first replica)
  int world_rank;
  double loss_scale;  // the kind's loss factor (KD: T^s)
};

// The columns groups' slices tile [0, V); every token is held by exactly one columns group (one per replica).
void check_coverage(const RankContext& x) {
  const VocabRange range = x.out.assignment.vocab;
  const std::int64_t mine[2] = {range.begin, range.end};
  std::vector<std::int64_t> all(static_cast<std::size_t>(2 * x.column_ranks));
  x.groups.columns.all_gather(mine, all.data(), sizeof(mine));
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (int r = 0; r < x.column_ranks; ++r) {
    ranges.push_back({all[static_cast<std::size_t>(2 * r)], all[static_cast<std::size_t>(2 * r + 1)]});
  }
  std::sort(ranges.begin(), ranges.end());
  const std::string who = "rank " + std::to_string(x.world_rank);
  std::int64_t next = 0;
  for (const auto& [b, e] : ranges) {
    if (b != next)
      throw InternalError(who + ": TP shards do not tile the vocabulary at column " + std::to_string(next));
    next = e;
  }
  if (next != x.c.shape.vocab) throw InternalError(who + ": TP shards do not cover the vocabulary");
  std::vector<std::int64_t> holders(static_cast<std::size_t>(x.tokens), 0);
  if (x.column_leader) {
    for (std::int64_t i = 0; i < x.rows; ++i) {
      if (x.out.token_of(i) >= 0) ++holders[static_cast<std::size_t>(x.out.token_of(i))];
    }
  }
  x.world.allreduce_sum(std::span<std::int64_t>(holders));
  const int replicas = token_replicas(x.c);
  for (std::int64_t t = 0; t < x.tokens; ++t) {
    const std::int64_t held = holders[static_cast<std::size_t>(t)];
    if (held != replicas) {
      throw InternalError("token " + std::to_string(t) + " is held by " + std::to_string(held) +
                          " columns groups, expected " + std::to_string(replicas));
    }
  }
}

// The reference of the rank's rows: which are valid tokens, their statistics over the whole vocabulary
// (the TP group's partials combined in column order) and their losses.
struct RowReference {
  std::vector<char> valid;
  std::vector<RowStats> stats;
  std::vector<double> loss;
  // Rows with a second admissible reading (KindReference::branches): its statistics and its loss.
  std::vector<char> either;
  std::vector<double> other_loss;
  std::int64_t either_tokens = 0;  // over the world, each token once

  RowStats other_stats(std::size_t k) const {
    RowStats s = stats[k];
    s.branch = 1;
    return s;
  }
};

// Sums over the TP group, in rank order (in place; a group of one has nothing to add).
void sum_over_tp(const RankContext& x, std::vector<double>& values) {
  if (x.column_ranks > 1) x.groups.columns.allreduce_sum(std::span<double>(values));
}

// Each valid row's value pass summed over TP (where the kind has one) into its statistics, then its l_t.
std::vector<double> token_losses(const RankContext& x, RowReference& ref) {
  if (x.reference.needs_value_pass()) {
    std::vector<double> pass = x.oracle.value_partials(ref.stats);  // [value, error] per row
    sum_over_tp(x, pass);
    for (std::size_t k = 0; k < ref.stats.size(); ++k) {
      if (!ref.valid[k]) continue;
      CompensatedSum total;
      total.add(pass[2 * k]);
      total.add(pass[2 * k + 1]);
      ref.stats[k].value = total.value();
    }
  }
  std::vector<double> loss(static_cast<std::size_t>(x.rows), 0.0);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    if (ref.valid[k]) loss[k] = x.reference.token_loss(x.out.token_of(i), ref.stats[k]);
  }
  return loss;
}

// Each row's statistics over the whole vocabulary: the TP group's maxima (exact), then every slice's sums
// rescaled to them and added up in rank order. Every rank holds only its own rows' numbers, whatever the
// TP degree.
std::vector<RowStats> row_statistics(const RankContext& x, const std::vector<double>& partials,
                                     const std::vector<char>& valid) {
  const auto rows = static_cast<std::size_t>(x.rows);
  auto slice = [&](std::size_t k) { return RowPartial::load(&partials[k * RowPartial::kDoubles]); };
  std::vector<double> maxima(2 * rows, -std::numeric_limits<double>::infinity());
  for (std::size_t k = 0; k < rows; ++k) {
    if (!valid[k]) continue;
    maxima[k] = slice(k).max;
    maxima[rows + k] = slice(k).teacher_max;
  }
  if (x.column_ranks > 1) x.groups.columns.allreduce_max(std::span<double>(maxima));
  std::vector<double> sums(rows * RowPartial::kDoubles, 0.0);
  for (std::size_t k = 0; k < rows; ++k) {
    if (valid[k]) RowPartial::rescaled(slice(k), maxima[k], maxima[rows + k]).store(&sums[k * RowPartial::kDoubles]);
  }
  sum_over_tp(x, sums);
  std::vector<RowStats> stats(rows);
  for (std::size_t k = 0; k < rows; ++k) {
    if (!valid[k]) continue;
    RowPartial total = RowPartial::load(&sums[k * RowPartial::kDoubles]);
    total.max = maxima[k];
    total.teacher_max = maxima[rows + k];
    stats[k] = x.reference.stats_from_sums(total);
  }
  return stats;
}

// Which valid rows admit a second reading (a ratio at a clip edge), that reading's loss, and how many such
// tokens the step holds.
void admissible_readings(const RankContext& x, RowReference& ref) {
  ref.either.assign(static_cast<std::size_t>(x.rows), 0);
  ref.other_loss = ref.loss;
  std::int64_t count[1] = {0};
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = x.out.token_of(i);
    if (!ref.valid[k] || x.reference.row().branches(t, ref.stats[k]) < 2) continue;
    ref.either[k] = 1;
    ref.other_loss[k] = x.reference.token_loss(t, ref.other_stats(k));
    count[0] += x.token_owner;
  }
  x.world.allreduce_sum(std::span<std::int64_t>(count));
  ref.either_tokens = count[0];
}

RowReference reference_rows(const RankContext& x, StageTrace& trace) {
  RowReference ref;
  std::vector<double> partials(static_cast<std::size_t>(x.rows * RowPartial::kDoubles), 0.0);
  x.oracle.row_partials(partials, ref.valid);
  trace.mark("2 combine");
  ref.stats = row_statistics(x, partials, ref.valid);
  trace.mark("2 combine: losses");
  ref.loss = token_losses(x, ref);
  admissible_readings(x, ref);
  return ref;
}

// Beyond this magnitude a quantity leaves float32's reach with room for the sums over tokens and columns that
// follow (float32's largest value is 3.4e38): no float32 implementation, the correct one included, could be judged.
constexpr double kFloat32Reach = 1e30;

// The float64 reference must be finite, and within float32's reach, on every token that counts: an input that
// overflows it (a policy's old log-probability far below the model's, a GSPO sequence ratio past e^69, a norm
// constant that makes the weights 1e300) leaves nothing to judge, so the run is refused, exit 2, naming the first
// such token and quantity, before any comparison or report. Collective over the world, so that every rank refuses
// together.
void require_representable_reference(const RankContext& x, const RowReference& ref) {
  const std::size_t q = kind_of(x.c.loss).token_quantities().size();
  std::vector<double> values(q), statistics(kind_of(x.c.loss).logged_statistics(x.c.loss).size());
  const auto out_of_reach = [](double v) { return !(std::fabs(v) <= kFloat32Reach); };
  // [token, which]: the first such token on this rank (tokens + 1 where none).
  double first[2] = {static_cast<double>(x.tokens + 1), 0.0};
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = x.out.token_of(i);
    if (t < 0 || !ref.valid[k] || static_cast<double>(t) >= first[0]) continue;
    const double weight = x.reference.token_weight(t);
    int which = 0;
    if (out_of_reach(ref.loss[k]) || out_of_reach(weight * ref.loss[k])) which = 1;
    const double scale = x.reference.row().gradient_scale(t, ref.stats[k]).value_or(1.0);
    if (which == 0 && (out_of_reach(scale) || out_of_reach(weight * scale) || out_of_reach(weight))) which = 2;
    if (which == 0 && q > 0) {
      x.reference.row().token_values(t, ref.stats[k], values);
      for (const double v : values) which = which == 0 && out_of_reach(v) ? 3 : which;
    }
    if (which == 0 && !statistics.empty()) {
      x.reference.row().token_statistics(t, ref.stats[k], statistics);
      for (const double v : statistics) which = which == 0 && out_of_reach(v) ? 4 : which;
    }
    if (which != 0) first[0] = static_cast<double>(t), first[1] = which;
  }
  double lowest = -first[0];  // the world's first such token, by a maximum of negated indices
  x.world.allreduce_max(std::span<double>(&lowest, 1));
  const double token = -lowest;
  if (token > static_cast<double>(x.tokens)) return;
  double which = token == first[0] ? first[1] : 0.0;
  x.world.allreduce_max(std::span<double>(&which, 1));
  static const char* const quantity[] = {"", "loss", "gradient", "per-token value", "logged statistic"};
  throw CaseError(x.c.source + ": token " + std::to_string(static_cast<std::int64_t>(token)) +
                  ": the float64 reference's " + quantity[static_cast<int>(which)] +
                  " (or its weight in L) is not finite or beyond 1e30, where no float32 implementation can be judged: "
                  "the inputs overflow it there (an old or reference log-probability far below the model's, a ratio "
                  "or a weight past float32's range); the run is refused");
}

// The losses: every row's against the reference, the logged (reduced) loss and the logged count.
struct LossFindings {
  ErrorStats per_token;  // this rank's rows
  ErrorStats reduced;
  ErrorStats count;
  double reference_reduced = 0.0;
  Tolerance tolerance;
  Tolerance reduced_tolerance;
  std::string reduced_rule;  // the precision this rank's logged loss was judged at, and why
};

LossFindings judge_losses(const RankContext& x, const RowReference& ref, std::vector<double>& token_margins) {
  LossFindings f;
  f.tolerance = effective_tolerance(x.c, "loss");
  f.reduced_tolerance = effective_tolerance(x.c, "reduced_loss");
  // The reference's logged loss: every token's reference loss, summed in token order on every rank.
  std::vector<double> token_losses(static_cast<std::size_t>(x.tokens), 0.0);
  // [sum of |w_t| |l_t - l_t'| over tokens with two readings, sum of |w_t| times the magnitude of l_t's terms]
  double spread[2] = {0.0, 0.0};
  // Per row: rtol of the magnitude of l_t's terms before they cancel, and its inputs' float32 rounding
  // (KindReference::token_loss_arithmetic). The logged loss takes rtol of its tokens' terms (beta KL summed over
  // tokens cancels the surrogates as it does per token) but not the inputs' rounding: a weighted mean of roundings
  // of either sign stays within its floor, and bounds added up over N_v tokens would hide a mis-weighted term.
  std::vector<double> rounding(static_cast<std::size_t>(x.rows), 0.0);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = x.out.token_of(i);
    if (t < 0) continue;
    if (ref.valid[k]) {
      KindReference::LossArithmetic a = x.reference.row().token_loss_arithmetic(t, ref.stats[k]);
      if (const StageReference* stage = x.reference.stage(); stage != nullptr && stage->makes_logits()) {
        // a stage's logits (an LM head's) within its error of the reference's move the loss by the kind's bound
        a.either_way +=
            x.reference.row().loss_under_logit_error(t, ref.stats[k], stage->largest_logit_error(t)).value_or(0.0);
      }
      const double terms = a.terms.value_or(std::fabs(ref.loss[k]));
      rounding[k] = f.tolerance.rtol * terms + a.inputs_rounding + a.either_way;
      if (x.token_owner) spread[1] += std::fabs(x.reference.token_weight(t)) * terms;
      if (x.token_owner) spread[0] += std::fabs(x.reference.token_weight(t)) * a.either_way;
    }
    if (!x.token_owner) continue;
    token_losses[static_cast<std::size_t>(t)] = ref.loss[k];
    if (ref.either[k]) spread[0] += std::fabs(x.reference.token_weight(t) * (ref.other_loss[k] - ref.loss[k]));
  }
  x.world.allreduce_sum(std::span<double>(token_losses));  // one nonzero term per token: exact
  x.world.allreduce_sum(std::span<double>(spread));
  if (x.c.loss.reduction != Reduction::none) {
    f.reference_reduced = x.reference.reduced_loss(token_losses);
    // The absolute floor scales with sum_t |w_t|: 1 for mean, N_v for sum; either reading of a token is right.
    const double tolerance = f.reduced_tolerance.atol * x.loss_scale * std::max(x.reference.weight_total(), 1.0) +
                             f.reduced_tolerance.rtol * std::max(std::fabs(f.reference_reduced), spread[1]) + spread[0];
    const auto [judged_as, rule] = logged_loss_rule(x.c, x.out);
    f.reduced_rule = rule;
    f.reduced.add({-1, -1, x.world_rank, f.reference_reduced, x.out.reduced_loss,
                   stored_loss_tolerance(tolerance, f.reference_reduced, judged_as)});
  }
  f.count.add({-1, -1, x.world_rank, static_cast<double>(x.reference.valid_tokens()),
               static_cast<double>(x.out.logged_valid_tokens), 0.5});
  // Each row: CP padding must be exactly zero, a token within its tolerance (its margin goes to the map).
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = x.out.token_of(i);
    const double got = x.out.token_loss[k];
    if (t < 0) {
      const LocalRow& row = x.out.assignment.rows[k];
      f.per_token.add({-1, -1, x.world_rank, 0.0, got, 0.0, row.sequence, row.position});
      continue;
    }
    double expected = ref.loss[k];
    if (ref.either[k] && std::fabs(got - ref.other_loss[k]) < std::fabs(got - expected)) expected = ref.other_loss[k];
    const double tolerance =
        stored_loss_tolerance(f.tolerance.atol * x.loss_scale + f.tolerance.rtol * std::fabs(expected) + rounding[k],
                              expected, x.out.token_loss_dtype);
    f.per_token.add({t, -1, x.world_rank, expected, got, tolerance});
    if (!token_margins.empty()) {
      token_margins[static_cast<std::size_t>(x.tokens + t)] =
          margin_of(got == expected ? 0.0 : std::fabs(got - expected), tolerance);
    }
  }
  return f;
}

// The kind's per-token quantities (log-probabilities, entropies): every row of every rank against the
// reference, 0 on masked rows and CP padding.
struct TokenValueFindings {
  std::vector<std::string> names;
  std::vector<ErrorStats> stats;  // per quantity
  Tolerance tolerance;
};

TokenValueFindings judge_token_values(const RankContext& x, const RowReference& ref) {
  TokenValueFindings f;
  f.names = kind_of(x.c.loss).token_quantities();
  f.stats.resize(f.names.size());
  f.tolerance = effective_tolerance(x.c, "token_value");
  const std::size_t q = f.names.size();
  if (q == 0) return f;
  if (x.out.token_values.size() != static_cast<std::size_t>(x.rows) * q) {
    throw InternalError("rank " + std::to_string(x.world_rank) + " reported " +
                        std::to_string(x.out.token_values.size()) + " token values for " + std::to_string(x.rows) +
                        " rows of " + std::to_string(q) + " quantities");
  }
  std::vector<double> expected(q), rounding(q);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = x.out.token_of(i);
    std::fill(expected.begin(), expected.end(), 0.0);
    std::fill(rounding.begin(), rounding.end(), 0.0);
    if (t >= 0 && ref.valid[k]) {
      x.reference.row().token_values(t, ref.stats[k], expected);
      x.reference.row().token_value_rounding(t, ref.stats[k], rounding);
    }
    const LocalRow& row = x.out.assignment.rows[k];
    for (std::size_t j = 0; j < q; ++j) {
      const double got = x.out.token_values[k * q + j];
      const double tolerance = t < 0 ? 0.0 : f.tolerance.atol + f.tolerance.rtol * std::fabs(expected[j]) + rounding[j];
      f.stats[j].add(
          {t, -1, x.world_rank, expected[j], got, tolerance, t < 0 ? row.sequence : -1, t < 0 ? row.position : -1});
    }
  }
  return f;
}

// The kind's logged statistics: each rank's logged value against the reference's mean of the per-token
// values over the step's valid tokens (summed in token order on every rank).
struct StatisticFindings {
  std::vector<std::string> names;
  std::vector<ErrorStats> stats;  // per statistic
  std::vector<double> expected;
  Tolerance tolerance;
};

StatisticFindings judge_statistics(const RankContext& x, const RowReference& ref) {
  StatisticFindings f;
  f.names = kind_of(x.c.loss).logged_statistics(x.c.loss);
  const std::size_t q = f.names.size();
  f.stats.resize(q);
  f.expected.assign(q, 0.0);
  f.tolerance = effective_tolerance(x.c, "statistic");
  if (q == 0) return f;
  if (x.out.logged_stats.size() != q) {
    throw InternalError("rank " + std::to_string(x.world_rank) + " logged " +
                        std::to_string(x.out.logged_stats.size()) + " statistics, expected " + std::to_string(q));
  }
  std::vector<double> values(static_cast<std::size_t>(x.tokens) * q, 0.0);
  std::vector<double> spread(q, 0.0);    // per statistic: sum of |s_t - s_t'| over tokens with two readings
  std::vector<double> rounding(q, 0.0);  // per statistic: sum over tokens of its float32 rounding
  if (x.token_owner) {
    std::vector<double> row(q), other(q);
    for (std::int64_t i = 0; i < x.rows; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const std::int64_t t = x.out.token_of(i);
      if (t < 0 || !ref.valid[k]) continue;
      x.reference.row().token_statistic_rounding(t, ref.stats[k], row);
      for (std::size_t j = 0; j < q; ++j) rounding[j] += row[j];
      x.reference.row().token_statistics(t, ref.stats[k], row);
      std::copy(row.begin(), row.end(), values.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(t) * q));
      if (!ref.either[k]) continue;
      x.reference.row().token_statistics(t, ref.other_stats(k), other);
      for (std::size_t j = 0; j < q; ++j) spread[j] += std::fabs(other[j] - row[j]);
    }
  }
  x.world.allreduce_sum(std::span<double>(values));  // one nonzero term per entry: exact
  x.world.allreduce_sum(std::span<double>(spread));
  x.world.allreduce_sum(std::span<double>(rounding));
  const auto valid = static_cast<double>(std::max<std::int64_t>(x.reference.valid_tokens(), 1));
  for (std::size_t j = 0; j < q; ++j) {
    CompensatedSum total;
    for (std::int64_t t = 0; t < x.tokens; ++t) total.add(values[static_cast<std::size_t>(t) * q + j]);
    f.expected[j] = total.value() / valid;
    // A token read either way moves the mean by up to its spread / N: either is right.
    f.stats[j].add(
        {-1, -1, x.world_rank, f.expected[j], x.out.logged_stats[j],
         f.tolerance.atol + f.tolerance.rtol * std::fabs(f.expected[j]) + spread[j] / valid + rounding[j] / valid});
  }
  return f;
}

// The gradient, from the oracle's rows: statistics, per-row sums for the row-sum invariant, the census.
struct GradFindings {
  ErrorStats stats;
  std::int64_t mismatches = 0;
  std::int64_t lookups = 0;
  std::vector<double> row_sums;  // per row: compensated sum (value, error) and the sum of magnitudes
  FiniteCensus census;
};

GradFindings collect_grad(const RankContext& x, std::span<const RowJudgement> judged,
                          std::vector<double>& token_margins) {
  GradFindings f;
  f.row_sums.assign(static_cast<std::size_t>(3 * x.rows), 0.0);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const RowJudgement& row = judged[k];
    f.stats.merge(ErrorStats::unpack(row.grad));
    f.mismatches += row.grad.mismatches;
    f.lookups += row.lookups;
    f.census.add(FiniteCensus{row.nan, row.pos_inf, row.neg_inf, row.subnormal});
    const std::int64_t t = x.out.token_of(i);
    if (t < 0) continue;
    f.row_sums[3 * k] = row.sum;
    f.row_sums[3 * k + 1] = row.sum_error;
    f.row_sums[3 * k + 2] = row.magnitude;
    if (!token_margins.empty()) token_margins[static_cast<std::size_t>(t)] = row.grad.margin;
  }
  return f;
}

// Across the TP group, judged by the TP leader: rank agreement of the losses and the row-sum invariant.
struct TpFindings {
  ErrorStats agreement;
  ErrorStats row_sum;
  Tolerance agreement_tolerance;
  Tolerance row_sum_tolerance;
};

// A row's stored elements each round by up to half the dtype's smallest spacing where they are subnormal
// (fp16: 2^-25), however small the exact values: V of them bound the row sum's error from below.
double row_sum_quantum_floor(const RankContext& x, const GradJudgement& judgement) {
  return std::max(1.0, 0.5 * static_cast<double>(x.c.shape.vocab)) * judgement.quantum * judgement.framework_scale;
}

TpFindings judge_tp_group(const RankContext& x, const RowReference& ref, const GradFindings& grad,
                          const GradJudgement& judgement) {
  TpFindings f;
  f.agreement_tolerance = effective_tolerance(x.c, "rank_agreement");
  f.row_sum_tolerance = effective_tolerance(x.c, "row_sum");
  const Tolerance& agree = f.agreement_tolerance;
  const Tolerance& row_tol = f.row_sum_tolerance;
  // Rank agreement: the TP leader's losses reach every rank (x + 0 is x), which judges its own against them.
  std::vector<float> first(x.out.token_loss.size(), 0.0f);
  if (x.column_leader) first = x.out.token_loss;
  if (x.column_ranks > 1) x.groups.columns.allreduce_sum(std::span<float>(first));
  // The row-sum invariant: each row's sums over the TP group, judged by the TP leader.
  std::vector<double> sums = grad.row_sums;
  sum_over_tp(x, sums);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::int64_t t = x.out.token_of(i);
    if (t < 0) continue;
    if (!x.column_leader) {
      f.agreement.add({t, -1, x.world_rank, first[k], x.out.token_loss[k],
                       agree.atol * x.loss_scale + agree.rtol * std::fabs(static_cast<double>(first[k]))});
      continue;
    }
    // docs/spec.md §3 invariant: the kind's sum_v dl/dx_v per token, times the token's weight in L.
    const double weight = ref.valid[k] ? x.reference.token_weight(t) : 0.0;
    const std::optional<double> rule = x.reference.row().gradient_row_sum(ref.stats[k], weight);
    if (!rule) continue;
    CompensatedSum total;
    total.add(sums[3 * k]);
    total.add(sums[3 * k + 1]);
    const double expected_sum = ref.valid[k] ? *rule : 0.0;
    f.row_sum.add({t, -1, x.world_rank, expected_sum, total.value(),
                   row_tol.atol * std::fabs(weight) * judgement.grad_scale + row_tol.rtol * sums[3 * k + 2] +
                       row_sum_quantum_floor(x, judgement)});
  }
  return f;
}

// The finite census of the losses, and the rank's first non-finite value (gradient before loss, row by row).
struct CensusRecord {
  std::int64_t rank;
  std::int64_t values[12];  // gradient, token loss, reduced loss: nan, +inf, -inf, subnormal
  std::int64_t has_bad;
  PackedElement bad;
};

CensusRecord take_census(const RankContext& x, std::span<const RowJudgement> judged, const FiniteCensus& grad) {
  FiniteCensus loss;
  FiniteCensus reduced;
  std::optional<ElementRecord> first_bad;
  const double fp32_normal = smallest_normal(DType::fp32);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const RowJudgement& row = judged[static_cast<std::size_t>(i)];
    if (row.first_bad_column >= 0 && !first_bad) {
      first_bad = ElementRecord{x.out.token_of(i), row.first_bad_column, x.world_rank, 0.0, row.first_bad_value, 0.0};
    }
    const double l = x.out.token_loss[static_cast<std::size_t>(i)];
    loss.count(l, fp32_normal);
    if (!std::isfinite(l) && !first_bad) first_bad = ElementRecord{x.out.token_of(i), -1, x.world_rank, 0.0, l, 0.0};
  }
  if (x.out.has_reduced_loss) reduced.count(x.out.reduced_loss, fp32_normal);
  CensusRecord mine{};
  mine.rank = x.world_rank;
  const FiniteCensus* parts[3] = {&grad, &loss, &reduced};
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
  return mine;
}

// The totals reach every rank (and decide the verdict); the ranks' own lines and the first non-finite value
// are gathered on world rank 0, which reports them.
CheckResult finite_result(Communicator& world, const CensusRecord& mine) {
  CheckResult r;
  r.name = "finite";
  std::int64_t totals[12];
  std::copy(std::begin(mine.values), std::end(mine.values), totals);
  world.allreduce_sum(std::span<std::int64_t>(totals));
  const FiniteCensus grad_total{totals[0], totals[1], totals[2], totals[3]};
  FiniteCensus loss_total{totals[4], totals[5], totals[6], totals[7]};
  loss_total.add(FiniteCensus{totals[8], totals[9], totals[10], totals[11]});
  nlohmann::json per_rank = nlohmann::json::array();
  for (const CensusRecord& cr : gather_on_root(world, mine)) {
    FiniteCensus f[3];
    for (int j = 0; j < 3; ++j) {
      f[j] = FiniteCensus{cr.values[4 * j], cr.values[4 * j + 1], cr.values[4 * j + 2], cr.values[4 * j + 3]};
    }
    if (f[0].nonfinite() + f[0].subnormal + f[1].nonfinite() + f[1].subnormal + f[2].nonfinite() > 0) {
      per_rank.push_back({{"rank", cr.rank},
                          {"grad", f[0].to_json()},
                          {"token_loss", f[1].to_json()},
                          {"reduced_loss", f[2].to_json()}});
    }
    if (cr.has_bad && !r.worst) {
      r.worst = ElementRecord{cr.bad.token, cr.bad.column, static_cast<int>(cr.bad.rank), 0.0, cr.bad.got, 0.0};
    }
  }
  const std::int64_t bad = grad_total.nonfinite() + loss_total.nonfinite();
  r.metrics = {
      {"nonfinite", bad}, {"grad", grad_total.to_json()}, {"loss", loss_total.to_json()}, {"per_rank", per_rank}};
  r.verdict = bad == 0 ? Verdict::pass : Verdict::fail;
  r.margin = bad == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  r.summary = bad == 0 ? "no NaN or Inf in any rank's outputs"
                       : std::to_string(bad) + " non-finite values (the reference is finite everywhere)";
  return r;
}

CheckResult loss_result(const RankContext& x, const LossFindings& losses) {
  const ErrorStats per_token = merge_over(x.world, losses.per_token);
  const ErrorStats reduced = merge_over(x.world, losses.reduced);
  ErrorStats both = per_token;
  both.merge(reduced);
  CheckResult r = make_result("loss", both, losses.tolerance, "per-token and logged losses vs the float64 reference");
  r.metrics = {{"per_token", per_token.to_json()}, {"margin", both.margin()}};
  if (x.c.loss.reduction != Reduction::none) {
    r.metrics["reduced"] = reduced.to_json();
    r.metrics["reduced"]["expected"] = losses.reference_reduced;
    r.metrics["reduced"]["tolerance"] = {{"atol", losses.reduced_tolerance.atol},
                                         {"rtol", losses.reduced_tolerance.rtol}};
    r.metrics["reduced"]["judged_as"] = losses.reduced_rule;
  }
  return r;
}

// A check of the logits' gradient where a stage keeps it internal (a fused head): not applicable, saying why.
// Nothing of the check was judged (the host oracle compares zeros where no gradient was handed over): its metrics are
// those of no element compared, with no margin or worst element.
void internal_to_stage(CheckResult& r, const Stage& stage) {
  r.verdict = Verdict::not_applicable;
  r.margin = 0.0;
  r.worst.reset();
  const bool per_rank = r.metrics.contains("mismatches_per_rank");
  r.metrics = ErrorStats{}.to_json();
  if (per_rank) r.metrics["mismatches_per_rank"] = nlohmann::json::array();
  r.summary = "the stage " + std::string(stage.name()) + " keeps the logits' gradient internal: its gradients judge it";
}

CheckResult grad_result(const RankContext& x, const GradFindings& grad, const GradJudgement& judgement) {
  const ErrorStats all = merge_over(x.world, grad.stats);
  const std::vector<std::int64_t> mismatches_per_rank = gather_on_root(x.world, grad.mismatches);
  CheckResult r = make_result("grad", all, judgement.tolerance, "effective gradient vs the float64 reference");
  if (x.c.inputs.dtype != DType::fp32) r.metrics["max_ulp"] = all.max_ulp();
  r.metrics["framework_scale"] = judgement.framework_scale;
  nlohmann::json per_rank = nlohmann::json::array();
  for (std::size_t k = 0; k < mismatches_per_rank.size(); ++k) {
    per_rank.push_back({{"rank", static_cast<int>(k)}, {"mismatches", mismatches_per_rank[k]}});
  }
  r.metrics["mismatches_per_rank"] = per_rank;
  // (Every rank has the same kind of oracle: one reference per run.)
  if (x.oracle.counts_lookups()) {
    std::int64_t lookups[1] = {grad.lookups};
    x.world.allreduce_sum(std::span<std::int64_t>(lookups));
    r.metrics["judged_by_lookup"] = lookups[0];
  }
  return r;
}

// The logged valid-token count and the kind's logged statistics, in one check.
CheckResult stats_result(const RankContext& x, const LossFindings& losses, const StatisticFindings& statistics) {
  ErrorStats all = merge_over(x.world, losses.count);
  std::vector<ErrorStats> merged;
  for (const ErrorStats& one : statistics.stats) {
    merged.push_back(merge_over(x.world, one));
    all.merge(merged.back());
  }
  std::string what = "logged valid-token count vs the global count";
  if (!statistics.names.empty()) what = "logged valid-token count and statistics vs the global token-means";
  CheckResult r =
      make_result("stats", all, statistics.names.empty() ? Tolerance{0.5, 0.0, 0} : statistics.tolerance, what);
  r.metrics["expected_valid_tokens"] = x.reference.valid_tokens();
  for (std::size_t j = 0; j < statistics.names.size(); ++j) {
    r.metrics[statistics.names[j]] = merged[j].to_json();
    r.metrics[statistics.names[j]]["expected"] = statistics.expected[j];
  }
  return r;
}

// The imbalance of a kind's values per block (a router's max c_e / mean c_e per layer, MOE.md section 1's logged
// statistic), at the step's worst micro-batch scope: the reference's and, where the ranks reported values, theirs. It
// is a function of the values the check judges, shown beside them; collective over the world.
void report_imbalance(const RankContext& x, Communicator& world, std::size_t width, CheckResult& r) {
  const auto blocks = static_cast<std::size_t>(kind_of(x.c.loss).row_blocks(x.c.loss));
  const std::size_t block = width / blocks;
  const auto ga = static_cast<std::size_t>(x.c.layout.ga);
  std::vector<double> worst(2 * blocks, 0.0);  // [reference..., reported...]
  auto imbalance = [&](const double* v) {
    double max = 0.0, sum = 0.0;
    for (std::size_t e = 0; e < block; ++e) max = std::max(max, v[e]), sum += v[e];
    return sum > 0.0 ? max * static_cast<double>(block) / sum : 0.0;
  };
  std::vector<double> expected(width), slack(width);
  for (std::size_t k = 0; k < ga; ++k) {
    x.reference.row().scope_values(x.out.assignment.coordinates.dp, static_cast<int>(k), expected, slack);
    for (std::size_t b = 0; b < blocks; ++b) {
      worst[b] = std::max(worst[b], imbalance(&expected[b * block]));
      if (!x.out.scope_values.empty()) {
        worst[blocks + b] = std::max(worst[blocks + b], imbalance(&x.out.scope_values[k * width + b * block]));
      }
    }
  }
  world.allreduce_max(std::span<double>(worst));
  r.metrics["imbalance"] = {
      {"definition", "max over experts / mean over experts of each layer's counts, at the worst micro-batch scope"},
      {"expected", std::vector<double>(worst.begin(), worst.begin() + static_cast<std::ptrdiff_t>(blocks))},
      {"got", std::vector<double>(worst.begin() + static_cast<std::ptrdiff_t>(blocks), worst.end())}};
}

// A kind's values per micro-batch scope (a router's counts per expert): each rank's, as it holds them after the
// scope's collectives, against the reference's, exact within half a unit and the slack of a user's tie tokens.
// Collective over the world. Not applicable where no rank reported them (a dump without them).
CheckResult scope_values_result(const RankContext& x, Communicator& world) {
  const LossKind& kind = kind_of(x.c.loss);
  const std::string name(kind.scope_values_name());
  const auto width = static_cast<std::size_t>(kind.scope_values_width(x.c));
  const auto ga = static_cast<std::size_t>(x.c.layout.ga);
  ErrorStats mine;
  if (!x.out.scope_values.empty()) {
    if (x.out.scope_values.size() != ga * width) {
      throw InternalError("rank " + std::to_string(x.world_rank) + " reported " +
                          std::to_string(x.out.scope_values.size()) + " " + name + ", expected " +
                          std::to_string(ga * width));
    }
    std::vector<double> expected(width), slack(width);
    for (std::size_t k = 0; k < ga; ++k) {
      x.reference.row().scope_values(x.out.assignment.coordinates.dp, static_cast<int>(k), expected, slack);
      for (std::size_t j = 0; j < width; ++j) {
        mine.add({-1, static_cast<std::int64_t>(j), x.world_rank, expected[j], x.out.scope_values[k * width + j],
                  0.5 + slack[j]});
      }
    }
  }
  CheckResult r = make_result(name, merge_over(world, mine), Tolerance{0.5, 0.0, 0},
                              "each rank's " + name +
                                  " of every micro-batch scope (a column per value) vs the "
                                  "float64 reference's");
  report_imbalance(x, world, width, r);
  if (r.verdict == Verdict::not_applicable) r.summary = "no rank reported its " + name;
  return r;
}

// Tokens judged by either of two readings (a ratio within rounding of a clip edge): counted where they count.
void report_either_branch(std::int64_t tokens, std::vector<CheckResult>& results) {
  if (tokens == 0) return;
  for (CheckResult& r : results) {
    if (r.name != "loss" && r.name != "grad" && r.name != "stats") continue;
    r.metrics["either_branch_tokens"] = tokens;
    r.summary += " (" + std::to_string(tokens) + " token(s) within rounding of a clip edge judged by either branch)";
  }
}

// Tokens whose discrete choice goes either way (a router's k-th score tie, MOE.md section 3), judged with the bound
// of either choice: counted where they widen the tolerance.
void report_either_way(std::int64_t tokens, std::vector<CheckResult>& results) {
  if (tokens == 0) return;
  for (CheckResult& r : results) {
    if (r.name != "loss" && r.name != "grad" && r.name != "stats" && r.name != "counts") continue;
    r.metrics["either_way_tokens"] = tokens;
    r.summary += " (" + std::to_string(tokens) +
                 " token(s) whose routing ties within rounding, judged with the bound of either choice)";
  }
}

void fill_error_map(const RankContext& x, const LossFindings& losses, const GradFindings& grad,
                    std::vector<double> token_margins, ErrorMap& map) {
  // (With one rank its margins are already the maxima.)
  if (x.world.size() > 1) x.world.allreduce_max(std::span<double>(token_margins));
  map.token_loss_margin.assign(token_margins.begin() + x.tokens, token_margins.end());
  token_margins.resize(static_cast<std::size_t>(x.tokens));
  map.token_grad_margin = std::move(token_margins);
  RankErrorCell cell;
  cell.rank = x.world_rank;
  cell.tp = x.out.assignment.coordinates.tp;
  cell.cp = x.out.assignment.coordinates.cp;
  cell.dp = x.out.assignment.coordinates.dp;
  cell.vocab_begin = x.out.assignment.vocab.begin;
  cell.vocab_end = x.out.assignment.vocab.end;
  cell.loss_margin = losses.per_token.margin();
  cell.grad_margin = grad.stats.margin();
  cell.grad_mismatches = grad.mismatches;
  map.ranks = gather_on_root(x.world, cell);
}

// The layout's answers for the invariance check, from the rank's own outputs.
void fill_snapshot(const RankContext& x, const RowReference& ref, double framework_scale, LayoutSnapshot& snapshot) {
  const std::int64_t vocab = x.c.shape.vocab;
  const std::int64_t cols = x.out.columns();
  const std::int64_t begin = x.out.assignment.vocab.begin;
  // A stage that keeps the kind's gradient inside (a fused head) hands none over to compare between layouts.
  const bool internal = x.c.loss.stage != nullptr && x.c.loss.stage->logit_gradient_internal();
  const bool keep_grads = !internal && x.tokens * vocab <= kSnapshotElementLimit;
  if (snapshot.token_loss.size() != static_cast<std::size_t>(x.tokens) ||
      snapshot.token_grad_scale.size() != static_cast<std::size_t>(x.tokens)) {
    throw InternalError("the layout snapshot is not sized for the problem (LayoutSnapshot::sized_for)");
  }
  if (keep_grads && x.out.grad.empty() && x.rows * cols > 0) {
    throw InternalError("the invariance check needs the rank's gradient on the host");
  }
  std::vector<double> got(static_cast<std::size_t>(cols));
  for (std::int64_t i = 0; i < x.rows; ++i) {
    const std::int64_t t = x.out.token_of(i);
    if (t < 0) continue;
    if (x.token_owner) snapshot.token_loss[static_cast<std::size_t>(t)] = x.out.token_loss[static_cast<std::size_t>(i)];
    const auto k = static_cast<std::size_t>(i);
    if (x.token_owner && ref.either[k]) {  // two layouts may read it either way: not compared between them
      snapshot.token_grad_scale[static_cast<std::size_t>(t)] = std::numeric_limits<float>::infinity();
    } else if (x.token_owner && ref.valid[k]) {
      if (const std::optional<double> scale = x.reference.row().gradient_scale(t, ref.stats[k])) {
        snapshot.token_grad_scale[static_cast<std::size_t>(t)] =
            static_cast<float>(std::fabs(x.reference.token_weight(t)) * *scale);
      }
    }
    if (!keep_grads) continue;
    x.out.grad_row(i, got.data());
    for (std::int64_t v = 0; v < cols; ++v) {
      const double g = got[static_cast<std::size_t>(v)] * framework_scale;
      snapshot.effective_grad[static_cast<std::size_t>(t * vocab + begin + v)] = static_cast<float>(g);
    }
  }
  if (x.world.rank() == 0) {
    snapshot.logged_loss = x.out.reduced_loss;
    snapshot.logged_valid_tokens = x.out.logged_valid_tokens;
  }
}

}  // namespace

std::vector<CheckResult> verify_rank(const Case& c, const RankOutput& out, Oracle& oracle, RankGroups& groups,
                                     Communicator& world, LayoutSnapshot* snapshot, ErrorMap* error_map) {
  const RankContext x{c,
                      out,
                      oracle,
                      oracle.reference(),
                      groups,
                      world,
                      c.shape.tokens,
                      out.rows(),
                      groups.columns.size(),
                      groups.columns.rank() == 0,
                      groups.columns.rank() == 0 && (token_replicas(c) == 1 || out.assignment.coordinates.tp == 0),
                      out.assignment.world_rank,
                      kind_of(c.loss).loss_scale(c.loss)};
  const GradJudgement judgement = grad_judgement(c, oracle.reference().valid_tokens(), out.dtype);
  StageTrace trace("rank " + std::to_string(x.world_rank) + " verify");
  trace.mark("0 coverage");
  check_coverage(x);
  trace.mark("1 partials");
  const RowReference ref = reference_rows(x, trace);
  require_representable_reference(x, ref);
  trace.mark("3 elements: start");
  oracle.start_judging(ref.stats);  // the GPU oracle judges while the host goes on with the losses
  // per global token: this rank's largest gradient margin, then its loss margin (max-reduced below)
  std::vector<double> token_margins(error_map != nullptr ? static_cast<std::size_t>(2 * x.tokens) : 0, 0.0);
  trace.mark("5 losses");
  const LossFindings losses = judge_losses(x, ref, token_margins);
  const TokenValueFindings values = judge_token_values(x, ref);
  const StatisticFindings statistics = judge_statistics(x, ref);
  trace.mark("3 elements: wait");
  const std::span<const RowJudgement> judged = oracle.judged_rows();
  const GradFindings grad = collect_grad(x, judged, token_margins);
  trace.mark("4 tp checks");
  const TpFindings tp = judge_tp_group(x, ref, grad, judgement);
  trace.mark("6 census");
  const CensusRecord census = take_census(x, judged, grad.census);
  if (snapshot != nullptr) fill_snapshot(x, ref, judgement.framework_scale, *snapshot);

  trace.mark("7 merge");
  std::vector<CheckResult> results;
  results.push_back(loss_result(x, losses));
  results.push_back(grad_result(x, grad, judgement));
  const bool internal_gradient = c.loss.stage != nullptr && c.loss.stage->logit_gradient_internal();
  if (internal_gradient) internal_to_stage(results.back(), *c.loss.stage);
  {
    CheckResult r = make_result("rank_agreement", merge_over(world, tp.agreement), tp.agreement_tolerance,
                                "TP ranks of each token report the same loss");
    if (r.verdict == Verdict::not_applicable) r.summary = "one TP rank per token: nothing to compare";
    results.push_back(std::move(r));
  }
  results.push_back(finite_result(world, census));
  {
    const LossKind& kind = kind_of(c.loss);
    CheckResult r = make_result("row_sum", merge_over(world, tp.row_sum), tp.row_sum_tolerance, kind.row_sum_rule());
    if (const std::string why = kind.row_sum_exemption(c.loss); !why.empty()) r.summary = why;
    if (internal_gradient) internal_to_stage(r, *c.loss.stage);
    results.push_back(std::move(r));
  }
  if (const Stage* stage = c.loss.stage) {
    const std::vector<std::string> names = stage->gradients();
    for (std::size_t w = 0; w < names.size(); ++w) {
      ErrorStats mine;
      for (const RowJudgement& row : judged) {
        if (w < row.stage.size()) mine.merge(ErrorStats::unpack(row.stage[w]));
      }
      CheckResult r = make_result(
          names[w], merge_over(world, mine), judgement.tolerance,
          "the stage's gradient " + names[w] + " vs the float64 reference (stage " + std::string(stage->name()) + ")");
      results.push_back(std::move(r));
    }
    const std::vector<std::string> parameters = stage->parameters();
    const std::vector<PackedStats> judged_parameters = oracle.stage_parameters();
    for (std::size_t p = 0; p < parameters.size(); ++p) {
      ErrorStats mine;
      if (p < judged_parameters.size()) mine = ErrorStats::unpack(judged_parameters[p]);
      results.push_back(make_result(parameters[p], merge_over(world, mine), judgement.tolerance,
                                    "each rank's shard of the stage's parameter gradient " + parameters[p] +
                                        ", summed over its tokens, vs the float64 sum (stage " +
                                        std::string(stage->name()) + ")"));
    }
  }
  for (std::size_t j = 0; j < values.names.size(); ++j) {
    results.push_back(make_result(values.names[j], merge_over(world, values.stats[j]), values.tolerance,
                                  "per-token " + values.names[j] + " of every rank vs the float64 reference"));
  }
  if (!kind_of(c.loss).scope_values_name().empty()) results.push_back(scope_values_result(x, world));
  results.push_back(stats_result(x, losses, statistics));
  report_either_branch(ref.either_tokens, results);
  report_either_way(x.reference.row().either_way_tokens(), results);
  if (error_map != nullptr) fill_error_map(x, losses, grad, std::move(token_margins), *error_map);
  return results;
}

}  // namespace lossverify
