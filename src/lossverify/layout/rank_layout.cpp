#include "lossverify/layout/rank_layout.hpp"

namespace lossverify {

RankCoordinates coordinates_of(int world_rank, const LayoutSpec& layout) {
  RankCoordinates c;
  c.tp = world_rank % layout.tp;
  c.cp = (world_rank / layout.tp) % layout.cp;
  c.dp = world_rank / (layout.tp * layout.cp);
  return c;
}

int world_rank_of(const RankCoordinates& c, const LayoutSpec& layout) {
  return (c.dp * layout.cp + c.cp) * layout.tp + c.tp;
}

namespace {

// (dp, micro-batch) slot of a sequence.
std::pair<int, int> slot_of(std::int64_t sequence, std::int64_t sequences, const BatchSpec& spec,
                            const LayoutSpec& layout) {
  const std::int64_t slots = static_cast<std::int64_t>(layout.dp) * layout.ga;
  if (spec.placement == BatchSpec::Placement::round_robin) {
    return {static_cast<int>(sequence % layout.dp), static_cast<int>((sequence / layout.dp) % layout.ga)};
  }
  // contiguous: slot s (= dp * GA + micro_batch) takes sequences [floor(s n / slots), floor((s + 1) n / slots)):
  // the sequence's slot is the largest s whose first sequence is at or before it.
  std::int64_t lo = 0;
  std::int64_t hi = slots - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (mid * sequences / slots <= sequence) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const std::int64_t s = lo;
  return {static_cast<int>(s / layout.ga), static_cast<int>(s % layout.ga)};
}

}  // namespace

std::vector<std::int64_t> sequences_of_slot(const GlobalBatch& batch, const BatchSpec& spec, const LayoutSpec& layout,
                                            int dp, int micro_batch) {
  std::vector<std::int64_t> out;
  const auto n = static_cast<std::int64_t>(batch.sequences().size());
  for (std::int64_t s = 0; s < n; ++s) {
    const auto [d, k] = slot_of(s, n, spec, layout);
    if (d == dp && k == micro_batch) out.push_back(s);
  }
  return out;
}

std::int64_t padded_length(std::int64_t length, std::int64_t pad_multiple) {
  return (length + pad_multiple - 1) / pad_multiple * pad_multiple;
}

std::vector<LocalRow> zigzag_rows(const GlobalBatch& batch, const std::vector<std::int64_t>& sequences, int cp,
                                  int cp_rank, std::int64_t pad_multiple) {
  std::vector<LocalRow> rows;
  const std::int64_t chunks = 2 * static_cast<std::int64_t>(cp);
  for (std::int64_t s : sequences) {
    const Sequence& seq = batch.sequences()[static_cast<std::size_t>(s)];
    const std::int64_t padded = padded_length(seq.length, pad_multiple);
    const std::int64_t chunk = padded / chunks;  // H
    for (std::int64_t which : {static_cast<std::int64_t>(cp_rank), chunks - 1 - cp_rank}) {
      for (std::int64_t j = 0; j < chunk; ++j) {
        const std::int64_t position = which * chunk + j;
        rows.push_back({position < seq.length ? seq.begin + position : -1, s, position});
      }
    }
  }
  return rows;
}

TokenPlace locate_token(const GlobalBatch& batch, const BatchSpec& spec, const LayoutSpec& layout, std::int64_t token) {
  TokenPlace p;
  if (token < 0 || token >= batch.tokens()) return p;
  p.sequence = batch.sequence_of(token);
  const Sequence& seq = batch.sequences()[static_cast<std::size_t>(p.sequence)];
  p.position = token - seq.begin;
  const auto [d, k] = slot_of(p.sequence, static_cast<std::int64_t>(batch.sequences().size()), spec, layout);
  p.dp = d;
  p.micro_batch = k;
  const std::int64_t chunks = 2 * static_cast<std::int64_t>(layout.cp);
  const std::int64_t chunk_length = padded_length(seq.length, chunks) / chunks;
  p.chunk = static_cast<int>(p.position / chunk_length);
  p.cp = p.chunk < layout.cp ? p.chunk : static_cast<int>(chunks - 1 - p.chunk);
  return p;
}

std::vector<LocalRow> sequence_parallel_part(const std::vector<LocalRow>& rows, int tp, int tp_rank) {
  std::vector<LocalRow> padded = rows;
  while (padded.size() % static_cast<std::size_t>(tp) != 0) {
    LocalRow pad;
    if (!rows.empty()) {
      pad.sequence = rows.back().sequence;
      pad.position = padded.back().position + 1;
    }
    padded.push_back(pad);
  }
  const std::size_t part = padded.size() / static_cast<std::size_t>(tp);
  const auto begin = padded.begin() + static_cast<std::ptrdiff_t>(part * static_cast<std::size_t>(tp_rank));
  return {begin, begin + static_cast<std::ptrdiff_t>(part)};
}

std::vector<std::int64_t> sequence_parallel_slots(std::int64_t rows, int tp, int tp_rank) {
  const std::int64_t part = (rows + tp - 1) / tp;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(part));
  for (std::int64_t j = 0; j < part; ++j) {
    const std::int64_t slot = part * tp_rank + j;
    slots[static_cast<std::size_t>(j)] = slot < rows ? slot : -1;
  }
  return slots;
}

}  // namespace lossverify
