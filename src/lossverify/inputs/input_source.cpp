#include "lossverify/inputs/input_source.hpp"

#include "lossverify/kind_api/loss_kind.hpp"

#include <algorithm>

#include "lossverify/core/errors.hpp"
#include "lossverify/inputs/philox_stream.hpp"
#include "lossverify/layout/vocab_range.hpp"

namespace lossverify {

InputSource::InputSource(const Case& c) : case_(c), batch_(c.batch) {
  for (const RowOverride& row : c.inputs.overrides) overrides_[row.token] = &row;
  labels_.resize(static_cast<std::size_t>(std::max<std::int64_t>(c.shape.tokens, 0)));
  for (std::size_t t = 0; t < labels_.size(); ++t) labels_[t] = generated_label_of(static_cast<std::int64_t>(t));
  if (kind_of(c.loss).inputs().labels) place_labels_on_shard_edges();
  find_sequences_with_valid_tokens();
}

void InputSource::find_sequences_with_valid_tokens() {
  for (const Sequence& s : batch_.sequences()) {
    std::int64_t valid = 0;
    for (std::int64_t t = s.begin; t < s.begin + s.length; ++t) valid += is_valid(t) ? 1 : 0;
    sequence_has_valid_.push_back(valid > 0 ? 1 : 0);
    valid_tokens_ += valid;
  }
}

std::int64_t InputSource::valid_tokens() const { return valid_tokens_; }

namespace {

// The first and last column of every vocabulary shard at the case's swept TP degrees, then at TP 2, 4, 8 and 3
// (the shipped cases' own degrees are among these), with the vocabulary's own first and last first, without
// repeats (docs/cases.md, "Labels on shard edges"). The case's layout is not read: a run at another TP sees the
// same problem.
std::vector<std::int64_t> shard_edges(const Case& c) {
  const std::int64_t v = c.shape.vocab;
  std::vector<int> degrees = c.sweep.tp;
  std::sort(degrees.begin(), degrees.end());
  degrees.insert(degrees.end(), {2, 4, 8, 3});
  std::vector<std::int64_t> edges = {0, v - 1};
  for (const int tp : degrees) {
    if (tp < 2 || tp > v) continue;
    for (std::int64_t r = 1; r < tp; ++r) {
      const std::int64_t begin = vocab_shard_begin(v, tp, static_cast<int>(r));
      for (const std::int64_t e : {begin - 1, begin}) {
        if (std::find(edges.begin(), edges.end(), e) == edges.end()) edges.push_back(e);
      }
    }
  }
  return edges;
}

}  // namespace

// Whether a label falls on a shard's first or last column is otherwise left to chance (0.1 to 0.4 such labels
// expected per case and layout), so an off-by-one in a shard's ownership test could pass every case. Evenly spaced
// valid tokens (at most half of them; about 30 columns at most) take the shard edges' columns as labels instead. The
// choice reads the vocabulary, the case's sweep and the generated mask only, never the layout a run uses or the
// overrides: every layout sees one problem, and pinning rows (a bundle) changes no other label.
void InputSource::place_labels_on_shard_edges() {
  // The tokens the generator makes valid, overrides left out of the choice: a bundle that pins rows as overrides
  // replays the same labels everywhere else.
  const bool next = case_.batch.labels != BatchSpec::Labels::independent;
  std::vector<std::size_t> valid;
  for (std::size_t t = 0; t < labels_.size(); ++t) {
    const auto token = static_cast<std::int64_t>(t);
    if (!masked(token) && !(next && batch_.is_last_of_sequence(token))) valid.push_back(t);
  }
  const std::vector<std::int64_t> edges = shard_edges(case_);
  const std::size_t count = std::min(edges.size(), valid.size() / 2);
  if (count == 0) return;
  const std::size_t stride = valid.size() / count;
  // The token whose id is the label: the next one (next_token labels), or the token itself (independent). A token
  // whose label is overridden keeps the override (generated_label_of reads it first).
  for (std::size_t k = 0; k < count; ++k) {
    const auto t = static_cast<std::int64_t>(valid[k * stride + stride / 2]);
    placed_ids_[next ? t + 1 : t] = edges[k];
    labels_[static_cast<std::size_t>(t)] = generated_label_of(t);
  }
}

InputSource::InputSource(const Case& c, ExplicitInputs data) : case_(c), explicit_(true), batch_(c.batch) {
  const auto n = static_cast<std::size_t>(c.shape.tokens);
  const std::size_t row_bytes = static_cast<std::size_t>(c.shape.vocab) * dtype_size(c.inputs.dtype);
  const KindInputs reads = kind_of(c.loss).inputs();
  if (data.student.size() != n * row_bytes || (reads.teacher_logits && data.teacher.size() != n * row_bytes) ||
      (!reads.teacher_logits && !data.teacher.empty()) || (reads.labels && data.labels.size() != n) ||
      data.loss_mask.size() != n) {
    throw InternalError("explicit inputs do not match the case's shape and dtype");
  }
  const std::size_t token_inputs = kind_of(c.loss).token_inputs(c.loss).size();
  if (data.token_inputs.size() != token_inputs ||
      std::any_of(data.token_inputs.begin(), data.token_inputs.end(), [n](const auto& v) { return v.size() != n; })) {
    throw InternalError("explicit inputs do not hold the kind's per-token inputs");
  }
  for (const ExplicitInputs::StageTensor& t : data.stage) {
    if (t.rows < 0 || t.width < 0 || t.values.size() != static_cast<std::size_t>(t.rows * t.width)) {
      throw InternalError("explicit inputs: a stage tensor's values do not match its rows x width");
    }
  }
  explicit_stage_ = std::move(data.stage);
  explicit_token_inputs_ = std::move(data.token_inputs);
  cache_student_ = std::move(data.student);
  cache_teacher_ = std::move(data.teacher);
  explicit_labels_ = std::move(data.labels);
  explicit_mask_ = std::move(data.loss_mask);
  find_sequences_with_valid_tokens();
}

namespace {

double widen(double x, DType d) { return round_to_dtype(x, d); }
template <class T>
T narrow(double x) {
  return T(static_cast<float>(x));
}
template <>
float narrow<float>(double x) {
  return static_cast<float>(x);
}

}  // namespace

void InputSource::stage_values(InputStream stream, std::uint64_t row, std::int64_t begin, std::int64_t end,
                               double scale, double* out) const {
  if (explicit_) {
    const auto given = std::find_if(explicit_stage_.begin(), explicit_stage_.end(),
                                    [stream](const ExplicitInputs::StageTensor& t) { return t.stream == stream; });
    if (given == explicit_stage_.end() || row >= static_cast<std::uint64_t>(given->rows) || begin < 0 ||
        end > given->width || begin > end) {
      throw InternalError("explicit inputs: no stage tensor holds row " + std::to_string(row) + ", columns [" +
                          std::to_string(begin) + ", " + std::to_string(end) + ") of stream " +
                          std::to_string(static_cast<std::uint32_t>(stream)));
    }
    std::copy_n(&given->values[static_cast<std::size_t>(row) * static_cast<std::size_t>(given->width) +
                               static_cast<std::size_t>(begin)],
                end - begin, out);
    return;
  }
  const DType d = dtype();
  double even = 0.0, odd = 0.0;
  for (std::int64_t v = begin; v < end; ++v) {
    logit_pair(case_.inputs.seed, stream, row, static_cast<std::uint32_t>(v >> 1), LogitDistribution::normal, 0.0,
               scale, &even, &odd);
    out[v - begin] = widen((v & 1) != 0 ? odd : even, d);
  }
}

template <class T>
void InputSource::fill(InputStream stream, std::uint64_t counter_token, std::int64_t begin, std::int64_t end, T* out,
                       double mean, double scale, bool use_overrides) const {
  const DType d = dtype();
  auto convert = [d](double x) {
    if constexpr (std::is_same_v<T, double>) {
      return widen(x, d);
    } else {
      return narrow<T>(x);
    }
  };
  if (use_overrides) {
    const auto it = overrides_.find(static_cast<std::int64_t>(counter_token));
    if (it != overrides_.end() && !it->second->logits.empty()) {
      const auto& row = it->second->logits;
      for (std::int64_t v = begin; v < end; ++v) out[v - begin] = convert(row[static_cast<std::size_t>(v)]);
      return;
    }
  }
  const InputSpec& in = case_.inputs;
  std::int64_t v = begin;
  double even = 0.0;
  double odd = 0.0;
  if (v < end && (v & 1)) {  // odd first column: the second value of its pair
    logit_pair(in.seed, stream, counter_token, static_cast<std::uint32_t>(v >> 1), in.distribution, mean, scale, &even,
               &odd);
    out[0] = convert(odd);
    ++v;
  }
  for (; v + 1 < end; v += 2) {
    logit_pair(in.seed, stream, counter_token, static_cast<std::uint32_t>(v >> 1), in.distribution, mean, scale, &even,
               &odd);
    out[v - begin] = convert(even);
    out[v + 1 - begin] = convert(odd);
  }
  if (v < end) {
    logit_pair(in.seed, stream, counter_token, static_cast<std::uint32_t>(v >> 1), in.distribution, mean, scale, &even,
               &odd);
    out[v - begin] = convert(even);
  }
}

template <class T>
bool InputSource::read_cache(const std::vector<std::byte>& cache, std::int64_t token, std::int64_t begin,
                             std::int64_t end, T* out) const {
  if (cache.empty()) return false;
  const std::int64_t vocab = case_.shape.vocab;
  dispatch_dtype(dtype(), [&](auto type) {
    using S = typename decltype(type)::type;
    const S* row = reinterpret_cast<const S*>(cache.data()) + token * vocab;
    for (std::int64_t v = begin; v < end; ++v) {
      if constexpr (std::is_same_v<T, S>) {
        out[v - begin] = row[v];
      } else if constexpr (std::is_same_v<T, double>) {
        out[v - begin] = static_cast<double>(static_cast<float>(row[v]));
      } else {
        out[v - begin] = T(static_cast<float>(row[v]));
      }
    }
  });
  return true;
}

bool InputSource::materialize(int threads, std::size_t max_bytes) {
  if (explicit_) return true;  // the data is all in memory already
  const std::int64_t vocab = case_.shape.vocab;
  const std::int64_t n = case_.shape.tokens;
  const bool own_teacher = kind_of(case_.loss).inputs().teacher_logits && !case_.inputs.teacher.same_as_student;
  const std::size_t bytes = static_cast<std::size_t>(n * vocab) * dtype_size(dtype()) * (own_teacher ? 2 : 1);
  if (bytes > max_bytes) return false;
  std::vector<std::byte> student(static_cast<std::size_t>(n * vocab) * dtype_size(dtype()));
  std::vector<std::byte> teacher(own_teacher ? student.size() : 0);
  dispatch_dtype(dtype(), [&](auto type) {
    using S = typename decltype(type)::type;
    S* s_rows = reinterpret_cast<S*>(student.data());
    S* t_rows = reinterpret_cast<S*>(teacher.data());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (std::int64_t t = 0; t < n; ++t) {
      logits(t, 0, vocab, s_rows + t * vocab);
      if (own_teacher) teacher_logits(t, 0, vocab, t_rows + t * vocab);
    }
  });
  cache_student_ = std::move(student);
  cache_teacher_ = std::move(teacher);
  return true;
}

#define LOSSVERIFY_LOGITS(T)                                                                                         \
  void InputSource::logits(std::int64_t token, std::int64_t begin, std::int64_t end, T* out) const {                 \
    if (read_cache(cache_student_, token, begin, end, out)) return;                                                  \
    fill(InputStream::student_logits, static_cast<std::uint64_t>(token), begin, end, out, case_.inputs.mean,         \
         case_.inputs.scale, true);                                                                                  \
  }                                                                                                                  \
  void InputSource::teacher_logits(std::int64_t token, std::int64_t begin, std::int64_t end, T* out) const {         \
    const TeacherSpec& t = case_.inputs.teacher;                                                                     \
    if (t.same_as_student) {                                                                                         \
      logits(token, begin, end, out);                                                                                \
    } else if (!read_cache(cache_teacher_, token, begin, end, out)) {                                                \
      fill(InputStream::teacher_logits, static_cast<std::uint64_t>(token), begin, end, out, t.mean, t.scale, false); \
    }                                                                                                                \
  }
LOSSVERIFY_LOGITS(double)
LOSSVERIFY_LOGITS(float)
LOSSVERIFY_LOGITS(Eigen::bfloat16)
LOSSVERIFY_LOGITS(Eigen::half)
#undef LOSSVERIFY_LOGITS

#define LOSSVERIFY_PADDING(T)                                                                                          \
  void InputSource::padding_logits(std::int64_t sequence, std::int64_t position, std::int64_t begin, std::int64_t end, \
                                   T* out) const {                                                                     \
    fill(InputStream::pad_logits, (static_cast<std::uint64_t>(sequence) << 32) + static_cast<std::uint64_t>(position), \
         begin, end, out, case_.inputs.mean, case_.inputs.scale, false);                                               \
  }
LOSSVERIFY_PADDING(float)
LOSSVERIFY_PADDING(Eigen::bfloat16)
LOSSVERIFY_PADDING(Eigen::half)
#undef LOSSVERIFY_PADDING

std::int64_t InputSource::token_id(std::int64_t token) const {
  if (explicit_) return explicit_labels_.empty() ? 0 : explicit_labels_[static_cast<std::size_t>(token)];
  if (const auto placed = placed_ids_.find(token); placed != placed_ids_.end()) return placed->second;
  return generated_label(case_.inputs.seed, static_cast<std::uint64_t>(token), case_.shape.vocab);
}

bool InputSource::masked(std::int64_t token) const {
  if (explicit_) return explicit_mask_[static_cast<std::size_t>(token)] == 0;
  const InputSpec& in = case_.inputs;
  return in.ignore_fraction > 0.0 &&
         token_uniform(in.seed, InputStream::token_mask, static_cast<std::uint64_t>(token)) < in.ignore_fraction;
}

bool InputSource::is_valid(std::int64_t token) const {
  if (!kind_of(case_.loss).inputs().labels) return !masked(token);
  return label(token) != case_.loss.ignore_index;
}

std::int64_t InputSource::label(std::int64_t token) const {
  if (explicit_) {
    if (masked(token) || explicit_labels_.empty()) return case_.loss.ignore_index;
    return explicit_labels_[static_cast<std::size_t>(token)];
  }
  if (token >= 0 && static_cast<std::size_t>(token) < labels_.size()) return labels_[static_cast<std::size_t>(token)];
  return generated_label_of(token);
}

std::int64_t InputSource::generated_label_of(std::int64_t token) const {
  const auto it = overrides_.find(token);
  if (it != overrides_.end() && it->second->label) return *it->second->label;
  if (masked(token)) return case_.loss.ignore_index;
  if (case_.batch.labels == BatchSpec::Labels::independent) return token_id(token);
  if (batch_.is_last_of_sequence(token)) return case_.loss.ignore_index;
  return token_id(token + 1);
}

double InputSource::upstream_weight(std::int64_t token) const {
  const UpstreamWeights& w = case_.loss.upstream_weights;
  switch (w.kind) {
    case UpstreamWeights::Kind::explicit_list:
      return w.values[static_cast<std::size_t>(token)];
    case UpstreamWeights::Kind::uniform:
      return w.low + (w.high - w.low) * token_uniform(case_.inputs.seed, InputStream::upstream_weights,
                                                      static_cast<std::uint64_t>(token));
    case UpstreamWeights::Kind::ones:
    default:
      return 1.0;
  }
}

}  // namespace lossverify
