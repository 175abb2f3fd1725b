#include "lossverify/impl/catalogue.hpp"

namespace lossverify {

const std::vector<Implementation>& implementations() {
  static const std::vector<Implementation> list = [] {
    std::vector<Implementation> v;
    v.push_back({"correct", "SPEC 5 algorithm: max all-reduce, one packed sum all-reduce, no log(p)",
                 "lossverify", "none", {}, {}});
    {
      Implementation i{"smoothing-partition-vocab",
                       "label smoothing uses the shard width V_p and a shard-local mean log-probability",
                       "Megatron-LM tensor_parallel/cross_entropy.py before NVIDIA/Megatron-LM PR #5522 (issue #737)",
                       "TP rank losses disagree; non-target gradient off by -a(1/(V_p-1) - 1/(V-1)); "
                       "row sum -(TP-1) a V_p/(V_p-1)",
                       {"loss", "grad", "rank_agreement", "row_sum"},
                       {}};
      i.bugs.smoothing_vocab_local_forward = true;
      i.bugs.smoothing_sum_local_forward = true;
      i.bugs.smoothing_vocab_local_backward = true;
      v.push_back(i);
    }
    {
      Implementation i{"smoothing-log-after-exp",
                       "smoothing's mean log-probability taken as log(exp(x - M) / S)",
                       "Megatron-LM tensor_parallel/cross_entropy.py before NVIDIA/Megatron-LM PR #5522",
                       "loss = +inf once a row's logit gap exceeds ~103 (fp32 exp underflow)",
                       {"loss", "finite"},
                       {}};
      i.bugs.smoothing_log_after_exp = true;
      v.push_back(i);
    }
    return v;
  }();
  return list;
}

const Implementation* find_implementation(std::string_view name) {
  for (const auto& impl : implementations()) {
    if (impl.name == name) return &impl;
  }
  return nullptr;
}

}  // namespace lossverify
