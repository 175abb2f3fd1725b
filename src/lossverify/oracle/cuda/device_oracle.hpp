#pragma once
// The GPU oracle behind the Oracle seam: the float64 reference kernels (gpu_reference.hpp) on the oracle's own
// copy of a rank's inputs, judging the rank's gradient where it stayed, on its GPU (read only).
#include <memory>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/oracle.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/oracle/cuda/reference_kernels.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::cuda {

struct OracleShard;

// `shard` is the oracle's inputs, made (and generating) before the implementation ran; `out` the rank's
// outputs, its gradient on the device (out.device_shard). `whole_rows` (TP = 1, cross-entropy): the
// comparison is queued right behind the partials, taking each row's lse from them on the device.
// Row k of a comparison on the device as the checks read it (global token and column, the rank).
RowJudgement row_judgement(const RankOutput& out, std::size_t k, const RowComparison& compared);

std::unique_ptr<Oracle> make_device_oracle(const Case& c, const InputSource& inputs, std::shared_ptr<OracleShard> shard,
                                           const RankOutput& out, const GradJudgement& judgement, bool whole_rows);

}  // namespace lossverify::cuda
