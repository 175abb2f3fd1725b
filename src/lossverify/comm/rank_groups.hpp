#pragma once
// The communicators a rank needs, cut from its world by the layout.
#include "lossverify/comm/communicator.hpp"

namespace lossverify {

struct RankGroups {
  Communicator& tp;     // ranks holding the same tokens, different vocabulary columns
  Communicator& batch;  // ranks holding different tokens (DP x CP), same TP coordinate
  Communicator& dp;     // ranks with the same TP and CP coordinates (for the statistics bug)
  Communicator& cp;     // ranks with the same TP and DP coordinates: the chunks of the same sequences
};

}  // namespace lossverify
