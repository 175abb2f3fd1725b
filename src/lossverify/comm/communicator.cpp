#include "lossverify/comm/communicator.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lossverify {

std::size_t element_size(ElementType type) { return type == ElementType::f32 ? 4 : 8; }

namespace {

template <class T>
void reduce_typed(const void* const* inputs, int ranks, void* out, std::size_t begin, std::size_t end, ReduceOp op) {
  T* result = static_cast<T*>(out);
  const T* first = static_cast<const T*>(inputs[0]);
  for (std::size_t i = begin; i < end; ++i) result[i] = first[i];
  for (int r = 1; r < ranks; ++r) {
    const T* in = static_cast<const T*>(inputs[r]);
    if (op == ReduceOp::sum) {
      for (std::size_t i = begin; i < end; ++i) result[i] += in[i];
    } else {
      // NaN propagates: a max that dropped NaN would hide a broken rank.
      for (std::size_t i = begin; i < end; ++i) {
        if (in[i] > result[i] || in[i] != in[i]) result[i] = in[i];
      }
    }
  }
}

}  // namespace

void reduce_in_rank_order(const void* const* inputs, int ranks, void* out, std::size_t begin, std::size_t end,
                          ElementType type, ReduceOp op) {
  switch (type) {
    case ElementType::f32:
      reduce_typed<float>(inputs, ranks, out, begin, end, op);
      break;
    case ElementType::f64:
      reduce_typed<double>(inputs, ranks, out, begin, end, op);
      break;
    case ElementType::i64:
      reduce_typed<std::int64_t>(inputs, ranks, out, begin, end, op);
      break;
  }
}

void Communicator::gather_to_root(const void* mine, void* out, std::size_t bytes) {
  std::vector<unsigned char> all(static_cast<std::size_t>(size()) * bytes);
  all_gather(mine, all.data(), bytes);
  if (rank() == 0 && !all.empty()) std::memcpy(out, all.data(), all.size());
}

}  // namespace lossverify
