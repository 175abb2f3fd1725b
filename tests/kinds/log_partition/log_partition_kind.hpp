#pragma once
// A loss kind that exists only for tests: the log-partition l = log sum_v exp(x_v), cross-entropy without its
// target term, with the gradient p_v = softmax(x)_v. Everything it is lives in this folder and reaches
// lossverify through register_loss_kind; nothing outside the folder names it.
namespace lossverify::testing {

inline constexpr const char* kLogPartition = "log_partition";
// Its one catalogued bug: the shard's own log-sum-exp, with no all-reduce of the sum over the TP group.
inline constexpr const char* kLogPartitionLocalSum = "log-partition-local-sum";

// Registers the kind (and its catalogue) once per process.
void register_log_partition();

}  // namespace lossverify::testing
