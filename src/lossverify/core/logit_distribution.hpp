#pragma once
// How generated logits are drawn (a case's inputs.distribution), a plain type the generator and the kinds share.

namespace lossverify {

// separated: normal values snapped to a grid of step scale / 4 plus an offset distinct for each of 4096 consecutive
// columns, so that any two of them differ by at least scale / 32768 (router logits with a clear top-k margin).
enum class LogitDistribution : int { normal = 0, uniform = 1, separated = 2 };

}  // namespace lossverify
