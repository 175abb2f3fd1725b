// Device input generation. This file is compiled with -fmad=false: the generator's arithmetic must not
// be contracted into FMAs, so every value equals the CPU generator's bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "lossverify/cuda/storage.hpp"
#include "lossverify/inputs/philox_stream.hpp"

namespace lossverify::cuda {

namespace {

template <class T>
__device__ T narrow(double x);
template <>
__device__ float narrow<float>(double x) {
  return __double2float_rn(x);
}
template <>
__device__ __nv_bfloat16 narrow<__nv_bfloat16>(double x) {
  return __float2bfloat16_rn(__double2float_rn(x));  // through float32, as on the CPU
}
template <>
__device__ __half narrow<__half>(double x) {
  return __float2half_rn(__double2float_rn(x));
}

template <class T>
__global__ void generate_kernel(GenerateArgs a, T* out) {
  const std::int64_t width = a.end - a.begin;
  const std::int64_t first_pair = a.begin >> 1;
  const std::int64_t last_pair = (a.end - 1) >> 1;
  for (std::int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const bool padding = a.row_is_padding[row] != 0;
    const auto stream = padding ? InputStream::pad_logits : static_cast<InputStream>(a.stream);
    const auto counter = static_cast<std::uint64_t>(a.row_counter[row]);
    const double mean = padding ? a.pad_mean : a.mean;
    const double scale = padding ? a.pad_scale : a.scale;
    T* row_out = out + row * width;
    for (std::int64_t k = first_pair + blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k <= last_pair;
         k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      double even = 0.0;
      double odd = 0.0;
      logit_pair(a.seed, stream, counter, static_cast<std::uint32_t>(k), static_cast<LogitDistribution>(a.distribution),
                 mean, scale, &even, &odd);
      const std::int64_t c0 = 2 * k;
      if (c0 >= a.begin && c0 < a.end) row_out[c0 - a.begin] = narrow<T>(even);
      if (c0 + 1 >= a.begin && c0 + 1 < a.end) row_out[c0 + 1 - a.begin] = narrow<T>(odd);
    }
  }
}

}  // namespace

void generate_logits(StorageType type, const GenerateArgs& args, void* out, void* stream) {
  if (args.rows == 0 || args.end <= args.begin) return;
  const std::int64_t pairs = ((args.end - 1) >> 1) - (args.begin >> 1) + 1;
  const dim3 block(256);
  const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>((pairs + 255) / 256, 1024)),
                  static_cast<unsigned>(std::min<std::int64_t>(args.rows, 65535)));
  auto s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case StorageType::fp32:
      generate_kernel<float><<<grid, block, 0, s>>>(args, static_cast<float*>(out));
      break;
    case StorageType::bf16:
      generate_kernel<__nv_bfloat16><<<grid, block, 0, s>>>(args, static_cast<__nv_bfloat16*>(out));
      break;
    case StorageType::fp16:
      generate_kernel<__half><<<grid, block, 0, s>>>(args, static_cast<__half*>(out));
      break;
  }
}

}  // namespace lossverify::cuda
