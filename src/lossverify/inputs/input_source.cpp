#include "lossverify/inputs/input_source.hpp"

#include "lossverify/inputs/philox_stream.hpp"

namespace lossverify {

InputSource::InputSource(const Case& c) : case_(c) {
  for (const RowOverride& row : c.inputs.overrides) overrides_[row.token] = &row;
}

template <class T, class Convert>
void InputSource::fill(std::int64_t token, std::int64_t begin, std::int64_t end, T* out, Convert convert) const {
  const auto it = overrides_.find(token);
  if (it != overrides_.end() && !it->second->logits.empty()) {
    const auto& row = it->second->logits;
    for (std::int64_t v = begin; v < end; ++v) out[v - begin] = convert(row[static_cast<std::size_t>(v)]);
    return;
  }
  const InputSpec& in = case_.inputs;
  const auto t = static_cast<std::uint64_t>(token);
  std::int64_t v = begin;
  double even = 0.0;
  double odd = 0.0;
  if (v < end && (v & 1)) {  // odd first column: the second value of its pair
    logit_pair(in.seed, InputStream::student_logits, t, static_cast<std::uint32_t>(v >> 1), in.distribution, in.mean,
               in.scale, &even, &odd);
    out[0] = convert(odd);
    ++v;
  }
  for (; v + 1 < end; v += 2) {
    logit_pair(in.seed, InputStream::student_logits, t, static_cast<std::uint32_t>(v >> 1), in.distribution, in.mean,
               in.scale, &even, &odd);
    out[v - begin] = convert(even);
    out[v + 1 - begin] = convert(odd);
  }
  if (v < end) {
    logit_pair(in.seed, InputStream::student_logits, t, static_cast<std::uint32_t>(v >> 1), in.distribution, in.mean,
               in.scale, &even, &odd);
    out[v - begin] = convert(even);
  }
}

void InputSource::logits(std::int64_t token, std::int64_t begin, std::int64_t end, double* out) const {
  const DType d = dtype();
  fill(token, begin, end, out, [d](double x) { return round_to_dtype(x, d); });
}
void InputSource::logits(std::int64_t token, std::int64_t begin, std::int64_t end, float* out) const {
  fill(token, begin, end, out, [](double x) { return static_cast<float>(x); });
}
void InputSource::logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::bfloat16* out) const {
  fill(token, begin, end, out, [](double x) { return Eigen::bfloat16(static_cast<float>(x)); });
}
void InputSource::logits(std::int64_t token, std::int64_t begin, std::int64_t end, Eigen::half* out) const {
  fill(token, begin, end, out, [](double x) { return Eigen::half(static_cast<float>(x)); });
}

std::int64_t InputSource::label(std::int64_t token) const {
  const auto it = overrides_.find(token);
  if (it != overrides_.end() && it->second->label) return *it->second->label;
  const InputSpec& in = case_.inputs;
  if (in.ignore_fraction > 0.0 &&
      token_uniform(in.seed, InputStream::token_mask, static_cast<std::uint64_t>(token)) < in.ignore_fraction) {
    return case_.loss.ignore_index;
  }
  return generated_label(in.seed, static_cast<std::uint64_t>(token), case_.shape.vocab);
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
