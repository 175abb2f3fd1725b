#pragma once
// The communicators a rank needs, cut from its world by the layout.
#include "lossverify/comm/communicator.hpp"

namespace lossverify {

struct RankGroups {
  Communicator& tp;       // ranks with the same CP and DP coordinates (same tokens, other columns; or, for whole
                          // rows, the same tokens replicated or, under layout.sp, the other parts of them)
  Communicator& batch;    // ranks holding different tokens: DP x CP, same TP coordinate (DP x CP x TP under sp)
  Communicator& dp;       // ranks with the same TP and CP coordinates (for the statistics bug)
  Communicator& cp;       // ranks with the same TP and DP coordinates: the chunks of the same sequences
  Communicator& columns;  // ranks holding slices of the same rows: tp where TP splits columns, else the rank alone
};

}  // namespace lossverify
