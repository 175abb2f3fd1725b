#pragma once
// Label smoothing's two conventions (docs/spec.md §3): a case setting, read by the kernels and the reference.
namespace lossverify {

enum class SmoothingConvention { pytorch, megatron };

}  // namespace lossverify
