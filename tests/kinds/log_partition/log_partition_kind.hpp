#pragma once
// A loss kind that exists only for tests: the log-partition l = (1 / beta) log sum_v exp(beta x_v), cross-entropy
// without its target term at a sharpness beta (the setting "sharpness", 1 by default), with the gradient
// p_v = softmax(beta x)_v. Everything it is lives in this folder and reaches
// lossverify through register_loss_kind; nothing outside the folder names it.
namespace lossverify::testing {

inline constexpr const char* kLogPartition = "log_partition";
// Its first catalogued bug: the shard's own log-sum-exp, with no all-reduce of the sum over the TP group.
inline constexpr const char* kLogPartitionLocalSum = "log-partition-local-sum";
// Its second: the loss's 1 / beta left out (lse(beta x)); wrong only where beta != 1.
inline constexpr const char* kLogPartitionNoInverseSharpness = "log-partition-no-inverse-sharpness";

// Registers the kind (and its catalogue) once per process.
void register_log_partition();

}  // namespace lossverify::testing
