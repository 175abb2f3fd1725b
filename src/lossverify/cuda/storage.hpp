#pragma once
// What the CUDA backend and the GPU oracle share: the storage types of a shard and the Philox generator of
// its logits (plain data; nothing here includes CUDA headers).
#include <cstdint>

namespace lossverify::cuda {

enum class StorageType : int { fp32 = 0, bf16 = 1, fp16 = 2 };

// Logits of `rows` local rows, columns [begin, end), from the Philox streams: bit-identical to the CPU
// generator (the same HOST_DEVICE code, compiled without FMA contraction).
struct GenerateArgs {
  std::uint64_t seed;
  int stream;                       // InputStream of non-padding rows
  const std::int64_t* row_counter;  // per row: the token (or the padding counter for padding rows)
  const int* row_is_padding;        // per row: 1 for CP padding (pad_logits stream)
  std::int64_t rows;
  std::int64_t begin;
  std::int64_t end;
  int distribution;  // LogitDistribution
  double mean, scale;
  double pad_mean, pad_scale;
};
void generate_logits(StorageType type, const GenerateArgs& args, void* out, void* stream);

}  // namespace lossverify::cuda
